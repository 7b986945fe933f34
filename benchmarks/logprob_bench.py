"""Chunked target logprobs (`agentrl.train.logprobs`) against the whole-logits path.

Each path runs forward and backward in a fresh process (so peak RSS is its own) on random
hidden states and output head, timed and measured in the same run:

    python benchmarks/logprob_bench.py [--tokens 2048] [--hidden 256] [--vocab 151936]   # prints one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import torch

CHILD = """
import json, resource, sys, time, torch
from agentrl.train.logprobs import naive_target_logprobs, target_logprobs
path, T, H, V = sys.argv[1], *map(int, sys.argv[2:])
torch.manual_seed(0)
hidden = torch.randn(1, T, H, requires_grad=True)
head = (torch.randn(V, H) / H**0.5).requires_grad_(True)
targets = torch.randint(0, V, (1, T))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
lp = naive_target_logprobs(hidden @ head.T, targets) if path == "naive" else target_logprobs(hidden, head, targets)[0]
lp.sum().backward()
wall = time.perf_counter() - t0
peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({"forward_backward_s": wall, "peak_mb_above_inputs": peak, "lp_sum": float(lp.sum())}))
"""


def run(path: str, tokens: int, hidden: int, vocab: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, path, str(tokens), str(hidden), str(vocab)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, nargs="+", default=[32_000, 151_936])
    args = p.parse_args()
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "tokens": args.tokens,
        "hidden": args.hidden,
    }
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
