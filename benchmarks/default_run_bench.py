"""Does the default run learn? Held-out success before and after `agentrl train --env code_sandbox`,
per seed and per objective, with the wall time of each run.

Each run is the default recipe with `seed=S` and `algo.loss=L` (the default is GSPO-token with
per-turn advantages; `grpo` keeps the per-turn advantages, token-level ratios and clipping). The
baseline is the same run's evaluation before iteration 0: the starting checkpoint, greedy, on the
same held-out tasks. Prints one JSON object and writes a plot of held-out success per iteration:

    python benchmarks/default_run_bench.py                                    # 3 seeds x 2 losses, ~80 min on 2 cores
    python benchmarks/default_run_bench.py --seeds 0 --losses gspo_token      # one run
    python benchmarks/default_run_bench.py --out /tmp/runs --summarize-only   # runs made earlier
    python benchmarks/default_run_bench.py --set model.path=DIR               # another starting policy
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import harness
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from agentrl.runs import read_jsonl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--losses", nargs="+", default=["gspo_token", "grpo"])
    p.add_argument("--out", type=Path, default=Path("runs/default_run_bench"))
    p.add_argument("--set", dest="sets", action="append", default=[], help="a further setting of every run")
    p.add_argument("--summarize-only", action="store_true", help="read the runs under --out, start none")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for loss in args.losses:
        for seed in args.seeds:
            out = args.out / f"{loss}_s{seed}"
            wall = (
                None if args.summarize_only else harness.train(out, [f"seed={seed}", f"algo.loss={loss}", *args.sets])
            )
            summary = harness.run_summary(read_jsonl(out / "eval.jsonl"), read_jsonl(out / "metrics.jsonl"), wall)
            results.append({"loss": loss, "seed": seed, **summary})

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {loss: f"C{i}" for i, loss in enumerate(args.losses)}
    for r in results:
        its = sorted(r["curve"], key=int)
        ax.plot(
            [int(i) for i in its],
            [100 * r["curve"][i] for i in its],
            marker="o",
            color=colors[r["loss"]],
            label=f"{r['loss']} seed {r['seed']}",
            alpha=0.8,
        )
    ax.set(xlabel="iteration", ylabel="held-out success, greedy (%)", title="agentrl train --env code_sandbox")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "heldout_by_seed.png", dpi=120)

    by_loss = {
        loss: {
            "mean_gain_pp": round(sum(r["gain_pp"] for r in rs) / len(rs), 1),
            "min_gain_pp": min(r["gain_pp"] for r in rs),
            "max_wall_s": max(r["wall_s"] for r in rs),
        }
        for loss in args.losses
        if (rs := [r for r in results if r["loss"] == loss])
    }
    print(
        json.dumps(
            {
                "machine": harness.machine(),
                "runs": results,
                "by_loss": by_loss,
                "plot": str(args.out / "heldout_by_seed.png"),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
