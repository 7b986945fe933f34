"""bwrap's host side against a hostile sandbox, image or user: the runtime folder is this user's alone, a sandbox sees
its socket's folder and nothing else of its tree, an owner record names no cgroup but its own sandbox's, and an image's
python3 compiles the executor's bytecode in a sandbox, never on the host."""

import asyncio
import json
import os
import shutil
import socket
import subprocess

import pytest

from agentrl.sandbox import BwrapSandbox, BwrapSandboxConfig, DockerSandbox, SandboxError, Status, bwrap, reaper
from agentrl.sandbox.base import runtime_dir


def test_a_runtime_folder_that_is_not_this_user_s_alone_is_refused(tmp_path, monkeypatch):
    """In a shared /tmp another user could make agentrl-UID first, then swap a sandbox's folder and answer on its
    socket: such a folder (open to others, someone else's, or a link) is refused, naming it."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    d = tmp_path / f"agentrl-{os.getuid()}"
    assert runtime_dir() == d and d.stat().st_mode & 0o777 == 0o700
    d.chmod(0o755)
    with pytest.raises(SandboxError, match=f"{d} is not a private folder of this user"):
        runtime_dir()
    d.chmod(0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(SandboxError, match="uid 65534"):
        runtime_dir()
    d.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    d.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SandboxError, match="not a private folder"):
        runtime_dir()


async def test_a_sandbox_sees_its_socket_alone_and_a_forged_owner_record_kills_nothing(bwrap_runtime):
    """The sandbox's tree holds owner.json, which names the cgroups whose processes are killed when the tree is
    removed: the sandbox sees only its socket's folder. And a record naming another sandbox's cgroup (a dead owner's,
    forged) is not trusted: collecting it leaves that sandbox running."""
    # one uid (a user namespace, as an unprivileged user runs it): the program may enter its socket's folder
    one_uid = await BwrapSandbox.create(BwrapSandboxConfig(rootfs="host", user_namespace=True))
    try:
        listed = await one_uid.run_python("import os; print(sorted(os.listdir('/run/agentrl')))")
        assert (listed.status, listed.stdout.strip()) == (Status.OK, "['exec.sock']")
    finally:
        await one_uid.close()
    victim = await BwrapSandbox.create(BwrapSandboxConfig(rootfs="host"))
    try:
        assert victim.cgroup is not None
        dead = subprocess.Popen(["true"])
        dead.wait()
        forged = bwrap_runtime / f"{bwrap.TREE_PREFIX}000000000000"
        forged.mkdir(mode=0o700)
        owner = {**reaper.owner_labels(), reaper.PID_LABEL: str(dead.pid), reaper.START_LABEL: "0"}
        (forged / "owner.json").write_text(json.dumps({**owner, "cgroup": victim.cgroup.record()}))
        assert reaper.owner_labels()[reaper.HOST_LABEL] == socket.gethostname()
        assert forged.name in bwrap.collect_orphans()  # its tree goes
        assert not forged.exists()
        alive = await victim.run_python("print('still here')")
        assert (alive.status, alive.stdout) == (Status.OK, "still here\n")
    finally:
        await victim.close()


@pytest.mark.docker
@pytest.mark.slow  # exports the image's root; the fast tier starts bwrap sandboxes on it elsewhere
async def test_an_image_s_python3_compiles_the_executor_in_a_sandbox(
    sandbox_image, docker_client, tmp_path, monkeypatch
):
    """An instance image's python3 is its author's code (here a .pth file that runs at its start): compiling the
    executor's bytecode with it must not run it on the host as root, where it saw the host's processes and files."""
    from agentrl.sandbox.image import export_rootfs

    exported = await asyncio.to_thread(export_rootfs, docker_client, sandbox_image, log=lambda _: None)
    root = tmp_path / "root"
    subprocess.run(["cp", "-al", str(exported), str(root)], check=True)  # hard links: no copy of the files
    site = next(root.glob("usr/lib/python3/dist-packages"))
    payload = (
        "import os\n"
        "if os.path.isdir('/agentrl/__pycache__'):\n"
        "    caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0]\n"
        "    pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "    open('/agentrl/__pycache__/seen.txt', 'w').write(f'{os.getuid()} {caps} {len(pids)}')\n"
    )
    (site / "zz_hostile.py").write_text(payload)
    (site / "zz_hostile.pth").write_text("import zz_hostile\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a cold cache: the compile runs
    sandbox = await BwrapSandbox.create(BwrapSandboxConfig(rootfs=root))
    try:
        assert (await sandbox.run_python("print(1)")).stdout == "1\n"
    finally:
        await sandbox.close()
    [seen] = (tmp_path / "cache").glob("agentrl/executor/**/__pycache__/seen.txt")
    _, caps, processes = seen.read_text().split()
    assert int(caps, 16) == 0 and int(processes) <= 3, seen.read_text()  # no capability; its own pid namespace
    shutil.rmtree(root, ignore_errors=True)


USERNS = r"""
import ctypes, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
print(libc.unshare(0x10000000), ctypes.get_errno() != 0)  # CLONE_NEWUSER
t = threading.Thread(target=print, args=("thread",))
t.start()
t.join()
print(subprocess.run(["echo", "child"], capture_output=True, text=True).stdout.strip())
"""


async def test_a_program_cannot_make_a_user_namespace(isolating_factory):
    """Inside a new user namespace a program would hold every capability (of it), the kernel's most used way up:
    Docker's seccomp profile refuses it, and so does bwrap's filter. Threads and child processes still start (clone3
    answers ENOSYS under both, and libc falls back to clone)."""
    sandbox = await isolating_factory()
    try:
        r = await sandbox.run_python(USERNS)
    finally:
        await sandbox.close()
    assert (r.status, r.stdout.split("\n")) == (Status.OK, ["-1 True", "thread", "child", ""]), r


KEYRINGS = r"""
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
add_key, keyctl = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
# into nobody's user keyring, which every sandbox's programs share; the id of the session keyring, the host's
print(libc.syscall(add_key, b"user", b"agentrl-leak", b"x", 1, ctypes.c_long(-4)), ctypes.get_errno())
print(libc.syscall(keyctl, 0, ctypes.c_long(-3), 0), ctypes.get_errno())  # KEYCTL_GET_KEYRING_ID
"""


@pytest.mark.parametrize("mode", [pytest.param("docker", marks=pytest.mark.docker), "bwrap", "bwrap-userns"])
async def test_a_program_has_no_keyrings(request, mode):
    """Kernel keyrings are not namespaced by bubblewrap: a program held the host process's session keyring (to read or
    clear) and nobody's user keyring, shared with every other sandbox, later ones too (one episode's note to the next).
    Refused as under Docker's seccomp profile, in both modes of bwrap (a user namespace keeps the session keyring)."""
    if mode == "docker":
        request.getfixturevalue("sandbox_image")
        sandbox = await DockerSandbox.create()
    else:
        request.getfixturevalue("bwrap_site")
        sandbox = await BwrapSandbox.create(BwrapSandboxConfig(rootfs="host", user_namespace=mode == "bwrap-userns"))
    try:
        r = await sandbox.run_python(KEYRINGS)
    finally:
        await sandbox.close()
    assert (r.status, r.stdout) == (Status.OK, "-1 1\n-1 1\n"), r
