"""No container outlives the process that started it.

Every container carries labels naming its owner: host, pid, the pid's start
time (so a recycled pid is not mistaken for the owner) and this process's
session id. `install()` removes the session's containers at exit (atexit, and
SIGTERM / SIGHUP handlers that chain to whatever was there). SIGKILL cannot be
caught: `collect_orphans()` removes containers whose owner is gone, and runs
when the first sandbox of a process starts and in `agentrl sandbox gc`.

A process that can die without running atexit and whose host may see no next
start (a Ray env worker whose raylet is killed: its node's daemon keeps the
containers) starts a watchdog (`watch()`): a detached process that waits for
the owner to exit and then removes the session's containers through the same
Docker daemon. It runs this file as a script (`python -P reaper.py --watch PID
...`), so it imports nothing of agentrl and only the standard library until it
has containers to remove.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import docker

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


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat from field 3 (the state) on, or None if no such process.

    Read from /proc directly: psutil is not a dependency and these are a few fields.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces and parentheses


def process_start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot), or None if no such process."""
    fields = _stat(pid)
    return None if fields is None else fields[19]


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, or a dead one, has)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in "ZX"


def parent_pid(pid: int) -> int | None:
    """Field 4 of /proc/PID/stat, or None if no such process."""
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


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
    import docker.errors

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


# -- the watchdog ---------------------------------------------------------------------


def watch(session: str = SESSION_ID, pid: int | None = None) -> int:
    """Start a detached watchdog that removes `session`'s containers once process `pid` (default: this one) has
    exited, then exits itself. It reaches Docker as this process does (DOCKER_HOST is inherited). Returns its pid.

    Double-forked, in a session of its own: Ray kills an exiting worker's children, those started in a new session
    too, whether the worker ends by `ray.kill`, by SIGKILL or because its raylet was killed (observed with Ray 2.60);
    a grandchild whose parent has exited is adopted by init and survives all three. (With Ray's opt-in
    `RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper` the raylet adopts and kills it: the node's
    next `collect_orphans` is then what removes the containers.)"""
    pid = pid or os.getpid()
    start = process_start_time(pid)
    if start is None:
        raise ProcessLookupError(pid)
    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--watch", str(pid), "--start", start, "--session", session]
    proc = subprocess.Popen(
        [*cmd, "--detach"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    out, _ = proc.communicate(timeout=60)
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError(f"the sandbox watchdog did not start (exit status {proc.returncode})")
    return int(out)


def _wait_for_exit(pid: int, start: str) -> None:
    """Return once process `pid` (the one that started at `start`) has exited (a zombie has)."""
    try:
        fd = os.pidfd_open(pid)  # Linux >= 5.3: readable once the process has exited, no polling
    except (AttributeError, OSError):
        fd = None
    try:
        if fd is not None:
            if process_start_time(pid) == start:  # checked after pidfd_open: the fd is that very process's
                select.select([fd], [], [])
            return
        while process_start_time(pid) == start and process_alive(pid):
            time.sleep(1.0)
    finally:
        if fd is not None:
            os.close(fd)


def _remove_session_retrying(session: str, attempts: int = 5) -> int:
    import docker

    for attempt in range(attempts):
        try:
            return remove_session(docker.from_env(version="auto"), session)
        except Exception:
            if attempt == attempts - 1:
                raise
            time.sleep(1.0)
    return 0


def _watch(pid: int, start: str, session: str) -> None:
    _wait_for_exit(pid, start)
    if _remove_session_retrying(session):
        # Its owner died abruptly: a container start the daemon finishes only now would be missed by the first pass.
        time.sleep(2.0)
        _remove_session_retrying(session)


def _main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="remove a session's sandbox containers once their owner process exits")
    ap.add_argument("--watch", type=int, required=True, metavar="PID")
    ap.add_argument("--start", required=True, help="the owner's start time (/proc/PID/stat field 22)")
    ap.add_argument("--session", required=True)
    ap.add_argument("--detach", action="store_true", help="fork, print the watchdog's pid and return at once")
    args = ap.parse_args(argv)
    if args.detach:
        child = os.fork()
        if child:
            print(child, flush=True)
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    _watch(args.watch, args.start, args.session)


if __name__ == "__main__":
    _main()
