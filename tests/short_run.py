"""A short real `agentrl train` run (the default policy, real sandboxes and Ray), for the pipeline and viewer tests."""

from pathlib import Path
from typing import NamedTuple

from cli import agentrl, sets

# Small enough for a test, shaped like the default: many groups in flight for few wanted, so an
# iteration ends with episodes parked mid-way (partial rollouts) that the next one finishes.
SMALL = [
    "rollout.group_size=4",
    "rollout.groups_per_iteration=2",
    "rollout.max_groups_in_flight=6",
    "rollout.num_workers=2",
    "rollout.sandboxes_per_worker=4",
    "eval.tasks=4",
    "eval.every=0",
    "eval.sandboxes_per_worker=2",
    "log.tensorboard=true",
]


# A benchmark (HumanEval's first 2 problems, pass@1 and pass@2) evaluated beside the held-out tasks.
BENCH = "eval.benchmarks=[{env: humaneval, tasks: 2, samples: 2, k: [1, 2], temperature: 1.0, max_tokens: 48}]"


class ShortRun(NamedTuple):
    folder: Path
    stdout: str
    stderr: str


def two_iterations(tmp: Path) -> ShortRun:
    """2 iterations of the SMALL run with the benchmark: the one run the pipeline and viewer tests share
    (tests/conftest.py's `short_run`, session-scoped). Tests that change it work on a copy."""
    out = agentrl(
        "train",
        "--env",
        "code_sandbox",
        *sets("iterations=2", f"out={tmp / 'run'}", *SMALL, BENCH),
        cwd=tmp,
        timeout=240,
        extra_env={"RAY_AUTH_MODE": None},  # as a user's shell has it: the README's command prints no library warning
    )
    return ShortRun(tmp / "run", out.stdout, out.stderr)
