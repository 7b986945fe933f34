"""`agentrl sandbox exec | gc` as real processes, and the reaper: no container outlives
its owner after SIGINT / SIGTERM; after SIGKILL the next start or `gc` removes it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import docker.errors
import pytest

from agentrl.sandbox import reaper

AGENTRL = [sys.executable, "-m", "agentrl"]


def owned_by(client, pid: int) -> list[dict]:
    # The low-level list: the high-level one inspects each container and races removals.
    return client.api.containers(all=True, filters={"label": f"{reaper.PID_LABEL}={pid}"})


def runs_prog(client, container: dict) -> bool:
    try:
        return any("prog.py" in " ".join(p) for p in client.api.top(container["Id"])["Processes"])
    except docker.errors.NotFound:
        return False


def start_exec(tmp_path, code: str, *args: str) -> subprocess.Popen:
    prog = tmp_path / "prog.py"
    prog.write_text(code)
    return subprocess.Popen(
        [*AGENTRL, "sandbox", "exec", str(prog), *args], stdout=subprocess.PIPE, text=True, preexec_fn=deliver_sigint
    )


def deliver_sigint() -> None:
    """In the child: SIGINT as a terminal's Ctrl-C delivers it.

    Ignored and blocked signals survive exec: a shell's background job (as CI may run in)
    ignores SIGINT, and a library thread of the test process may have it blocked.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


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


def test_exec_json(sandbox_image, tmp_path):
    prog = tmp_path / "hello.py"
    prog.write_text("import sys\nprint('hello')\nprint('warn', file=sys.stderr)\nsys.exit(3)")
    out = subprocess.run([*AGENTRL, "sandbox", "exec", str(prog), "--json"], capture_output=True, text=True)
    result = json.loads(out.stdout)
    assert {"status", "exit_code", "stdout", "stderr", "wall_s"} <= result.keys()
    got = (result["status"], result["exit_code"], result["stdout"], result["stderr"])
    assert got == ("error", 3, "hello\n", "warn\n")
    assert out.returncode == 1


def test_exec_timeout_and_shell(sandbox_image, tmp_path):
    prog = tmp_path / "spin.sh"
    prog.write_text("echo start; while :; do :; done")
    out = subprocess.run([*AGENTRL, "sandbox", "exec", str(prog), "--timeout", "1", "--json"], capture_output=True)
    result = json.loads(out.stdout)
    assert (result["status"], result["stdout"]) == ("timeout", "start\n")
    assert 1 <= result["wall_s"] < 3


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


def test_sigkill_orphans_are_removed_by_gc(sandbox_image, docker_client, tmp_path):
    pid = killed_exec(docker_client, tmp_path)
    gc = subprocess.run([*AGENTRL, "sandbox", "gc"], capture_output=True, text=True)
    assert gc.returncode == 0 and "removed 2" in gc.stderr
    assert owned_by(docker_client, pid) == []


def test_sigkill_orphans_are_removed_by_the_next_start(sandbox_image, docker_client, tmp_path):
    pid = killed_exec(docker_client, tmp_path)
    (tmp_path / "ok.py").write_text("print('ok')")
    subprocess.run([*AGENTRL, "sandbox", "exec", str(tmp_path / "ok.py")], check=True, capture_output=True)
    assert owned_by(docker_client, pid) == []


def test_reaper_keeps_live_owners_and_other_hosts():
    me = reaper.owner_labels()
    assert reaper.owner_alive(me)
    assert not reaper.owner_alive({**me, reaper.START_LABEL: "1"})  # recycled pid
    assert reaper.owner_alive({**me, reaper.HOST_LABEL: "another-machine", reaper.PID_LABEL: "999999"})
