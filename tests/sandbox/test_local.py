"""Executor semantics through LocalSandbox (no Docker): statuses, limits, sweep, session, files; and that nothing
outlives a SIGKILLed executor, warden or owner."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.sandbox import CallLimits, LocalSandbox, LocalSandboxConfig, SandboxError, Status, reaper
from agentrl.sandbox.image import sandboxes_dir


@pytest.fixture
async def sb():
    sandbox = await LocalSandbox.create(LocalSandboxConfig(limits=CallLimits(timeout_s=5, memory_bytes=1 << 30)))
    yield sandbox
    await sandbox.close()
    await sandbox.close()  # closing twice is safe


async def test_ok_and_error(sb):
    r = await sb.run_python("print('hi')")
    assert (r.status, r.exit_code, r.stdout) == (Status.OK, 0, "hi\n")
    r = await sb.run_python("import sys; print('bad', file=sys.stderr); sys.exit(3)")
    assert (r.status, r.exit_code, r.stderr) == (Status.ERROR, 3, "bad\n")
    r = await sb.run_python("raise ValueError('boom')")
    assert r.status is Status.ERROR and "ValueError: boom" in r.stderr and "snippet.py" in r.stderr


async def test_command_not_found_is_the_callers_error(sb):
    r = await sb.run(["definitely-not-a-program"])
    assert (r.status, r.exit_code) == (Status.ERROR, 127)


async def test_wall_timeout_kills(sb):
    r = await sb.run_python("import time; time.sleep(100)", timeout_s=0.5)
    assert r.status is Status.TIMEOUT and r.exit_code is None
    assert 0.5 <= r.wall_s < 2


async def test_cpu_limit(sb):
    sb.limits = sb.limits.model_copy(update={"cpu_s": 1, "timeout_s": 10})
    r = await sb.run_python("while True: pass")
    # SIGXCPU: the CPU limit ended it, not the wall clock's (no bound on wall_s: a loaded host gives the loop a
    # fraction of a core, and a local sandbox has no cgroup of its own)
    assert r.status is Status.TIMEOUT and r.signal == 24


async def test_output_cap(sb):
    sb.limits = sb.limits.model_copy(update={"max_output_bytes": 1000})
    r = await sb.run_python("import sys\nwhile True: sys.stdout.write('x' * 4096)")
    assert r.status is Status.OUTPUT_LIMIT and r.truncated
    assert r.stdout == "x" * 1000


async def test_exact_cap_is_not_truncated(sb):
    sb.limits = sb.limits.model_copy(update={"max_output_bytes": 1000})
    r = await sb.run_python("print('x' * 999)")
    assert r.status is Status.OK and not r.truncated and len(r.stdout) == 1000


async def test_non_utf8_output_is_replaced(sb):
    r = await sb.run_python("import sys; sys.stdout.buffer.write(b'a\\xff\\xfeb')")
    assert r.status is Status.OK and r.stdout == "a\ufffd\ufffdb"


async def test_stdin(sb):
    r = await sb.run(["cat"], stdin="to stdin")
    assert r.stdout == "to stdin"
    r = await sb.run_python("import sys; print(repr(sys.stdin.read()))")
    assert r.stdout == "''\n"  # no stdin given: EOF at once, never a hang


async def test_leftover_processes_are_swept(sb):
    marker = "agentrl-sweep-marker"
    code = (
        "import subprocess\n"
        "subprocess.Popen(['python3', '-c', 'import os, time\\nos.setsid()\\nif os.fork(): os._exit(0)\\n"
        f"time.sleep(1000)', '{marker}'])\n"
        "print('spawned')"
    )
    r = await sb.run_python(code)
    assert r.status is Status.OK and r.swept >= 1
    r = await sb.run(["pgrep", "-f", marker])
    assert (r.status, r.exit_code) == (Status.ERROR, 1)  # no such process left


async def test_env_and_cwd(sb):
    await sb.write_file("sub/x.txt", "data")
    r = await sb.run(["sh", "-c", "echo $FOO; cat x.txt"], env={"FOO": "bar"}, cwd="sub")
    assert r.stdout == "bar\ndata"


async def test_files_roundtrip_and_escape(sb):
    await sb.write_file("a/b.bin", b"\x00\x01")
    assert await sb.read_file("a/b.bin") == b"\x00\x01"
    with pytest.raises(FileNotFoundError, match=r"^\[Errno 2\] No such file or directory: '/"):  # errno said once
        await sb.read_file("missing.txt")
    with pytest.raises(ValueError, match="outside the work dir"):
        await sb.read_file("../../etc/passwd")
    with pytest.raises(ValueError, match="embedded null byte"):  # the caller's mistake, not a failed sandbox
        await sb.read_file("a\0b")
    assert await sb.read_file("a/b.bin") == b"\x00\x01"


async def test_session_keeps_state_and_echoes(sb):
    assert (await sb.run_cell("x = 20")).stdout == ""
    r = await sb.run_cell("x + 1")
    assert r.status is Status.OK and r.stdout == "21\n"
    r = await sb.run_cell("1/0")
    assert r.status is Status.ERROR and "ZeroDivisionError" in r.stderr and "<cell 3>" in r.stderr
    assert (await sb.run_cell("x")).stdout == "20\n"  # an exception keeps the state


async def test_session_timeout_resets_state(sb):
    await sb.run_cell("y = 1")
    r = await sb.run_cell("import time; time.sleep(100)", timeout_s=0.5)
    assert r.status is Status.TIMEOUT and r.session_reset
    r = await sb.run_cell("y")
    assert r.status is Status.ERROR and "NameError" in r.stderr


async def test_session_exit_and_hard_exit(sb):
    await sb.run_cell("z = 1")
    r = await sb.run_cell("exit(0)")
    assert r.status is Status.OK and not r.session_reset
    assert (await sb.run_cell("z")).stdout == "1\n"
    r = await sb.run_cell("import os; os._exit(4)")
    assert (r.status, r.exit_code, r.session_reset) == (Status.ERROR, 4, True)
    await sb.reset_session()
    assert (await sb.run_cell("'fresh'")).stdout == "'fresh'\n"


async def test_python_snippet_runs_like_a_fresh_interpreter(sb):
    # run_python forks the started executor instead of exec-ing python3: same observable behaviour.
    code = (
        "import atexit, os, sys, threading, time\n"
        "atexit.register(lambda: print('atexit'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
        "print(__name__, os.path.basename(sys.argv[0]), os.environ['HOME'] == os.getcwd(), sys.stdin.read() == 'in')\n"
    )
    r = await sb.run_python(code, stdin="in")
    assert (r.status, r.stdout) == (Status.OK, "__main__ snippet.py True True\nthread\natexit\n")
    r = await sb.run_python("import sys; sys.exit('bye')")
    assert (r.status, r.exit_code, r.stderr) == (Status.ERROR, 1, "bye\n")


def executor_module():
    """The executor as a module (it is a stdlib-only script, not part of the agentrl package)."""
    spec = importlib.util.spec_from_file_location("executor", sandboxes_dir() / "python" / "executor.py")
    executor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(executor)
    return executor


async def test_executor_is_ready_with_its_zygote_up_and_makes_the_first_spare_after_its_first_answer(sb):
    # Ready (said on --ready-fd) means the zygote is up, so a probe never waits behind its start (on a busy machine
    # that timed out and threw a healthy sandbox away); the first spare is forked after the first answer, off the
    # cold start. (the first zygote is a fork of the executor, so neither is told apart by its command line)
    executor = executor_module()
    (pid,) = children(sb.proc.pid)  # sb.proc is the executor's warden
    assert len(executor.descendants(pid)) == 1
    assert await sb.healthy()
    deadline = time.monotonic() + 10
    while len(executor.descendants(pid)) < 2:
        assert time.monotonic() < deadline, "no spare after the first answer"
        await asyncio.sleep(0.01)


def test_executor_defaults_match_call_limits():
    # The executor is stdlib-only and keeps its own defaults (for direct use); they must not drift.
    executor = executor_module()
    limits = CallLimits().model_dump()
    assert {k: executor.DEFAULTS[k] for k in limits} == limits


def test_both_walks_find_the_live_descendants_and_no_zombie():
    """The sweep's two walks of the process tree (the children files, then the scan of every process that has the
    last word) agree: a grandchild is found, an exited child that is not yet reaped is not."""
    import signal
    import subprocess
    import sys
    import time

    executor = executor_module()
    # a child that starts a sleeping grandchild, and a child that exits at once (a zombie until waited for)
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time; print(subprocess.Popen(['sleep', '30']).pid, flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
    )
    exited = subprocess.Popen(["true"])
    grandchild = []
    try:
        grandchild = [int(parent.stdout.readline())]  # the parent says its child's pid once it is started
        while (executor._stat(exited.pid) or [b"Z"])[0] != b"Z":
            time.sleep(0.01)
        mine = {parent.pid, *grandchild}
        found_by_scan, found_by_walk = executor._descendants_by_scan(os.getpid()), executor.descendants(os.getpid())
        assert mine <= found_by_scan and mine <= found_by_walk
        assert exited.pid not in found_by_scan | found_by_walk
    finally:
        for pid in grandchild:
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
        exited.wait()


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


# Leaves a child in its process group and a daemon (double fork and setsid: out of its group and session), writes
# {pid: start time} of its executor (a Python program's parent), itself, the child and the daemon to PIDS, and waits.
LEAVER = """
import json, os, subprocess, time
pids = [os.getppid(), os.getpid(), subprocess.Popen(["sleep", "300"]).pid]
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    daemon = os.fork()
    if daemon == 0:
        os.execvp("sleep", ["sleep", "300"])
    os.write(w, str(daemon).encode())
    os._exit(0)
