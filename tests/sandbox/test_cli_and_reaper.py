"""`agentrl sandbox exec | gc` as real processes, and the reaper: no container outlives
its owner after SIGINT / SIGTERM; after SIGKILL the next start or `gc` removes it, or at once
the owner's watchdog if it started one. The same for bwrap sandboxes: a SIGKILLed owner's
sandbox processes die with it, and its trees (folder, cgroup) go at the next start or `gc`. A
local sandbox's processes and folder go with its SIGKILLed owner at once, with no reaper."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import docker.errors
import pytest
from cli import agentrl, start_agentrl

from agentrl.sandbox import bwrap, reaper


def owned_by(client, pid: int) -> list[dict]:
    # The low-level list: the high-level one inspects each container and races removals.
    return client.api.containers(all=True, filters={"label": f"{reaper.PID_LABEL}={pid}"})


def runs_prog(client, container: dict) -> bool:
    try:
        return any("prog.py" in " ".join(p) for p in client.api.top(container["Id"])["Processes"])
    except docker.errors.NotFound:
        return False


def start_exec(tmp_path, code: str, *args: str) -> subprocess.Popen:
    """`agentrl sandbox exec prog.py ARGS` in the background, taking SIGINT as from a terminal."""
    prog = tmp_path / "prog.py"
    prog.write_text(code)
    return start_agentrl("sandbox", "exec", prog, *args, stderr=subprocess.STDOUT)


def wait_running(client, proc: subprocess.Popen) -> None:
    """Until the program runs in one container and the pool's spare is up in another.

    Waiting for the spare too means no container start is in flight when the test
    kills the process (a start the daemon finishes after its owner died is an orphan
    only the next start or gc can see).
    """
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "agentrl sandbox exec exited early"
        running = [c for c in owned_by(client, proc.pid) if c["State"] == "running"]
        if len(running) == 2 and any(runs_prog(client, c) for c in running):
            return
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("program never started")


@pytest.mark.docker
def test_exec_json(sandbox_image, tmp_path):
    prog = tmp_path / "hello.py"
    prog.write_text("import sys\nprint('hello')\nprint('warn', file=sys.stderr)\nsys.exit(3)")
    out = agentrl("sandbox", "exec", prog, "--json", check=False)
    result = json.loads(out.stdout)
    assert {"status", "exit_code", "stdout", "stderr", "wall_s"} <= result.keys()
    got = (result["status"], result["exit_code"], result["stdout"], result["stderr"])
    assert got == ("error", 3, "hello\n", "warn\n")
    assert out.returncode == 1


@pytest.mark.docker
def test_exec_timeout_and_shell(sandbox_image, tmp_path):
    prog = tmp_path / "spin.sh"
    prog.write_text("echo start; while :; do :; done")
    out = agentrl("sandbox", "exec", prog, "--timeout", "1", "--json", check=False)
    result = json.loads(out.stdout)
    assert (result["status"], result["stdout"]) == ("timeout", "start\n")
    assert 1 <= result["wall_s"] < 3


@pytest.mark.docker
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_exec_leaves_no_container(sandbox_image, docker_client, tmp_path, sig):
    proc = start_exec(tmp_path, "import time; time.sleep(60)", "--timeout", "100")
    wait_running(docker_client, proc)
    proc.send_signal(sig)
    proc.wait(30)
    assert owned_by(docker_client, proc.pid) == []


def killed_exec(client, tmp_path) -> int:
    """Start `agentrl sandbox exec`, SIGKILL it mid-call; return its pid."""
    proc = start_exec(tmp_path, "import time; time.sleep(60)", "--timeout", "100")
    wait_running(client, proc)
    proc.kill()
    proc.wait(30)
    assert len(owned_by(client, proc.pid)) == 2  # SIGKILL cannot be caught: leased + spare stay
    return proc.pid


@pytest.mark.docker
def test_sigkill_orphans_are_removed_by_gc(sandbox_image, docker_client, tmp_path):
    """gc names the containers it removed: the killed owner's two among them. Any process's first sandbox reaps dead
    owners' containers host-wide, so a test on the other pytest-xdist worker may take them between the kill and
    gc's start: gc then names neither, and the case runs again (they are gone either way)."""
    for _ in range(3):
        pid = killed_exec(docker_client, tmp_path)
        names = {c["Names"][0].lstrip("/") for c in owned_by(docker_client, pid)}
        removed = agentrl("sandbox", "gc").stderr
        assert owned_by(docker_client, pid) == []
        if all(n in removed for n in names):
            return
        assert not any(n in removed for n in names), removed  # gc removed one, and missed the other
    raise AssertionError(f"three times, another process reaped the orphans before gc: {removed}")


