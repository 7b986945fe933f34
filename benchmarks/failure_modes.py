"""Why a policy fails procedural code_sandbox tasks: the last code each episode of an evaluation submitted,
read against the task (`agentrl.tasks.procedural.reading`).

    agentrl eval --env code_sandbox --model default --tasks 200 --out DIR \
        --set "env_kwargs.tasks=procedural:levels=1,2;families=strings,lists,numbers,counting"
    python benchmarks/failure_modes.py DIR

Prints one JSON object: per reading ("reference", "misread", "printed", "other", "no_code"), the
episodes that submitted it and how many of those passed every hidden test (a misreading passes where
the hidden tests cannot tell it apart), then a few "other" submissions beside their reference solution.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from agentrl.env.grading import extract_code
from agentrl.env.parsers import HermesParser
from agentrl.eval.bench import success
from agentrl.rollout import Trajectory
from agentrl.tasks.procedural import reading
from agentrl.tasks.registry import load_tasks
from agentrl.view.data import Folder


def submitted_code(traj: Trajectory, tokenizer) -> str | None:
    """The code of the episode's last turn: its submit call, else a ```python block (which also submits)."""
    if not traj.turns:
        return None
    last = traj.turns[-1]
    text = tokenizer.decode(traj.token_ids[last.start : last.end], skip_special_tokens=True)
    calls = [c for c in HermesParser().parse(text).calls if c.name == "submit" and "code" in c.arguments]
    return str(calls[-1].arguments["code"]) if calls else extract_code(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="an `agentrl eval --out` folder of a procedural code_sandbox set")
    ap.add_argument("--tasks", default="procedural:levels=1,2;families=strings,lists,numbers,counting")
    ap.add_argument("--examples", type=int, default=5)
    args = ap.parse_args()
    folder, tasks = Folder(args.folder), load_tasks(args.tasks)
    counts, passed, examples = Counter(), Counter(), []
    for line in (args.folder / "trajectories" / "eval.jsonl").read_text().splitlines():
        traj = Trajectory.model_validate_json(line)
        code = submitted_code(traj, folder.tokenizer())
        task = tasks.get(traj.task_id)
        kind = "no_code" if code is None else reading(task, code)
        counts[kind] += 1
        passed[kind] += success(traj)
        if kind == "other" and len(examples) < args.examples:
            examples.append({"task_id": task.id, "reference": tasks.reference_solution(task), "submitted": code})
    print(
        json.dumps(
            {
                "episodes": sum(counts.values()),
                "readings": {k: {"episodes": counts[k], "passed": passed[k]} for k in sorted(counts)},
                "examples": examples,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
