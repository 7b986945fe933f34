"""The hf engine's decode speed against the memory-bandwidth roofline of the same requests.

For each engine dtype and each count of concurrent requests (every request `--new-tokens` sampled tokens after
a prompt of `--prompt-tokens` random ids, all submitted at once, no prefix cache): tokens/s of a timed generation
after a full warm-up, and on a GPU the share of a profiled generation's wall time the GPU was busy (profiling.py).

The roofline: a decode step reads the weights it uses and the KV cache of every row, and no step can beat that
traffic over the memory bandwidth. Per step: every matmul weight in the engine dtype, the experts' scaled by the
share of experts B rows choosing k of E each touch, 1 − (1 − k/E)^B under uniform routing (~1 at 64 rows; a
random-init router is near uniform); of the input embedding only the B rows gathered; and per row and layer
2 × kv_heads × head_dim values of KV per token of context, at the mean context over the generation (prompt +
new tokens / 2). bound = B × bandwidth / bytes per step. The measured time includes the prefill, so the share
of the bound is slightly pessimistic. Bandwidth: from the GPU's name (H200 4.8 TB/s, H100 SXM 3.35 TB/s, ...) or
`--bandwidth-gbs`; on the CPU only with `--bandwidth-gbs`.

Each run is repeated in each of `--modes`: `N` decodes N steps between two reads of the tokens back (the engine's
decode_window: on a GPU the host queues a window's steps ahead of the kernels), `N+graphs` also replays each step
as a CUDA graph (engine.cuda_graphs). `vs_first` is a mode's tokens/s over the first mode's, in the same run.

    python benchmarks/decode_bench.py --device cuda           # "1b" in bfloat16, 16 and 64 requests, 1 8 8+graphs
    python benchmarks/decode_bench.py                         # the tiny model on the CPU: 4 requests x 16 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import harness
import torch
from profiling import profiled

from agentrl.engine.base import SamplingParams
from agentrl.engine.hf import HFEngine

BANDWIDTH_GBS = {"H200": 4800, "H100 PCIe": 2000, "H100 NVL": 3900, "H100": 3350, "A100-SXM4-80GB": 2039}
"""Peak memory bandwidth, GB/s, by a part of the GPU's name (the first that matches, in this order)"""


def bandwidth_gbs(name: str) -> float | None:
    return next((bw for part, bw in BANDWIDTH_GBS.items() if part in name), None)


def roofline(model, rows: int, prompt_tokens: int, new_tokens: int, bandwidth: float | None) -> dict:
    """Bytes a decode step of `rows` rows reads, and the tokens/s that bandwidth (GB/s) allows."""
    cfg = model.config
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    experts_read = 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** rows
    weights = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if p is embedding and not tied:
            size = rows * p.shape[1] * p.element_size()
        elif ".experts." in name:
            size *= experts_read
        weights += size
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * embedding.element_size()
    kv = rows * (prompt_tokens + new_tokens / 2) * kv_per_token
    out = {"weight_bytes": weights, "kv_bytes": kv, "experts_read_share": experts_read, "bandwidth_gbs": bandwidth}
    if bandwidth is not None:
        out["tokens_per_s_bound"] = rows * bandwidth * 1e9 / (weights + kv)
    return out


async def generations(engine: HFEngine, prompts: list[list[int]], params: SamplingParams, cuda: bool, top: int):
    """A warm-up, a timed generation (its tokens and seconds) and on a GPU a profiled one (its summary)."""
    async with engine:
        await harness.generate_all(engine, prompts, params)  # kernels chosen, allocator warm
        t0 = time.perf_counter()
        gens = await harness.generate_all(engine, prompts, params)
        seconds = time.perf_counter() - t0
        summary = None
        if cuda:
            with profiled(cuda, top) as summary:
                await harness.generate_all(engine, prompts, params)
    return sum(len(g.token_ids) for g in gens), seconds, summary


def parse_mode(mode: str) -> tuple[int, bool]:
    """`N` or `N+graphs`: (decode window, CUDA graphs)."""
    window, _, graphs = mode.partition("+")
    if not window.isdigit() or graphs not in ("", "graphs"):
        raise SystemExit(f"--modes {mode}: give N or N+graphs, N the decode window")
    return int(window), graphs == "graphs"


def bench(args: argparse.Namespace) -> dict:
    cuda = args.device == "cuda"
    gpu = torch.cuda.get_device_name() if cuda else None
    bandwidth = args.bandwidth_gbs or (bandwidth_gbs(gpu) if gpu else None)
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens)
    cfg = harness.model_config(args.size)
    result: dict = {
        "device": args.device,
        "gpu": gpu,
        "size": args.size,
        "model": harness.describe_model(cfg),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "bandwidth_gbs": bandwidth,
        "machine": harness.machine("torch", "transformers"),
        "runs": [],
    }
    g = torch.Generator().manual_seed(0)
    for dtype in args.dtypes:
        model = harness.random_model(args.size, args.device).to(getattr(torch, dtype)).eval()
        for rows in args.requests:
            prompts = torch.randint(10, cfg.vocab_size, (rows, args.prompt_tokens), generator=g).tolist()
            first = None  # tokens/s of the first mode
            for mode in args.modes:
                window, graphs = parse_mode(mode)
                engine = HFEngine(
                    model, max_batch_size=rows, prefix_cache_tokens=0, decode_window=window, cuda_graphs=graphs
                )
                tokens, seconds, summary = asyncio.run(generations(engine, prompts, params, cuda, args.top))
                run = {
                    "dtype": dtype,
                    "requests": rows,
                    "mode": mode,
                    "tokens_per_s": tokens / seconds,
                    "generate_s": seconds,
                }
                first = first or run["tokens_per_s"]
                run["vs_first"] = run["tokens_per_s"] / first
                if graphs:
                    run["graphs_captured"] = engine.graphs_captured
                run["roofline"] = roofline(model, rows, args.prompt_tokens, args.new_tokens, bandwidth)
                if "tokens_per_s_bound" in run["roofline"]:
                    run["share_of_bound"] = run["tokens_per_s"] / run["roofline"]["tokens_per_s_bound"]
                if summary is not None:
                    run["gpu_busy_share"] = summary["gpu_busy_share"]
                    run["profile"] = summary
                result["runs"].append(run)
        del model
        if cuda:
            torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", choices=harness.SIZES, help="default: 1b on cuda, tiny on the CPU")
    p.add_argument("--dtypes", nargs="+", help="engine weight dtypes; default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--requests", nargs="+", type=int, help="concurrent requests; default: 16 64 on cuda, 4 on cpu")
    p.add_argument("--prompt-tokens", type=int, help="default: 512 on cuda, 32 on cpu")
    p.add_argument("--new-tokens", type=int, help="default: 256 on cuda, 16 on cpu")
    p.add_argument(
        "--modes", nargs="+", help="N or N+graphs (decode window, CUDA graphs); default: 1 8 8+graphs on cuda"
    )
    p.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth for the roofline (default: by GPU name)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per profiled run")
    args = p.parse_args()
    cuda = args.device == "cuda"
    defaults = {
        "size": "1b" if cuda else "tiny",
        "dtypes": ["bfloat16"] if cuda else ["float32"],
        "requests": [16, 64] if cuda else [4],
        "prompt_tokens": 512 if cuda else 32,
        "new_tokens": 256 if cuda else 16,
        "modes": ["1", "8", "8+graphs"] if cuda else ["1"],
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    print(json.dumps(bench(args), indent=2))


if __name__ == "__main__":
    main()