@pytest.mark.docker
def test_sigkill_orphans_are_removed_by_the_next_start(sandbox_image, docker_client, tmp_path):
    pid = killed_exec(docker_client, tmp_path)
    (tmp_path / "ok.py").write_text("print('ok')")
    agentrl("sandbox", "exec", tmp_path / "ok.py")
    assert owned_by(docker_client, pid) == []


def bwrap_trees(pid: int) -> list[dict]:
    """The bwrap sandbox trees owned by process `pid`, with their cgroup folders (one another process is making,
    without its owner record yet, is not one of them)."""
    trees = []
    for tree in bwrap.runtime_dir().glob(f"{bwrap.TREE_PREFIX}*"):
        try:
            owner = json.loads((tree / "owner.json").read_text())
        except (OSError, ValueError):
            continue
        if owner[reaper.PID_LABEL] == str(pid):
            trees.append({"tree": tree, "cgroups": list(owner["cgroup"]["dirs"].values())})
    return trees


def sandboxed(name: str) -> bool:
    """Whether the program file `name` runs (in its sandbox: not the `agentrl` command naming it)."""
    return subprocess.run(["pgrep", "-f", f"^python3 -u {name}"], capture_output=True).returncode == 0


def test_bwrap_exec_json_and_timeout(bwrap_site, tmp_path):
    prog = tmp_path / "hello.py"
    prog.write_text("import sys\nprint('hello')\nprint('warn', file=sys.stderr)\nsys.exit(3)")
    out = agentrl("sandbox", "exec", prog, "--json", "--backend", "bwrap", check=False)
    result = json.loads(out.stdout)
    assert (result["status"], result["exit_code"], result["stdout"], result["stderr"]) == (
        "error",
        3,
        "hello\n",
        "warn\n",
    )
    (tmp_path / "spin.sh").write_text("echo start; while :; do :; done")
    out = agentrl(
        "sandbox", "exec", tmp_path / "spin.sh", "--timeout", "1", "--json", "--backend", "bwrap", check=False
    )
    assert (json.loads(out.stdout)["status"], out.returncode) == ("timeout", 1)
    bad = agentrl("sandbox", "exec", prog, "--backend", "podman", check=False)
    assert bad.returncode != 0 and "--backend podman: choose docker, bwrap or local" in bad.stderr
    # local: its pool makes two sandboxes (one a spare), and says once that they isolate nothing
    local = agentrl("sandbox", "exec", prog, "--backend", "local", check=False)
    assert (local.stdout, local.returncode) == ("hello\n", 1) and local.stderr.count("NOT isolation") == 1, local.stderr


