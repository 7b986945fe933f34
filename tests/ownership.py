"""What this test process started, directly or not: its processes and its sandboxes. Another job on the same
machine (a training run, a second suite) has Ray workers and agentrl containers too; a test kills or counts only
its own (the guide: tests tear down only what they started)."""

from __future__ import annotations

import os
import subprocess

import docker

from agentrl.sandbox import reaper


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
