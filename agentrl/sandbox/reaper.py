"""No container outlives the process that started it.

Every container carries labels naming its owner: host, pid, the pid's start
time (so a recycled pid is not mistaken for the owner) and this process's
session id. `install()` removes the session's containers at exit (atexit, and
SIGTERM / SIGHUP handlers that chain to whatever was there). SIGKILL cannot be
caught: `collect_orphans()` removes containers whose owner is gone, and runs
when the first sandbox of a process starts and in `agentrl sandbox gc`.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import threading
import uuid
from pathlib import Path

import docker
import docker.errors

log = logging.getLogger(__name__)

LABEL = "agentrl.sandbox"
SESSION_LABEL = "agentrl.session"
PID_LABEL = "agentrl.owner.pid"
START_LABEL = "agentrl.owner.start"
HOST_LABEL = "agentrl.owner.host"
SOCKDIR_LABEL = "agentrl.sockdir"

SESSION_ID = uuid.uuid4().hex[:12]
_installed = False
_lock = threading.Lock()


def process_start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot), or None if no such process.

    Read from /proc directly: psutil is not a dependency and this is one field.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[19]


def owner_labels() -> dict[str, str]:
    pid = os.getpid()
    return {
        LABEL: "1",
        SESSION_LABEL: SESSION_ID,
        PID_LABEL: str(pid),
        START_LABEL: process_start_time(pid) or "",
        HOST_LABEL: socket.gethostname(),
    }


def owner_alive(labels: dict[str, str]) -> bool:
    """True unless the labels name a process on this host that no longer exists."""
    if labels.get(HOST_LABEL) != socket.gethostname():
        return True  # another machine's container: not ours to judge
    try:
        pid = int(labels.get(PID_LABEL, ""))
    except ValueError:
        return False
    return process_start_time(pid) == labels.get(START_LABEL)


def remove(client: docker.DockerClient, container) -> None:
    """Force-remove a container and its socket dir; a container already gone is fine."""
    try:
        container.remove(force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if e.status_code != 409:  # 409: removal already in progress
            raise
    sockdir = container.labels.get(SOCKDIR_LABEL)
    if sockdir and container.labels.get(HOST_LABEL) == socket.gethostname():
        shutil.rmtree(sockdir, ignore_errors=True)


def remove_session(client: docker.DockerClient, session: str = SESSION_ID) -> int:
    containers = client.containers.list(all=True, filters={"label": f"{SESSION_LABEL}={session}"}, ignore_removed=True)
    for c in containers:
        remove(client, c)
    return len(containers)


def collect_orphans(client: docker.DockerClient, *, everything: bool = False) -> list[str]:
    """Remove agentrl containers whose owner process is gone (all of them if `everything`)."""
    removed = []
    # ignore_removed: another process may remove one of its own between the listing and its inspection
    for c in client.containers.list(all=True, filters={"label": LABEL}, ignore_removed=True):
        if everything or not owner_alive(c.labels):
            remove(client, c)
            removed.append(c.name)
    return removed


def install(client: docker.DockerClient) -> None:
    """Once per process: clean orphans now, and this session's containers at exit."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    orphans = collect_orphans(client)
    if orphans:
        log.warning("removed %d orphaned sandbox containers: %s", len(orphans), ", ".join(orphans))
    atexit.register(_cleanup, client)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            _chain_signal(sig, client)


def _cleanup(client: docker.DockerClient) -> None:
    try:
        remove_session(client)
    except Exception as e:
        log.warning("could not remove sandbox containers of session %s: %s", SESSION_ID, e)


def _chain_signal(sig: signal.Signals, client: docker.DockerClient) -> None:
    previous = signal.getsignal(sig)

    def handler(signum, frame):
        _cleanup(client)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # default action: die by the same signal
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(sig, handler)