@pytest.mark.parametrize("cleanup", ["gc", pytest.param("next start", marks=pytest.mark.slow)])
def test_a_sigkilled_bwrap_owner_leaves_nothing_running_and_its_trees_go(bwrap_runtime, tmp_path, cleanup):
    """In a runtime folder of the test's own: no other process's first sandbox reaps its orphans before gc."""
    prog = tmp_path / f"prog-{uuid.uuid4().hex[:8]}.py"  # a name no other test's program has
    prog.write_text("import time; time.sleep(60)")
    proc = start_agentrl("sandbox", "exec", prog, "--timeout", "100", "--backend", "bwrap", stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while len(bwrap_trees(proc.pid)) < 2 or not sandboxed(prog.name):
        assert proc.poll() is None and time.monotonic() < deadline, "the program never started"
        time.sleep(0.05)
    proc.kill()
    proc.wait(30)
    trees = bwrap_trees(proc.pid)
    assert len(trees) == 2  # SIGKILL cannot be caught: the leased sandbox's tree and the spare's stay
    deadline = time.monotonic() + 10
    while sandboxed(prog.name):  # it died with its owner
        assert time.monotonic() < deadline, "a sandbox's program outlived its owner"
        time.sleep(0.05)
    if cleanup == "gc":
        assert "removed 2 bwrap sandbox(es)" in agentrl("sandbox", "gc").stderr
    else:
        (tmp_path / "ok.py").write_text("print('ok')")
        agentrl("sandbox", "exec", tmp_path / "ok.py", "--backend", "bwrap")
    assert not any(t["tree"].exists() for t in trees)
    assert not any(os.path.exists(d) for t in trees for d in t["cgroups"])


@pytest.fixture
def private_tmpdir(monkeypatch) -> Path:
    """A TMPDIR of the test's own, which the processes it starts inherit: local sandboxes' folders are made in it.
    Short: a Unix socket's path must fit in 108 bytes."""
    tmp = Path(tempfile.mkdtemp(prefix="arl-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(tmp))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def naming(text: str) -> set[int]:
    """The processes whose command line holds `text`."""
    found = subprocess.run(["pgrep", "-f", text], capture_output=True, text=True).stdout
    return {int(pid) for pid in found.split()}


# writes its pid and its child's to PIDS, and waits
LOCAL_PROG = """
import os, subprocess, time
child = subprocess.Popen(["sleep", "300"])
with open("PIDS.part", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename("PIDS.part", "PIDS")
time.sleep(300)
"""


def test_a_sigkilled_local_owner_leaves_nothing_running_and_no_folder(private_tmpdir):
    """Each local sandbox's warden sees its owner go: it kills everything under it (the program, its child) and
    removes the sandbox's folder; nothing is left for `gc`. The pool's spare sandbox too."""
    pids = private_tmpdir / "pids"
    prog = private_tmpdir / "prog.py"
    prog.write_text(LOCAL_PROG.replace("PIDS", str(pids)))
    sandboxes = f"{private_tmpdir}/agentrl-local-"  # in the command lines of wardens, executors, zygotes, spares
    proc = start_agentrl("sandbox", "exec", prog, "--timeout", "100", "--backend", "local", stderr=subprocess.STDOUT)
    programs: dict[int, str | None] = {}
    try:
        deadline = time.monotonic() + 60
        while len(list(private_tmpdir.glob("agentrl-local-*/exec.sock"))) < 2 or not pids.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the program never started"
            time.sleep(0.05)
        programs = {int(p): reaper.process_start_time(int(p)) for p in pids.read_text().split()}
        assert naming(sandboxes)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 10
        while naming(sandboxes) or any(reaper.process_start_time(p) == t for p, t in programs.items()):
            assert time.monotonic() < deadline, "a local sandbox's process outlived its owner"
            time.sleep(0.05)
        assert not list(private_tmpdir.glob("agentrl-local-*"))
    finally:  # a failed check leaves nothing running either
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in naming(sandboxes) | {p for p, t in programs.items() if reaper.process_start_time(p) == t}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_reaper_keeps_live_owners_and_other_hosts():
    me = reaper.owner_labels()
    assert reaper.owner_alive(me)
    assert not reaper.owner_alive({**me, reaper.START_LABEL: "1"})  # recycled pid
    assert reaper.owner_alive({**me, reaper.HOST_LABEL: "another-machine", reaper.PID_LABEL: "999999"})


WATCHED_OWNER = """
import asyncio, sys
from agentrl.sandbox import DockerSandbox, reaper

async def main():
    boxes = [await DockerSandbox.create() for _ in range(2)]
    print(reaper.watch(), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.docker
@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)], ids=["SIGKILL", "SIGTERM"]
)
def test_a_watchdog_removes_its_owners_containers_once_the_owner_is_gone(sandbox_image, docker_client, sig):
    """An owner that cannot run its exit cleanup (SIGKILL; a Ray env worker whose raylet died) leaves its containers
    to its watchdog (`reaper.watch`), which then exits; after a clean exit it has nothing to do and exits too."""
    owner = subprocess.Popen(
        [sys.executable, "-c", WATCHED_OWNER],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        watchdog = int(owner.stdout.readline())
        assert len(owned_by(docker_client, owner.pid)) == 2 and reaper.process_start_time(watchdog)
        owner.send_signal(sig)
        owner.wait(30)
    finally:  # a failed check must not leave the owner (and its containers) running: its watchdog then cleans up
        if owner.poll() is None:
            owner.kill()
            owner.wait(30)
    deadline = time.monotonic() + 30
    while owned_by(docker_client, owner.pid) or reaper.process_start_time(watchdog):
        assert time.monotonic() < deadline, "the watchdog did not remove the containers and exit"
        time.sleep(0.1)
