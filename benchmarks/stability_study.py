"""Does GSPO train MoE policies stably without routing replay, while GRPO needs it? (issue 26, the GSPO paper's
central claim, at the default task's scale.)

Every run is the default recipe (`agentrl train --env code_sandbox`) with a real engine/learner mismatch and the
GSPO paper's update shape:

- the engine computes in bfloat16 (`engine.dtype=bfloat16`, one replica with its own weights) against the float32
  learner, and records routing in every arm, so router disagreement is measured in every arm;
- M = 4 minibatches per update (`optim.minibatches=4`; R2 only means something then), the cosine decay spread
  over the run's 4x more optimizer steps (`optim.decay_steps`), nothing else of the recipe changed;
- k = 1: generation runs one policy version ahead of the learner (`algo.async_level=1`), and no trained token is
  more than one version old (`rollout.max_staleness=1`: a parked partial rollout older than that is dropped);
- held-out evaluation every 2 iterations, so a collapse shows.

Arms: GRPO; GRPO + R2; GRPO + R3; GRPO + masked importance sampling (`algo.behaviour_weight=mask`); GSPO-token;
GSPO-token + R3. Policies: the default (4 experts, top-2) and any other given with --policy NAME=PATH (the study's
second is 8 experts, top-2, made like the default: scripts/build_default_policy.sh build/moe8 build/moe8/policy
--experts 8 --top-k 2).

Per run it reports the held-out success curve, its peak, collapse (held-out falls more than 10 points below its
own peak and stays there to the end), and per iteration the clip fraction, engine/learner mismatch (the k3
sequence KL and mean |Δlp| of the first minibatch), router disagreement and expert flip rate. Prints one JSON
object and writes plots under --out:

    python benchmarks/stability_study.py                                       # 6 arms x 3 seeds, default policy
    python benchmarks/stability_study.py --policy moe8=build/moe8/policy --seeds 0
    python benchmarks/stability_study.py --arms grpo grpo_r3 --seeds 0 1 2
    python benchmarks/stability_study.py --summarize-only                      # the runs under --out
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean

import harness
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from agentrl.runs import read_jsonl

ITERATIONS = 10  # the default recipe's
MINIBATCHES = 4
SETUP = [
    "engine.dtype=bfloat16",
    "engine.replicas=1",
    "engine.record_routing=true",
    f"optim.minibatches={MINIBATCHES}",
    f"optim.decay_steps={ITERATIONS * MINIBATCHES}",
    "algo.async_level=1",
    "rollout.max_staleness=1",
    "eval.every=2",
]
ARMS = {
    "grpo": ["algo.loss=grpo"],
    "grpo_r2": ["algo.loss=grpo", "algo.routing_replay=R2"],
    "grpo_r3": ["algo.loss=grpo", "algo.routing_replay=R3"],
    "grpo_masked_is": ["algo.loss=grpo", "algo.behaviour_weight=mask"],
    "gspo_token": ["algo.loss=gspo_token"],
    "gspo_token_r3": ["algo.loss=gspo_token", "algo.routing_replay=R3"],
}
COLLAPSE_PP = 10
WATCHED = {
    "clip_fraction": "train/clip_fraction",
    "mismatch_seq_kl": "train/mismatch_seq_kl",
    "mismatch_abs_logprob_diff": "train/mismatch_abs_logprob_diff",
    "router_disagreement": "train/router_disagreement",
    "router_disagreement_tokens": "train/router_disagreement_tokens",
    "expert_flip_rate": "train/expert_flip_rate",
    "grad_norm": "train/grad_norm",
}


def collapse(curve: list[tuple[int, float]]) -> int | None:
    """The iteration from which held-out success stays more than COLLAPSE_PP points below its own peak to the end
    (the earliest such evaluation after the peak); None if it never does."""
    values = [v for _, v in curve]
    peak_at = max(range(len(values)), key=lambda i: values[i])
    floor = values[peak_at] - COLLAPSE_PP / 100
    since = None
    for i in range(peak_at + 1, len(values)):
        since = (since if since is not None else i) if values[i] < floor else None
    return None if since is None else curve[since][0]


def summarize(out: Path, policy: str, arm: str, seed: int, wall_s: float | None) -> dict:
    evals, metrics = read_jsonl(out / "eval.jsonl"), read_jsonl(out / "metrics.jsonl")
    run = harness.run_summary(evals, metrics, wall_s)
    curve = list(run["curve"].items())
    per_iteration = {name: [m.get(key) for m in metrics] for name, key in WATCHED.items()}
    return {
        "policy": policy,
        "arm": arm,
        "seed": seed,
        **run,
        "peak": max(v for _, v in curve),
        "collapsed_at": collapse(curve),
        "per_iteration": per_iteration,
        "means": {
            name: round(mean(xs), 6) if (xs := [x for x in v if x is not None]) else None
            for name, v in per_iteration.items()
        },
    }


def plot(results: list[dict], out: Path) -> list[str]:
    """Per policy: held-out success per arm (one line per seed), and the watched metrics per arm (seed means)."""
    files = []
    for policy in dict.fromkeys(r["policy"] for r in results):
        rs = [r for r in results if r["policy"] == policy]
        arms = list(dict.fromkeys(r["arm"] for r in rs))
        fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms), 3.2), sharey=True, squeeze=False)
        for ax, arm in zip(axes[0], arms, strict=True):
            for r in (r for r in rs if r["arm"] == arm):
                its = sorted(r["curve"], key=int)
                label = f"seed {r['seed']}" + (" (collapsed)" if r["collapsed_at"] is not None else "")
                ax.plot([int(i) for i in its], [100 * r["curve"][i] for i in its], marker="o", label=label)
            ax.set(title=arm, xlabel="iteration")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("held-out success, greedy (%)")
        fig.suptitle(f"policy {policy}: bf16 engine, M={MINIBATCHES}, k=1")
        fig.tight_layout()
        files.append(str(out / f"{policy}_heldout.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

        names = list(WATCHED)
        fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), squeeze=False)
        for ax, name in zip(axes[0], names, strict=True):
            for arm in arms:
                runs = [r["per_iteration"][name] for r in rs if r["arm"] == arm]
                n = min(len(v) for v in runs)
                ys = [
                    mean(x for v in runs if (x := v[i]) is not None)
                    if any(v[i] is not None for v in runs)
                    else float("nan")
                    for i in range(n)
                ]
                ax.plot(range(n), ys, label=arm)
            ax.set(title=name, xlabel="iteration")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        files.append(str(out / f"{policy}_metrics.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", action="append", default=[], help="NAME=PATH of a starting policy (default: default)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("runs/stability_study"))
    p.add_argument("--summarize-only", action="store_true", help="read the runs under --out, start none")
    args = p.parse_args()
    policies = dict(item.split("=", 1) for item in args.policy) or {"default": "default"}
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for policy, path in policies.items():
        for seed in args.seeds:  # seeds outermost: a partial study has every arm of its first seeds
            for arm in args.arms:
                out = args.out / policy / f"{arm}_s{seed}"
                out.parent.mkdir(exist_ok=True)
                wall = None
                if not args.summarize_only:
                    wall = harness.train(out, [f"seed={seed}", *SETUP, f"model.path={path}", *ARMS[arm]])
                if (out / "eval.jsonl").exists():
                    results.append(summarize(out, policy, arm, seed, wall))
    by_arm = {
        f"{policy}/{arm}": {
            "seeds": len(rs),
            "collapsed": sum(r["collapsed_at"] is not None for r in rs),
            "gain_pp": [r["gain_pp"] for r in rs],
            "peak": [r["peak"] for r in rs],
            "final": [r["final"] for r in rs],
            **{name: [r["means"][name] for r in rs] for name in WATCHED},
        }
        for policy in policies
        for arm in args.arms
        if (rs := [r for r in results if r["policy"] == policy and r["arm"] == arm])
    }
    print(
        json.dumps(
            {
                "machine": harness.machine(),
                "setup": SETUP,
                "by_arm": by_arm,
                "runs": results,
                "plots": plot(results, args.out) if results else [],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
