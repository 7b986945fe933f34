"""GiGPO against per-turn return-to-go: `agentrl train --env code_sandbox` with `algo.advantage=gigpo` and with the
default `algo.advantage=turn`, per seed, the same number of iterations (the same work: equal wall time, measured).

Each run is the default recipe with `seed=S`, `algo.advantage=A`, `--iterations` iterations of `--groups` groups
(the recipe's 8 episodes a group), held-out evaluation before iteration 0 and after the last only (`eval.every=0`) on
the first `--tasks` tasks of the test split, no extra benchmarks, env workers in process and bwrap sandboxes
(`--backend docker`: Docker, env workers still in process). The arms alternate (seed 0 turn, seed 0 gigpo, seed 1
turn, ...) so that the machine's load falls on both alike. The baseline is the turn arm of the same invocation.

Per run: held-out success at the start and the end (greedy) and its gain, the mean training reward of the last
`--last` iterations, the wall seconds of the whole `agentrl train` and of its iterations alone (`time/elapsed_s`),
and for gigpo the mean `batch/shared_steps`: the share of turns in a step group of more than one turn (turns of
a group's episodes that acted in the same state). GiGPO's step-level term only differs from its episode term where
steps are shared: the comparison means something only if that share is high enough (>= 20% is asked).

Per arm: the means over seeds and their spread; then gigpo / turn of the mean held-out gain and of the mean final
training reward, and of the mean wall seconds (1.0: equal wall time). Prints one JSON object:

    python benchmarks/gigpo_compare.py                       # 3 seeds x 2 arms, ~13 min on 2 cores
    python benchmarks/gigpo_compare.py --quick               # 1 seed, 1 iteration, 10 held-out tasks: a smoke run
    python benchmarks/gigpo_compare.py --out DIR --summarize-only   # runs made earlier
    python benchmarks/gigpo_compare.py --set optim.lr=1e-4   # a further setting of every run (both arms)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import harness

from agentrl.runs import read_jsonl

ARMS = ("turn", "gigpo")


def spread(values: list[float]) -> dict:
    """Mean, population standard deviation, min and max of one figure over seeds."""
    return {
        "mean": round(statistics.fmean(values), 4),
        "std": round(statistics.pstdev(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def summarize(out: Path, wall_s: float | None, last: int) -> dict:
    """One run from its folder: held-out start/final/gain, training reward and success of the last `last`
    iterations, walls, and GiGPO's shared-step share where logged."""
    metrics, evals = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "eval.jsonl")
    tail = metrics[-last:]
    held = harness.held_out(evals)
    shared = [m["batch/shared_steps"] for m in metrics if m.get("batch/shared_steps") is not None]
    return {
        "iterations": len(metrics),
        "heldout_tasks": evals[-1]["tasks"],
        "heldout_start": held["start"],
        "heldout_final": held["final"],
        "heldout_gain_pp": held["gain_pp"],
        "train_reward_last": round(statistics.fmean(m["rollout/reward"] for m in tail), 4),
        "train_success_last": round(statistics.fmean(m["rollout/success_rate"] for m in tail), 4),
        "train_reward_by_iteration": [round(m["rollout/reward"], 4) for m in metrics],
        "turns_per_episode": round(statistics.fmean(m["rollout/turns"] for m in metrics), 3),
        "shared_steps": round(statistics.fmean(shared), 4) if shared else None,
        "wall_s": round(wall_s if wall_s is not None else metrics[-1]["time/elapsed_s"], 1),
        "iterations_s": round(metrics[-1]["time/elapsed_s"], 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--groups", type=int, default=4, help="rollout.groups_per_iteration (the recipe's: 8)")
    p.add_argument("--tasks", type=int, default=50, help="held-out tasks, evaluated at the start and the end")
    p.add_argument("--last", type=int, default=2, help="iterations the final training reward is the mean of")
    p.add_argument("--backend", choices=["bwrap", "docker"], default="bwrap", help="sandbox.backend")
    p.add_argument("--out", type=Path, default=Path("runs/gigpo_compare"))
    p.add_argument("--set", dest="sets", action="append", default=[], help="a further setting of every run")
    p.add_argument("--quick", action="store_true", help="1 seed, 1 iteration, 10 held-out tasks: a smoke run")
    p.add_argument("--summarize-only", action="store_true", help="read the runs under --out, start none")
    args = p.parse_args()
    if args.quick:
        args.seeds, args.iterations, args.tasks, args.last = 1, 1, 10, 1
    args.last = min(args.last, args.iterations)
    args.out.mkdir(parents=True, exist_ok=True)
    common = [
        f"iterations={args.iterations}",
        f"rollout.groups_per_iteration={args.groups}",
        "rollout.env_workers=local",
        f"sandbox.backend={args.backend}",
        f"eval.tasks={args.tasks}",
        "eval.every=0",
        "eval.benchmarks=[]",
        "checkpoint.every=0",
        "checkpoint.export_final=false",
        *args.sets,
    ]
    load_before = os.getloadavg()
    runs = []
    for seed in range(args.seeds):
        for arm in ARMS:  # alternating: both arms see the same stretch of the machine's load
            out = args.out / f"{arm}_s{seed}"
            wall = (
                None if args.summarize_only else harness.train(out, [f"seed={seed}", f"algo.advantage={arm}", *common])
            )
            runs.append({"advantage": arm, "seed": seed, **summarize(out, wall, args.last)})

    by_arm = {}
    for arm in ARMS:
        rs = [r for r in runs if r["advantage"] == arm]
        by_arm[arm] = {
            "heldout_start": spread([r["heldout_start"] for r in rs]),
            "heldout_final": spread([r["heldout_final"] for r in rs]),
            "heldout_gain_pp": spread([r["heldout_gain_pp"] for r in rs]),
            "train_reward_last": spread([r["train_reward_last"] for r in rs]),
            "wall_s": spread([r["wall_s"] for r in rs]),
            "iterations_s": spread([r["iterations_s"] for r in rs]),
        }
    shared = [r["shared_steps"] for r in runs if r["shared_steps"] is not None]
    by_arm["gigpo"]["shared_steps"] = spread(shared)

    def ratio(key: str) -> float | None:
        base = by_arm["turn"][key]["mean"]
        return round(by_arm["gigpo"][key]["mean"] / base, 3) if base else None

    print(
        json.dumps(
            {
                "machine": harness.machine() | {"load_before": load_before, "load_after": os.getloadavg()},
                "settings": ["seed=S", "algo.advantage=turn|gigpo", *common],
                "runs": runs,
                "by_arm": by_arm,
                "shared_steps": round(statistics.fmean(shared), 4),
                "shared_steps_at_least_20pct": statistics.fmean(shared) >= 0.2,
                "gigpo_over_turn": {
                    "heldout_gain": ratio("heldout_gain_pp"),
                    "train_reward_last": ratio("train_reward_last"),
                    "wall_s": ratio("wall_s"),
                    "iterations_s": ratio("iterations_s"),
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
