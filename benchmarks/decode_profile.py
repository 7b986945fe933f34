"""Where the hf engine's decoding spends its GPU time, per engine dtype: tokens/s, the GPU's busy time against the
wall time (a decode loop the GPU waits on is launch- or host-bound), and the kernels with the most time.

The model and requests are gpu_check's `hf_engine` check's (a random-init Qwen3-MoE folder with the project
tokenizer; 16 requests of 128 sampled tokens on a GPU), so the two measure the same thing; the generation runs
once to warm up, once timed, and on a GPU once more under torch.profiler. The engine decodes in a thread of its
own, whose CPU ops torch.profiler does not record (it follows the thread that started it), but CUDA's kernels are
recorded from every thread: on the CPU only tokens/s are reported.

    python benchmarks/decode_profile.py --device cuda --size 1b        # prints one JSON object
    python benchmarks/decode_profile.py                                # the tiny model on the CPU (4 x 16 tokens)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import harness
import torch
from profiling import profiled

from agentrl.engine import EngineConfig, EngineModel, build_engine
from agentrl.engine.base import SamplingParams


async def timed_and_profiled(engine, requests: list[list[int]], params: SamplingParams, cuda: bool, top: int):
    """Every request at once, on the open engine: a warm-up, a timed run (its generations and seconds), and on
    a GPU a profiled run (its summary, profiling.py's)."""

    async with engine:
        await harness.generate_all(engine, requests, params)  # kernels chosen, caches allocated
        t0 = time.perf_counter()
        gens = await harness.generate_all(engine, requests, params)
        seconds = time.perf_counter() - t0
        if not cuda:
            return gens, seconds, None
        with profiled(cuda, top) as summary:
            await harness.generate_all(engine, requests, params)
    return gens, seconds, summary


def decode(args: argparse.Namespace, workdir: Path) -> dict:
    """Each engine dtype's figures, on a model folder kept in `workdir`."""
    cuda = args.device == "cuda"
    path = harness.model_folder(workdir, args.size, args.device)
    n, T = (16, 128) if cuda else (4, 16)
    params = SamplingParams(temperature=1.0, max_tokens=T)
    requests = harness.prompts(n)
    result: dict = {"size": args.size, "device": args.device, "requests": n, "max_tokens": T, "engines": {}}
    for dtype in args.dtypes:
        engine = build_engine(EngineConfig(kind="hf", dtype=dtype), EngineModel(path=str(path), device=args.device))
        gens, seconds, summary = asyncio.run(timed_and_profiled(engine, requests, params, cuda, args.top))
        tokens = sum(len(g.token_ids) for g in gens)
        entry = result["engines"][dtype] = {
            "weights": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
            "tokens_per_s": tokens / seconds,
            "generate_s": seconds,
        }
        if summary is not None:
            entry["profile"] = summary
        del engine
        if cuda:
            torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", choices=harness.SIZES, default="tiny")
    p.add_argument("--dtypes", nargs="+", default=["auto", "bfloat16"], help="engine.dtype values to compare")
    p.add_argument("--top", type=int, default=12, help="kernels listed per dtype")
    p.add_argument("--workdir", type=Path, help="keep the model folder here (default: a temporary folder)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentrl-decode-") as tmp:  # the 1b folder is gigabytes: not left behind
        print(json.dumps(decode(args, args.workdir or Path(tmp)), indent=2))


if __name__ == "__main__":
    main()
