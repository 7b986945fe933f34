"""Does RL raise repo_fix's held-out success? `agentrl train --config configs/repo_fix.yaml` for each seed, from the
policy `scripts/build_repo_policy.sh` made (SFT on an imperfect expert, timed apart), then each run's failure
modes before and after.

Per seed it reports: held-out success on unseen instances of the training templates (the run's eval.jsonl: greedy,
the env's test split) at the start, at each evaluation and at the end; the wholly held-out templates (the recipe's
`eval.benchmarks`, pass@1 greedy); the run's wall, and its wall without the evaluations. Then `agentrl eval` of the
starting policy and of each run's final policy on the same held-out instances (transcripts kept), and each
episode's failure mode, read from its tool calls against the instance's gold patch:

    resolved     every FAIL_TO_PASS test passes and no PASS_TO_PASS test broke
    wrong_file   it changed no file the gold patch changes, and never opened one (it looked elsewhere)
    edit_failed  it opened the right file, but every edit it tried failed (old text not found, or not once)
    wrong_edit   it changed a file the gold patch changes, and the tests still fail
    no_change    it opened the right file and changed nothing, with no failed edit
    malformed    no tool call could be run at all

With --samples k (8 by default) it also samples the starting policy k times per held-out instance at the recipe's
temperature and sorts the instances by how many of the k resolve them: never, sometimes, always. An RL that only
sharpens the policy (makes its likeliest answer the one its samples find) can raise the greedy figure to pass@k at
most, the `ceiling_pp` of `headroom`; each run's greedy flips, instance by instance, are counted in those classes,
so a gain on `never` instances is one that sampling had not already shown.

Prints one JSON object:

    python benchmarks/repo_fix_bench.py --seeds 0 1 2 --out build/repo_runs
    python benchmarks/repo_fix_bench.py --seeds 0 --summarize-only --out build/repo_runs
    python benchmarks/repo_fix_bench.py --expert   # the scripted expert on every generated instance, through the env
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import harness

from agentrl.runs import read_jsonl
from agentrl.tasks.registry import load_tasks
from agentrl.tasks.repos.instance import apply_patch

RECIPE = "configs/repo_fix.yaml"
MODES = ("resolved", "wrong_file", "edit_failed", "wrong_edit", "no_change", "malformed")


def resolved(transcript: dict) -> bool:
    return bool(transcript["turns"] and transcript["turns"][-1]["info"].get("resolved"))


def failure_mode(transcript: dict, gold_files: set[str]) -> str:
    """What an episode did, from its calls and its graded last turn (see the module docstring)."""
    if resolved(transcript):
        return "resolved"
    calls = [c for turn in transcript["turns"] for c in turn["info"].get("calls", [])]
    ran = [c for c in calls if c["status"] in ("ok", "error")]
    if not ran:  # also an episode of no turn
        return "malformed"
    changed = set(transcript["turns"][-1]["info"].get("changed_files", []))
    opened = {(c["arguments"] or {}).get("path", "").removeprefix("./") for c in ran if c["tool"] in ("view", "edit")}
    if changed & gold_files:
        return "wrong_edit"
    if not (opened & gold_files):
        return "wrong_file"
    edits = [c for c in ran if c["tool"] == "edit"]
    if edits and all(c["status"] == "error" for c in edits):
        return "edit_failed"
    return "no_change"


def modes(folder: Path, split_of: dict[str, set[str]]) -> dict[str, int]:
    transcripts = read_jsonl(folder / "trajectories" / "eval.jsonl")
    counts = Counter(failure_mode(t, split_of[t["task_id"]]) for t in transcripts)
    return {m: counts.get(m, 0) for m in MODES}


def gold_files(tasks) -> dict[str, set[str]]:
    out = {}
    for iid in tasks.ids():
        inst = tasks.instance(iid)
        fixed = apply_patch(inst.repo, inst.patch)
        out[iid] = {p for p in set(inst.repo) | set(fixed) if inst.repo.get(p) != fixed.get(p)}
    return out


def evaluate(model: Path | str, out: Path, tasks: int, *more: object) -> float:
    return harness.agentrl(
        "eval",
        "--env",
        "repo_fix",
        "--model",
        model,
        "--tasks",
        tasks,
        *harness.sets(["env_kwargs.max_turns=8", "max_tokens=384"]),
        *more,
        "--out",
        out,
        log=out.with_suffix(".log"),
    )


def solved(folder: Path) -> dict[str, tuple[int, int]]:
    """Per instance of an `agentrl eval` folder: (episodes, episodes that resolved it)."""
    out: dict[str, tuple[int, int]] = {}
    for t in read_jsonl(folder / "trajectories" / "eval.jsonl"):
        n, r = out.get(t["task_id"], (0, 0))
        out[t["task_id"]] = (n + 1, r + resolved(t))
    return out


def classes_of(sampled: dict[str, tuple[int, int]]) -> dict[str, str]:
    """never / sometimes / always: how many of an instance's sampled episodes (`solved` of them) resolved it."""
    return {i: "never" if r == 0 else "always" if r == n else "sometimes" for i, (n, r) in sampled.items()}


