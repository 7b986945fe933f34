"""Tokens per second of one GSPO-token update, next to the same model's plain forward+backward.

A random-init Qwen3-MoE, a synthetic batch (prompt, generated turns and an observation per
sequence), `Trainer.update` with M minibatches (chunked logprobs, loss, router aux loss,
the extra no-grad pass for the expert flip rate) against `model(ids, labels=ids).loss`
forward and backward on the same minibatches, timed in the same run, interleaved: each of
`--rounds` rounds times the update, then the plain pass; the figures are the medians over rounds
(so a machine that slows down mid-run slows both):

    python benchmarks/train_step_bench.py                          # CPU, fp32, a small MoE (14M parameters, 5M active)
    python benchmarks/train_step_bench.py --device cuda --size 1b  # GPU, bf16 FSDP2, a 1B+ MoE, with MFU
    python benchmarks/train_step_bench.py --dtype bfloat16         # the GPU path's code on the CPU (gloo)
    python benchmarks/train_step_bench.py --device cuda --size 1b --step-tokens 32768 --microbatch-tokens 8192
    python benchmarks/train_step_bench.py --device cuda --size 1b --compile   # model.compile, the plain pass's too

The step size: `--batch` rows of `--length` tokens in `--minibatches` optimizer steps, or `--step-tokens`, the
tokens of one optimizer step (the rows follow from it); `--microbatch-tokens` is the trainer's token budget per
forward (optim.microbatch_tokens), which the plain baseline keeps too. `--compile` is model.compile (each decoder
layer's MLP compiled), on both paths; the warm-up call before the timed ones pays the compile, and
`first_update_s` says how long it took.

MFU (on CUDA), over the GPU's dense bf16 peak: `mfu` counts 6 × the matmul parameters active per token (not the
input embedding) plus attention's 12·L·H·Q·T, as PaLM does (harness.train_flops_per_token); `mfu_6n` is the
earlier reports' 6 × the active parameters, embeddings included, for continuity.

bfloat16 is FSDP2's mixed precision (bf16 compute, fp32 master weights and reduction) over a
process group of one, exactly as `agentrl train` runs a single GPU; the plain baseline is the same
model wrapped the same way. Under torchrun every rank runs it and the figures are per GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import harness
import torch
import torch.distributed as dist
from profiling import profiled

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, per GPU


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=harness.SIZES, default="small")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--step-tokens", type=int, help="tokens per optimizer step: sets --batch to fit it")
    p.add_argument("--microbatch-tokens", type=int, default=0, help="optim.microbatch_tokens (0: none)")
    p.add_argument("--compile", action="store_true", help="model.compile: each decoder layer's MLP, both paths")
    p.add_argument("--repeats", type=int, default=2, help="calls timed per path and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (update, plain), interleaved; medians reported")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timed rounds, one update and one plain pass under torch.profiler: the N kernels "
        "with the most time and the GPU's busy share (cuda), or the N ops with the most self time "
        "(cpu), in the JSON under 'profile'",
    )
    args = p.parse_args()
    if args.step_tokens:
        args.batch = args.minibatches * -(-args.step_tokens // args.length)
    from transformers import AutoModelForCausalLM

    from agentrl.train.config import ModelConfig, OptimConfig, TrainerConfig
    from agentrl.train.policy import init_distributed, prepare, shutdown_distributed
    from agentrl.train.trainer import Trainer

    cuda = args.device == "cuda"
    if cuda != torch.cuda.is_available():
        p.error(
            f"--device {args.device}, but torch.cuda.is_available() is {torch.cuda.is_available()} "
            "(the trainer takes the GPU when there is one: CUDA_VISIBLE_DEVICES= hides it)"
        )
    model_cfg = ModelConfig(dtype=args.dtype or ("bfloat16" if cuda else "float32"), compile=args.compile)
    lead = init_distributed(model_cfg)  # bfloat16: FSDP2 over a group of one (or torchrun's ranks)
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = harness.model_config(args.size)

    def fresh_model() -> torch.nn.Module:  # fp32 master weights, identical each time
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg)

    model = fresh_model()
    optim = OptimConfig(lr=1e-6, minibatches=args.minibatches, microbatch_tokens=args.microbatch_tokens)
    trainer = Trainer(TrainerConfig(model=model_cfg, optim=optim), model)
    plain_model = fresh_model()
    prepare(plain_model, model_cfg, trainer.device)
    batch = harness.synthetic_batch(args.batch, args.length, cfg.vocab_size, trainer.device)
    tokens = int(batch.attention_mask.sum())  # over all ranks: each scores its share of every minibatch
    rank = dist.get_rank() if dist.is_initialized() else 0

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    first: list[float] = []  # the warm-up calls' seconds: the first update's pays a compile (--compile)

    def timed(fn) -> tuple[float, float | None]:
        """Seconds per call, and the peak of the GPU memory torch allocated over its calls (GiB)."""
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn()  # warm-up
        sync()
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        sync()
        return (time.perf_counter() - t0) / args.repeats, harness.gpu_peak_gib()

    # the plain pass's forwards: the trainer's (every row is `--length` long, so a micro-batch is as many rows as fit)
    per_forward = max(1, args.microbatch_tokens // args.length) * world if args.microbatch_tokens else args.batch

    def plain() -> None:
        for minibatch in torch.arange(args.batch).chunk(args.minibatches):
            for rows in minibatch.split(per_forward):
                mine = rows[rank::world]
                ids = batch.input_ids[mine if len(mine) else rows[:1]]  # more ranks than rows: a stand-in
                plain_model(input_ids=ids, labels=ids).loss.backward()
            plain_model.zero_grad(set_to_none=True)

    rounds = [(timed(lambda: trainer.update(batch)), timed(plain)) for _ in range(args.rounds)]
    update_s = statistics.median(u[0] for u, _ in rounds)
    plain_s = statistics.median(q[0] for _, q in rounds)
    update_gib, plain_gib = rounds[-1][0][1], rounds[-1][1][1]
    fsdp = f"FSDP2 over {world} rank(s)" if dist.is_initialized() else "one plain process"
    result = {
        "machine": harness.machine("torch"),
        "model": harness.describe_model(cfg, f"qwen3_moe {args.size}"),
        "setup": f"{model_cfg.dtype}, {fsdp}",
        "batch": f"{args.batch} x {args.length} tokens, {args.minibatches} minibatches",
        "tokens_per_step": tokens // args.minibatches,
        # transformers' kernel for the experts (grouped_mm, batched_mm or eager)
        "experts_implementation": model.config._experts_implementation,
        "microbatch_tokens": args.microbatch_tokens,
        "compile": args.compile,
        "first_update_s": first[0],
        "gspo_token_update": {"s": update_s, "tokens_per_s_per_device": tokens / world / update_s},
        "plain_forward_backward": {"s": plain_s, "tokens_per_s_per_device": tokens / world / plain_s},
        "update_vs_plain": statistics.median(q[0] / u[0] for u, q in rounds),
        "update_vs_plain_per_round": [q[0] / u[0] for u, q in rounds],
    }
    if cuda:
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in torch.cuda.get_device_name()), None)
        result["mfu_definition"] = (
            "mfu: (6 x matmul parameters active per token, input embedding excluded, + 12·L·H·Q·T attention) x "
            "tokens/s over the dense bf16 peak (PaLM); mfu_6n: 6 x active parameters incl. embeddings (earlier reports)"
        )
        for key, gib in (("gspo_token_update", update_gib), ("plain_forward_backward", plain_gib)):
            per_s = result[key]["tokens_per_s_per_device"]
            result[key]["mfu"] = harness.train_flops_per_token(cfg, args.length) * per_s / peak if peak else None
            result[key]["mfu_6n"] = 6 * harness.active_params(cfg) * per_s / peak if peak else None
            result[key]["peak_memory_gib"] = gib  # both models' weights are resident in either path
    if args.profile:
        result["profile"] = {}
        for name, fn in (("update", lambda: trainer.update(batch)), ("plain", plain)):  # warm: the rounds ran them
            with profiled(cuda, args.profile) as summary:
                fn()
            result["profile"][name] = summary
    if lead:
        print(json.dumps(result, indent=2))
    shutdown_distributed()


if __name__ == "__main__":
    main()
