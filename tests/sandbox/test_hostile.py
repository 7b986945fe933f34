"""Hostile programs against the real sandboxes, Docker's and bubblewrap's, the same cases on both: each contained,
with the right status, within its timeout plus a small slack; afterwards nothing of theirs runs, in the sandbox or
on the host, and the next call (same sandbox, then a fresh one) works."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from agentrl.sandbox import (
    BwrapSandbox,
    BwrapSandboxConfig,
    CallLimits,
    DockerSandbox,
    DockerSandboxConfig,
    SandboxPool,
    Status,
)

TIMEOUT_S = 2.0  # the limit for the programs that only end at it
# The limit for the others, so that their status never races a loaded CPU: a memory bomb needs
# about 0.5 CPU-s of page faults to reach the OOM killer, which 2 s did not give it under 2 test workers.
ROOM_S = 30.0
SLACK_S = 3.0  # kill + sweep + transport
# A fork bomb's processes share the executor's CPU in its cgroup: the executor's wake-up and kill get ~1/257 of it
# (calls of up to 4.2 s of a 2 s limit measured under load). Still under the host's own 10 s of transport slack, so
# the executor's kill is what ended the call.
FORK_BOMB_SLACK_S = 8.0
MARK = f"agentrl-hostile-{uuid.uuid4().hex[:8]}"  # argv marker to look for on the host

# Count the processes besides the probe and the three a sandbox runs between calls: its init (docker's, or
# bubblewrap's), the executor and its zygote (the probe took the spare). Whatever a program left would be more.
PROBE = "import os\nprint(sum(p.isdigit() and int(p) != os.getpid() for p in os.listdir('/proc')) - 3)"

CASES = {
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        Status.TIMEOUT,
    ),
    "busy_loop": ("while True: pass", Status.TIMEOUT),
    "sleep_forever": ("import time; time.sleep(10**6)", Status.TIMEOUT),
    "memory_bomb": ("x = []\nwhile True: x.append(b'x' * 10**7)", Status.OOM),
    "fill_work_dir": (
        "import itertools\nfor i in itertools.count():\n    open(f'/work/f{i}', 'wb').write(b'x' * 2**24)",
        Status.ERROR,
    ),
    "fill_tmp": (
        "import itertools\nfor i in itertools.count():\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 2**24)",
        Status.ERROR,
    ),
    "gigabyte_of_output": (
        "import sys\nb = b'x' * 2**20\nfor _ in range(1024):\n    sys.stdout.buffer.write(b)",
        Status.OUTPUT_LIMIT,
    ),
    "non_utf8_output": ("import sys; sys.stdout.buffer.write(bytes(range(256)) * 8)", Status.OK),
    "close_stdout_then_spin": ("import os\nos.close(1)\nos.close(2)\nwhile True: pass", Status.TIMEOUT),
    "read_stdin": ("import sys; print(repr(sys.stdin.read()))", Status.OK),
    "detached_setsid_child": (
        "import subprocess\n"
        f"subprocess.Popen(['python3', '-c', 'import os, time\\nos.setsid()\\nif os.fork(): os._exit(0)\\n"
        f"time.sleep(1000)', '{MARK}'])\n"
        "print('spawned')",
        Status.OK,
    ),
    "network_connection": ("import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)", Status.ERROR),
    "read_etc_shadow": ("print(open('/etc/shadow').read())", Status.ERROR),
    "docker_socket": ("import socket; socket.socket(socket.AF_UNIX).connect('/var/run/docker.sock')", Status.ERROR),
    "unlink_executor_socket": ("import os; os.unlink('/run/agentrl/exec.sock')", Status.ERROR),
    "kill_init": ("import os; os.kill(1, 9)", Status.ERROR),
    "kill_executor": ("import os; os.kill(os.getppid(), 9)", Status.ERROR),
    "exit_0": ("exit(0)", Status.OK),
    "os_exit_0": ("import os; os._exit(0)", Status.OK),
}


# The backends, and bubblewrap's two lesser modes (the start-up line says which a host gets): rlimits where no cgroup
# can be made, and one uid in a user namespace where it runs unprivileged.
BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker),
    "bwrap",
    pytest.param("bwrap-rlimits", marks=pytest.mark.slow),
    pytest.param("bwrap-userns", marks=pytest.mark.slow),
]
# What differs in those modes, as the README lists it, and nothing else: without a cgroup a memory bomb meets
# RLIMIT_AS (a MemoryError), not the OOM killer.
DIFFERENT = {"bwrap-rlimits": {"memory_bomb": Status.ERROR}}
# The cases whose containment is the second uid (the program cannot signal, or unlink the socket of, a process of
# another uid): one uid has none. Root-only.
TWO_UIDS = {"kill_init", "kill_executor", "unlink_executor_socket"}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
async def pool(request, backend, bwrap_site):
    limits = CallLimits(timeout_s=TIMEOUT_S)
    if backend == "docker":
        request.getfixturevalue("sandbox_image")
        cfg = DockerSandboxConfig(limits=limits)
        factory = lambda: DockerSandbox.create(cfg)  # noqa: E731
    else:
        mode = {"bwrap-rlimits": {"cgroup": False}, "bwrap-userns": {"user_namespace": True}}.get(backend, {})
        cfg = BwrapSandboxConfig(limits=limits, rootfs="host", **mode)
        factory = lambda: BwrapSandbox.create(cfg)  # noqa: E731
    async with SandboxPool(factory, size=2) as pool:
        yield pool


def host_processes_with_marker() -> str:
    return subprocess.run(["pgrep", "-af", MARK], capture_output=True, text=True).stdout.strip()


# Cases the executor alone handles (output, stdin, exit), the same whatever contains it: on bwrap, slow tier only.
EXECUTOR_ALONE = {"gigabyte_of_output", "non_utf8_output", "read_stdin", "exit_0", "os_exit_0"}
# More programs that only end at the time limit: the fast tier keeps fork_bomb's.
WAIT_OUT = {"busy_loop", "sleep_forever", "close_stdout_then_spin"}


def backend_cases():
    """Every case on every backend; slow: those that only end at the time limit (the fast tier keeps fork_bomb's),
    and on bwrap those the executor alone handles (the fast tier runs them on docker)."""
    for b in BACKENDS:
        backend, marks = (b, []) if isinstance(b, str) else (b.values[0], list(b.marks))
        for name in CASES:
            if name in WAIT_OUT or (backend == "bwrap" and name in EXECUTOR_ALONE):
                marks_here = [*marks, pytest.mark.slow]
            else:
                marks_here = marks
            yield pytest.param(backend, name, marks=marks_here, id=f"{backend}-{name}")


@pytest.mark.parametrize(("backend", "name"), list(backend_cases()), indirect=["backend"])
async def test_hostile_program_is_contained(pool, backend, name):
    code, expected = CASES[name]
    if backend == "bwrap-userns" and name in TWO_UIDS:
        pytest.skip("root-only: contained by a second uid, which a user namespace of one uid does not have")
    if backend in ("bwrap-rlimits", "bwrap-userns") and name in WAIT_OUT:
        pytest.skip("the executor's wall-clock kill, the same in every mode: docker and bwrap run it")
    expected = DIFFERENT.get(backend, {}).get(name, expected)
    async with pool.sandbox() as sb:
        limit = TIMEOUT_S if expected is Status.TIMEOUT else ROOM_S
        r = await sb.run_python(code, timeout_s=limit)
        assert r.status is expected, (r.status, r.stderr[-500:])
        assert r.call_s < limit + (FORK_BOMB_SLACK_S if name == "fork_bomb" else SLACK_S)
        if name == "gigabyte_of_output":
            assert r.truncated and len(r.stdout) == sb.limits.max_output_bytes
        if name == "non_utf8_output":
            assert "\ufffd" in r.stdout and len(r.stdout) == 256 * 8
        if name == "read_stdin":
            assert r.stdout == "''\n"
        if name == "detached_setsid_child":
            assert r.swept >= 1
        if name == "network_connection":
            assert "Network is unreachable" in r.stderr
        if name.startswith(("kill_", "unlink_")):
            assert "Operation not permitted" in r.stderr or "Permission denied" in r.stderr
        if expected is not CASES[name][1]:
            assert "MemoryError" in r.stderr
        if name.startswith("fill_"):
            assert "No space left on device" in r.stderr
        # Nothing it started is still running, and the same sandbox still serves.
        after = await sb.run_python(PROBE)
        assert (after.status, after.stdout) == (Status.OK, "0\n")
    assert host_processes_with_marker() == ""
    async with pool.sandbox() as fresh:
        r = await fresh.run_python("print('next')")
        assert (r.status, r.stdout) == (Status.OK, "next\n")


# What a program can leave where the host will then read or write a file (a grader's answer.py, an agent's edit).
LEAVE_NON_FILES = (
    "import os, socket\n"
    "os.mkfifo('/work/fifo')\n"
    "os.symlink('/work/fifo', '/work/to_fifo')\n"
    "open('/work/real', 'w').write('kept')\n"
    "os.symlink('/work/real', '/work/to_real')\n"
    "os.mkdir('/work/dir')\n"
    "os.symlink('/dev', '/work/dev')\n"
    "socket.socket(socket.AF_UNIX).bind('/work/sock')\n"
)
NON_FILES = {
    "fifo": "a FIFO",
    "to_fifo": "a symbolic link",
    "to_real": "a symbolic link",
    "dir": "a directory",
    "dev/zero": "a character device",  # through a link to a folder: only the last component is not followed
    "sock": "a socket",
}


async def test_file_requests_refuse_what_is_not_a_regular_file_and_a_nul(pool):
    """The executor serves one request at a time, so an open() that waited (a FIFO with no writer) would stall it and
    the host would call the sandbox failed: each is refused at once, as an error of the caller's, as is a NUL byte
    (which open() and exec() refuse); nothing is touched and the sandbox serves on."""
    async with pool.sandbox() as sb:
        r = await sb.run_python(LEAVE_NON_FILES)
        assert r.ok, r.stderr
        for path, kind in NON_FILES.items():
            for request in (sb.read_file, lambda p: sb.write_file(p, "x")):
                with pytest.raises(OSError, match=f"/work/{path} is {kind}, not a regular file"):
                    await request(path)
        for request in (sb.read_file, lambda p: sb.write_file(p, "x")):
            with pytest.raises(ValueError, match="embedded null byte"):
                await request("a\0b")
        for kw in (
            {"argv": ["echo", "a\0b"]},
            {"argv": ["echo"], "cwd": "a\0"},
            {"argv": ["echo"], "env": {"A": "\0"}},
        ):
            with pytest.raises(ValueError, match="cannot hold a NUL byte"):
                await sb.run(**kw)
        assert await sb.read_file("real") == b"kept"
        r = await sb.run(["cat", "real"])
        assert (r.status, r.stdout) == (Status.OK, "kept")


WATCHER = r"""
import glob, os, threading, time
def watch():  # what a cell could leave behind to tamper with what comes later: the host's files, the grading
    while True:
        for p in glob.glob("/work/*.hidden"):
            os.rename(p, p + ".stolen")
        with open("/work/ticks", "a") as f:
            f.write(".")
        time.sleep(0.02)
threading.Thread(target=watch, daemon=True).start()
time.sleep(0.1)
"""


# A program runs as the persistent interpreter's uid, so it can continue it (as a cell's child can, racing the stop).
CONTINUE_SESSION = (
    "import os, signal\n"
    "for p in filter(str.isdigit, os.listdir('/proc')):\n"
    "    if b'--session' in open(f'/proc/{p}/cmdline', 'rb').read():\n"
    "        os.kill(int(p), signal.SIGCONT)\n"
    "        print('continued')\n"
)


async def test_a_cell_s_threads_run_only_in_cells(pool):
    """Every process a call starts dies with it (the sweep), but for the persistent interpreter: a thread a cell
    started would run on through the requests that follow (the host writing hidden tests, a program grading). The
    interpreter is stopped between its cells, and again after every call, which may have continued it."""
    async with pool.sandbox() as sb:
        assert (await sb.run_cell(WATCHER)).ok
        woke = await sb.run_python(CONTINUE_SESSION)
        assert woke.stdout == "continued\n", woke
        ticks = len(await sb.read_file("ticks"))
        await sb.write_file("tests.hidden", "assert f(2) == 4")
        r = await sb.run_python("import os, time; time.sleep(0.3); print(sorted(os.listdir('.')))")
        assert r.stdout == "['tests.hidden', 'ticks']\n" and len(await sb.read_file("ticks")) == ticks, r
        later = await sb.run_cell("import time; time.sleep(0.2); print(sorted(os.listdir('.')))")
        assert later.stdout == "['tests.hidden.stolen', 'ticks']\n"  # its next cell: it runs again
        await sb.reset_session()


async def test_a_program_exec_refuses_is_the_caller_s_error(pool):
    """A program exec() or chdir() refuses (an agent's bash command over the kernel's 128 KiB for one argument, a name
    too long) ends `error` 127, as a missing one does: not an infrastructure failure, which would fail the sandbox and
    have the episode left out of the loss, an agent's way out of a low reward."""
    async with pool.sandbox() as sb:
        for argv, cwd, said in (
            (["bash", "-c", "echo " + "x" * (200 << 10)], ".", "Argument list too long"),
            (["x" * 300], ".", "File name too long"),
            (["echo"], "d" * 300, "File name too long"),
        ):
            r = await sb.run(argv, cwd=cwd)
            assert (r.status, r.exit_code) == (Status.ERROR, 127) and said in r.stderr, r
        r = await sb.run(["echo", "still here"])
        assert (r.status, r.stdout) == (Status.OK, "still here\n")


async def test_programs_run_unprivileged_in_a_locked_sandbox(pool, backend):
    if backend == "bwrap-userns":
        pytest.skip("root-only: programs run as the executor's uid in a user namespace of one uid")
    async with pool.sandbox() as sb:
        r = await sb.run_python(
            "import os\n"
            "print(os.getuid(), os.getgid(), os.getgroups())\n"
            "print(sorted(l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'NoNewPrivs'))))\n"
            "try:\n    open('/etc/x', 'w')\nexcept OSError as e:\n    print(e.errno)\n"
        )
        lines = r.stdout.splitlines()
        assert lines[0] == "65534 65534 []"
        assert lines[1] == "['0000000000000000', '1']"  # no capabilities, no-new-privileges
        assert lines[2] == "30"  # EROFS: read-only root
        if isinstance(sb, DockerSandbox):
            attrs = sb.container.attrs["HostConfig"]
            assert attrs["NetworkMode"] == "none" and attrs["ReadonlyRootfs"] and attrs["Init"]
            assert attrs["CapDrop"] == ["ALL"] and "no-new-privileges" in attrs["SecurityOpt"][0]
            assert attrs["Memory"] == attrs["MemorySwap"] == 512 << 20 and attrs["PidsLimit"] == 256
        elif sb.cgroup is not None:
            memory, pids = sb.cgroup.dirs["memory"], sb.cgroup.dirs["pids"]  # this host's cgroups are v1
            assert int((memory / "memory.limit_in_bytes").read_text()) == 512 << 20
            assert int((memory / "memory.memsw.limit_in_bytes").read_text()) == 512 << 20
            assert int((pids / "pids.max").read_text()) == 256
            # the executor keeps its three capabilities (SETUID, SETGID, KILL), as in the container
            r = await sb.run(["sh", "-c", "grep CapEff /proc/1/status /proc/2/status"])
            assert r.stdout.count("00000000000000e0") == 1, r.stdout


async def test_a_sandbox_sees_none_of_the_host(pool, tmp_path):
    """The host's files (its /tmp, home, the project and its venv) are not there; nor are other processes, and what
    one sandbox writes no other sees."""
    (tmp_path / "host.txt").write_text("the host's")
    host = [str(tmp_path / "host.txt"), str(Path(__file__).resolve()), sys.executable, str(Path.home() / ".cache")]
    async with pool.sandbox() as a, pool.sandbox() as b:
        await a.write_file("mine.txt", "secret")
        r = await b.run_python(
            "import os\n"
            f"print([p for p in {[*host, '/work/mine.txt']!r} if os.path.exists(p)])\n"
            "print(len([p for p in os.listdir('/proc') if p.isdigit()]) < 10)"
        )
        assert r.stdout.splitlines() == ["[]", "True"], r.stdout + r.stderr
