"""Chunked target logprobs (`agentrl.train.logprobs`) against the whole-logits path.

Each path runs forward and backward in a fresh process (so peak RSS is its own) on random
hidden states and output head, timed and measured in the same run:

    python benchmarks/logprob_bench.py [--tokens 2048] [--hidden 256] [--vocab 151936]   # prints one JSON object
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import harness
import torch


def child(path: str, T: int, H: int, V: int) -> None:
    """One path's forward and backward in this process: its seconds and peak RSS above the inputs', as JSON."""
    from agentrl.train.logprobs import naive_target_logprobs, target_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(1, T, H, requires_grad=True)
    head = (torch.randn(V, H) / H**0.5).requires_grad_(True)
    targets = torch.randint(0, V, (1, T))
    before = harness.proc_kib("VmHWM")
    t0 = time.perf_counter()
    if path == "naive":
        lp = naive_target_logprobs(hidden @ head.T, targets)
    else:
        lp = target_logprobs(hidden, head, targets)[0]
    lp.sum().backward()
    wall = time.perf_counter() - t0
    peak = (harness.proc_kib("VmHWM") - before) / 1024
    print(json.dumps({"forward_backward_s": wall, "peak_mb_above_inputs": peak, "lp_sum": float(lp.sum())}))


def run(path: str, tokens: int, hidden: int, vocab: int) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--tokens", tokens, "--hidden", hidden, "--vocab", vocab]
    out = subprocess.run([str(a) for a in cmd], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, nargs="+", default=[32_000, 151_936])
    p.add_argument("--child", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.tokens, args.hidden, args.vocab[0])  # run() passes one vocabulary
        return
    result = {"machine": harness.machine("torch"), "tokens": args.tokens, "hidden": args.hidden}
    for vocab in args.vocab:
        naive, chunked = (run(path, args.tokens, args.hidden, vocab) for path in ("naive", "chunked"))
        result[f"vocab_{vocab}"] = {
            "naive": naive,
            "chunked": chunked,
            "memory_ratio": chunked["peak_mb_above_inputs"] / naive["peak_mb_above_inputs"],
            "time_ratio": chunked["forward_backward_s"] / naive["forward_backward_s"],
            "same_result": abs(chunked["lp_sum"] - naive["lp_sum"]) <= 1e-5 * abs(naive["lp_sum"]),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