def headroom(sampled: dict[str, tuple[int, int]], greedy: dict[str, tuple[int, int]]) -> dict:
    """What sharpening alone can add to the greedy figure: the instances some of the k samples resolve and greedy
    decoding does not, in points of the held-out set (both as `solved` reads them)."""
    classes = classes_of(sampled)
    names = ("never", "sometimes", "always")
    per_class = Counter(classes.values())
    solved_greedy = Counter(classes.get(i, "unsampled") for i, (_, r) in greedy.items() if r)
    k = max(n for n, _ in sampled.values())
    return {
        "samples": k,
        "instances": {c: per_class[c] for c in names},
        "greedy_solved": {c: solved_greedy[c] for c in names},
        "greedy_pct": round(100 * sum(solved_greedy.values()) / len(greedy), 1),
        f"pass@{k}_pct": round(100 * (len(classes) - per_class["never"]) / len(classes), 1),
        "ceiling_pp": round(100 * sum(per_class[c] - solved_greedy[c] for c in names[1:]) / len(classes), 1),
    }


def flips(
    b: dict[str, tuple[int, int]], a: dict[str, tuple[int, int]], classes: dict[str, str]
) -> dict[str, dict[str, int]]:
    """Instances the greedy policy solved after RL (`a`) and not before (`b`): gained, or before and not after: lost;
    by class."""
    out = {"gained": Counter(), "lost": Counter()}
    for i in sorted(b.keys() & a.keys()):  # sorted: the same JSON from run to run
        if bool(a[i][1]) != bool(b[i][1]):
            out["gained" if a[i][1] else "lost"][classes.get(i, "unsampled")] += 1
    return {k: dict(v) for k, v in out.items()}


