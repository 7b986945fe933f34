"""`agentrl report RUN_DIR`: PNG plots of a run and a short summary table, from its JSONL files.

Plots (plots/): training reward and success, held-out success, clip fraction,
engine/trainer mismatch, expert flip rate, and one overview with all five. The summary
(plots/summary.md, also returned) names the starting and final held-out success.
"""

from __future__ import annotations

from pathlib import Path

from agentrl.runs import RunDir, read_jsonl

# (file, title, y label, [(source, key, label)])
PLOTS = [
    (
        "reward.png",
        "Training reward",
        "per episode",
        [("metrics", "rollout/reward", "reward"), ("metrics", "rollout/success_rate", "success rate")],
    ),
    ("heldout.png", "Held-out success (greedy)", "success rate", [("eval", "success_rate", "held-out success")]),
    ("clip.png", "Clip fraction", "fraction", [("metrics", "train/clip_fraction", "clipped")]),
    (
        "mismatch.png",
        "Engine / trainer mismatch",
        "before the first step",
        [
            ("metrics", "train/mismatch_abs_logprob_diff", "mean |lp_θ − lp_b|"),
            ("metrics", "train/mismatch_seq_kl", "sequence KL"),
        ],
    ),
    (
        "flips.png",
        "Expert flip rate",
        "fraction of top-k sets changed",
        [("metrics", "train/expert_flip_rate", "flip rate")],
    ),
]


def report(run_dir: str | Path) -> tuple[Path, str]:
    """Write the plots and summary; returns (plots folder, summary markdown)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    run = RunDir(run_dir)
    if not run.metrics.exists():
        raise FileNotFoundError(f"{run.path} has no metrics.jsonl: not an agentrl run folder (or it logged nothing)")
    rows = {"metrics": read_jsonl(run.metrics), "eval": read_jsonl(run.eval) if run.eval.exists() else []}
    run.plots.mkdir(exist_ok=True)
    overview, axes = plt.subplots(1, len(PLOTS), figsize=(5 * len(PLOTS), 3.6))
    for ax_all, (name, title, ylabel, series) in zip(axes, PLOTS, strict=True):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for target in (ax, ax_all):
            for source, key, label in series:
                points = [(r["iteration"], r[key]) for r in rows[source] if r.get(key) is not None]
                if points:
                    target.plot(*zip(*points, strict=True), marker="o" if source == "eval" else None, label=label)
            target.set_title(title)
            target.set_xlabel("iteration")
            target.set_ylabel(ylabel)
            target.grid(alpha=0.3)
            if target.get_legend_handles_labels()[0]:
                target.legend()
        fig.tight_layout()
        fig.savefig(run.plots / name, dpi=100)
        plt.close(fig)
    overview.tight_layout()
    overview.savefig(run.plots / "overview.png", dpi=80)
    plt.close(overview)
    summary = _summary(run, rows)
    (run.plots / "summary.md").write_text(summary)
    return run.plots, summary


def _summary(run: RunDir, rows: dict[str, list[dict]]) -> str:
    m, ev = rows["metrics"], rows["eval"]

    def mean(key: str, part: list[dict]) -> str:
        vals = [r[key] for r in part if r.get(key) is not None]
        return f"{sum(vals) / len(vals):.3f}" if vals else "n/a"

    k = max(1, len(m) // 5)
    lines = [f"# {run.path.name}", "", "| | start | end |", "|---|---|---|"]
    if ev:
        a, b = ev[0], ev[-1]
        lines.append(
            f"| held-out success (greedy, {a['scored']} tasks) | {a['success_rate']:.1%} (iteration "
            f"{a['iteration']}) | {b['success_rate']:.1%} (iteration {b['iteration']}) |"
        )
    for key, label in (
        ("rollout/reward", "training reward"),
        ("rollout/success_rate", "training success"),
        ("train/clip_fraction", "clip fraction"),
    ):
        lines.append(f"| {label} (mean of first / last {k} iterations) | {mean(key, m[:k])} | {mean(key, m[-k:])} |")
    failed = sum(r.get("rollout/failed", 0) for r in m)
    retried = sum(r.get("rollout/retried", 0) for r in m)
    partial = sum(r.get("rollout/partial_trained", 0) for r in m)
    elapsed = m[-1].get("time/elapsed_s", 0.0) if m else 0.0
    lines += [
        "",
        f"{len(m)} iterations in {elapsed / 60:.1f} min; {partial} partial rollouts trained; "
        f"infrastructure failures: {failed} masked, {retried} retried.",
    ]
    return "\n".join(lines) + "\n"
