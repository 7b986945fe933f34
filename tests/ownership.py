"""What this test process started, directly or not: its processes and its sandboxes. Another job on the same
machine (a training run, a second suite) has Ray workers and agentrl containers too; a test kills or counts only
its own (the guide: tests tear down only what they started)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import docker

from agentrl.sandbox import reaper
from agentrl.sandbox.bwrap import TREE_PREFIX

RAY_PROCESSES = "raylet|gcs_server|ray::"
"""the command lines of a Ray runtime's processes (`pgrep -f`)"""


def descends_from_us(pid: int | None) -> bool:
    while pid is not None and pid > 1:
        if pid == os.getpid():
            return True
        pid = reaper.parent_pid(pid)
    return False


def _matching(pattern: str) -> list[int]:
    """Live processes whose command line matches `pattern` (pgrep -f), oldest first."""
    return [int(p) for p in subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()]


def our_pids(pattern: str) -> list[int]:
    """Those of `_matching(pattern)` that this process started."""
    return [p for p in _matching(pattern) if descends_from_us(p)]


def still_running(pids: list[int], pattern: str) -> list[int]:
    """Those of `pids` still alive with a command line matching `pattern` (after their parent is gone they no
    longer descend from us, so the check is by pid)."""
    return sorted(set(pids) & set(_matching(pattern)))


def our_containers(client: docker.DockerClient) -> list:
    """Running agentrl sandboxes whose owner (the process that made them) this process started."""
    return [
        c
        for c in client.containers.list(filters={"label": reaper.LABEL}, ignore_removed=True)
        if descends_from_us(int(c.labels.get(reaper.PID_LABEL) or 0))
    ]


def seen_while_running(proc: subprocess.Popen, pattern: str, timeout_s: float = 240) -> set[int]:
    """The processes matching `pattern` that this process started, polled until `proc` exits (killed past
    `timeout_s`, an AssertionError): one that lives as long as a command's setup or longer (a Ray runtime started for
    its env workers) cannot be missed."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{proc.args} ran past {timeout_s} s")
        seen.update(our_pids(pattern))
        time.sleep(0.2)
    return seen


def bwrap_trees(runtime: Path, owner: int | None = None) -> list[str]:
    """The bwrap sandbox trees in the runtime folder `runtime`, those of process `owner` alone if given."""
    found = []
    for tree in runtime.glob(f"{TREE_PREFIX}*"):
        try:
            pid = int(json.loads((tree / "owner.json").read_text())[reaper.PID_LABEL])
        except (OSError, ValueError):
            pid = None  # being made
        if owner is None or pid == owner:
            found.append(tree.name)
    return found