os.close(w)
pids.append(int(os.read(r, 32)))
starts = {p: open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[19] for p in pids}
with open("PIDS.part", "w") as f:
    json.dump(starts, f)
os.rename("PIDS.part", "PIDS")
time.sleep(300)
"""


def leaver(pids_file: Path) -> str:
    return LEAVER.replace("PIDS", str(pids_file))


async def written(path: Path, timeout_s: float = 20.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never written"
        await asyncio.sleep(0.02)
    return {int(p): start for p, start in json.loads(path.read_text()).items()}


def running(procs: dict[int, str]) -> list[int]:
    """Which of these processes (pid: start time, so that a reused pid is not one) still run."""
    return [p for p, start in procs.items() if reaper.process_start_time(p) == start and reaper.process_alive(p)]


async def gone(procs: dict[int, str], timeout_s: float = 10.0) -> list[int]:
    """Wait for these processes to end; those still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    while running(procs) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return running(procs)


def kill(procs: dict[int, str]) -> None:
    """The test's own leftovers, should it fail."""
    for pid in running(procs):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("victim", ["executor", "warden"])
async def test_nothing_outlives_a_sigkilled_executor_or_its_warden(sb, tmp_path, victim):
    """A SIGKILLed executor cannot sweep: its warden kills what it leaves (a daemon that left the program's process
    group and session too) and removes the sandbox's folder. A SIGKILLed warden: the executor sweeps, then exits."""
    call = asyncio.create_task(sb.run_python(leaver(tmp_path / "pids"), timeout_s=60))
    procs = await written(tmp_path / "pids")
    try:
        os.kill(next(iter(procs)) if victim == "executor" else sb.proc.pid, signal.SIGKILL)
        with pytest.raises(SandboxError) as failed:
            await call
        assert await gone(procs) == []
        assert "local executor exited with -9" in str(failed.value)
        if victim == "executor":
            assert not sb.root.exists()
    finally:
        kill(procs)


OWNER = """
import asyncio, json, sys, warnings
from agentrl.sandbox import LocalSandbox
warnings.simplefilter("ignore")

async def main():
    sb = await LocalSandbox.create()
    print(json.dumps([sb.proc.pid, str(sb.root)]), flush=True)
    await sb.run_python(sys.stdin.read(), timeout_s=60)

asyncio.run(main())
"""


async def test_nothing_outlives_a_sigkilled_owner_and_its_folder_goes(tmp_path):
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    procs: dict[int, str] = {}
    root = None
    try:
        owner.stdin.write(leaver(tmp_path / "pids").encode())
        owner.stdin.close()
        warden, root = json.loads(owner.stdout.readline())
        procs = {warden: reaper.process_start_time(warden)} | await written(tmp_path / "pids")
        owner.kill()
        owner.wait()
        assert await gone(procs) == []  # the warden, the executor, the program, its child and its daemon
        assert not Path(root).exists()
    finally:
        kill(procs)
        owner.kill()
        owner.wait()
        if root:
            shutil.rmtree(root, ignore_errors=True)