async def expert_everywhere(concurrency: int = 8) -> dict:
    """The perfect scripted expert through the real env and fresh sandboxes on every generated instance (all four
    cells of the split): its return on each."""
    import agentrl
    from agentrl.env import SandboxSource
    from agentrl.sandbox import DockerSandbox, SandboxPool
    from agentrl.tasks.repos import TEMPLATES, count, instance_id

    ids = [instance_id(name, n) for name, t in sorted(TEMPLATES.items()) for n in range(count(t))]
    held_templates = set(load_tasks("repos:templates=test").ids())
    pool = SandboxPool(DockerSandbox.create, size=concurrency, reuse=100)
    gate, returns = asyncio.Semaphore(concurrency), {}

    async def one(iid: str) -> None:
        async with gate:
            templates = "test" if iid in held_templates else "train"
            env = agentrl.make(
                "repo_fix", sandboxes=SandboxSource(pool), tasks=f"repos:templates={templates}", split="all"
            )
            await env.areset(options={"task_id": iid})
            total = 0.0
            for action in env.demonstration(env.task, random.Random(0)):
                _, reward, term, trunc, _ = await env.astep(action)
                total += reward
                if term or trunc:
                    break
            returns[iid] = total
            await env.aclose()

    t0 = time.monotonic()
    try:
        await pool.start()
        await asyncio.gather(*(one(i) for i in ids))
    finally:
        await pool.close()
    below = sorted(i for i, r in returns.items() if r < 1.0)
    return {
        "instances": len(ids),
        "reward_1": len(ids) - len(below),
        "below_1": below,
        "wall_s": round(time.monotonic() - t0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("runs/repo_fix_bench"))
    p.add_argument("--policy", default="build/repo/policy", help="the starting policy (the recipe's model.path)")
    p.add_argument("--eval-tasks", type=int, default=100, help="held-out instances of the failure-mode evaluations")
    p.add_argument("--set", dest="sets", action="append", default=[], help="a further setting of every run")
    p.add_argument(
        "--samples",
        type=int,
        default=8,
        help="samples per held-out instance of the starting policy, to measure what sharpening can reach (0: none)",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="of those samples: the recipe's rollout temperature")
    p.add_argument("--summarize-only", action="store_true", help="read the runs under --out, start none")
    p.add_argument("--expert", action="store_true", help="only run the scripted expert on every instance")
    args = p.parse_args()
    if args.expert:
        print(json.dumps(asyncio.run(expert_everywhere()), indent=1))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    held_out = load_tasks("repos").split("test")
    golds = gold_files(held_out)
    before = args.out / "before"
    sampled = args.out / "before_sampled"
    if not args.summarize_only and not (before / "summary.json").exists():
        evaluate(args.policy, before, args.eval_tasks)
    if not args.summarize_only and args.samples and not (sampled / "summary.json").exists():
        evaluate(
            args.policy,
            sampled,
            args.eval_tasks,
            "--samples",
            args.samples,
            "--k",
            f"1,{args.samples}",
            "--set",
            f"temperature={args.temperature}",
        )
    sampled_solved = solved(sampled) if (sampled / "summary.json").exists() else {}
    classes, greedy_before = classes_of(sampled_solved), solved(before)
    runs = []
    for seed in args.seeds:
        out = args.out / f"seed{seed}"
        wall = None
        if not args.summarize_only:
            wall = harness.train(out, [f"seed={seed}", f"model.path={args.policy}", *args.sets], ("--config", RECIPE))
            evaluate(out / "final", args.out / f"after{seed}", args.eval_tasks)
        evals = read_jsonl(out / "eval.jsonl")
        bench = read_jsonl(out / "bench.jsonl") if (out / "bench.jsonl").exists() else []  # eval.benchmarks=[]
        metrics = read_jsonl(out / "metrics.jsonl")
        # without --summarize-only the run's wall holds every evaluation; with it, the last iteration's elapsed time
        # holds those before it, not the final one after it
        total = wall if wall is not None else metrics[-1]["time/elapsed_s"]
        last = metrics[-1]["iteration"] if wall is None else float("inf")
        eval_s = sum(e["wall_s"] for e in (*evals, *bench) if e["iteration"] <= last)
        heldout = harness.held_out(evals)
        runs.append(
            {
                "seed": seed,
                "heldout_curve": heldout["curve"],
                "heldout_gain_pp": heldout["gain_pp"],
                "heldout_templates_curve": {b["iteration"]: b["pass@1"] for b in bench},
                "wall_s": round(total),
                "wall_s_without_evaluations": round(total - eval_s),
                "failure_modes_after": modes(args.out / f"after{seed}", golds),
                "greedy_flips": flips(greedy_before, solved(args.out / f"after{seed}"), classes),
            }
        )
    print(
        json.dumps(
            {
                "machine": harness.machine(),
                "recipe": RECIPE,
                "policy": args.policy,
                "failure_modes_before": modes(before, golds),
                "headroom": headroom(sampled_solved, greedy_before) if classes else None,
                "runs": runs,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
