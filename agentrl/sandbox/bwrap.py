"""BwrapSandbox: the executor in bubblewrap namespaces, with no daemon.

The same executor and host<->executor protocol as Docker (`sandboxes/python/executor.py` on a Unix
socket, spare forks included); what Docker's defaults promise, made by bubblewrap (Debian's
`bubblewrap`, about 50 kB) and a cgroup of the sandbox's own:

- new network (loopback only), pid, ipc, uts, mount and cgroup namespaces; `--die-with-parent`,
  `--new-session`, no-new-privileges (bubblewrap always sets it);
- a read-only root: the sandbox image's root filesystem when it is at hand (exported by
  `agentrl sandbox build`), otherwise the host's /usr, /bin, /sbin and /lib* with a generated
  /etc; never the host's /etc, /root, /home, /tmp, the project or its venv. The executor and
  the test tools (sandboxes/python/requirements.txt) are bound in read-only at /agentrl;
- size-limited tmpfs /work and /tmp, an executor-only /code;
- run as root, the executor keeps CAP_SETUID, CAP_SETGID and CAP_KILL and each program runs as
  nobody with none (as in the container); run unprivileged, a user namespace maps one uid, so
  programs run as the executor's uid and could signal it: the start-up line says so;
- memory (swap included), pids and CPU limits from a cgroup per sandbox (v2, or v1 where the host
  has that), entered before bubblewrap starts; where none can be made, rlimits per call
  (RLIMIT_AS, RLIMIT_NPROC) and the start-up line says so. Then a memory bomb ends `error`
  (a MemoryError), not `oom`; RLIMIT_AS holds per process, and RLIMIT_NPROC counts all of
  nobody's processes on the host (the README's table of modes).

No new user namespace: a seccomp filter (`seccomp_filter`) refuses unshare and clone with CLONE_NEWUSER (clone3
answers ENOSYS, as under Docker's profile, and libc falls back to clone); run unprivileged, bubblewrap's
--disable-userns does too. Inside one a program would hold every capability (of that namespace), as Docker's profile
does not allow either. No kernel keyrings either (add_key, request_key, keyctl answer EPERM, as under Docker's
profile): they are not namespaced by bubblewrap, so a program would hold the host process's session keyring (read
it, clear it) and share nobody's user keyring with every other sandbox, later ones included. The rest of that profile
is not reproduced: a program holds no capability and cannot gain one, so the syscalls it blocks for root do not apply.

A sandbox's host side is one folder (`tree`) in the runtime dir (`agentrl.sandbox.base.runtime_dir`: this user's
alone): `socket/`, the one part the sandbox sees, and `owner.json` (the owner's pid, its start time, host and
session, and the cgroup folders, which removal trusts only when they are the sandbox's own). A SIGKILLed
owner's bubblewrap dies with it (`--die-with-parent`); its trees are removed at the next start
of a bwrap sandbox on this host and by `agentrl sandbox gc` (`collect_orphans`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import hashlib
import json
import logging
import os
import platform
import secrets
import shlex
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from docker.utils import parse_bytes  # Docker's size notation, as DockerSandboxConfig's sizes are read
from pydantic import BaseModel, ConfigDict, Field

from agentrl.sandbox import reaper
from agentrl.sandbox.base import (
    CallLimits,
    ExecutorSandbox,
    SandboxError,
    executor_ready,
    runtime_dir,
    start_executor,
)
from agentrl.sandbox.image import (
    SANDBOX_MOUNTS,
    cache_dir,
    file_sha256,
    python_version,
    rootfs_dir,
    sandboxes_dir,
    site_dir,
)

log = logging.getLogger(__name__)

TREE_PREFIX = "bwrap-"
SOCKET_IN_SANDBOX = "/run/agentrl"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# not --unshare-all: it would map one uid as root too, and nobody could not be switched to
NAMESPACES = tuple(f"--unshare-{ns}" for ns in ("ipc", "pid", "net", "uts", "cgroup-try"))
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NOBODY = (65534, 65534)
# What a host-rooted sandbox gets of the host: the system's programs and libraries, read-only.
HOST_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# A rootfs's top-level entries the sandbox makes anew (or leaves out) instead of binding.
ETC = {
    "passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/work:/usr/sbin/nologin\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    "hostname": "sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
}


class BwrapSandboxConfig(BaseModel):
    """How each bubblewrap sandbox is started. Defaults are the locked-down ones, Docker's own."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    rootfs: Path | Literal["host"] | None = None
    """root filesystem: a folder with python3 >= 3.9, or "host": the host's /usr, /bin and /lib* with a generated /etc;
    None: the sandbox image's as `agentrl sandbox build` exported it, else the host's"""
    memory: str = "512m"
    """memory limit, tmpfs contents and swap included (the cgroup's; RLIMIT_AS per call without one)"""
    cpus: float = Field(1.0, gt=0)
    """CPU quota in cores (a cgroup's: none without one)"""
    pids: int = Field(256, ge=16)
    """process + thread limit (the cgroup's; RLIMIT_NPROC of the program's uid without one)"""
    work_size: str = "256m"
    """size of the /work tmpfs"""
    tmp_size: str = "64m"
    """size of the /tmp tmpfs"""
    start_timeout_s: float = Field(30.0, gt=0)
    """how long the executor may take to start"""
    limits: CallLimits = CallLimits()
    """default per-call limits"""
    cgroup: bool = True
    """limit memory and pids by a cgroup per sandbox; False: rlimits only, as on a host where none can be made"""
    user_namespace: bool = False
    """map one uid in a user namespace even when run as root, as an unprivileged user must (no second uid: programs
    run as the executor's)"""


# -- the host: what bubblewrap can do here ---------------------------------------------------


@dataclass(frozen=True)
class Host:
    """What this host gives bubblewrap sandboxes, found once per process (`host()`)."""

    bwrap: str
    privileged: bool
    """root without a user namespace: programs run as nobody, apart from the executor"""
    cgroup: str | None
    """"v1" or "v2": limits by a cgroup per sandbox; None: by rlimits"""
    cgroup_parents: dict[str, Path]
    """controller -> the folder each sandbox's cgroup is made in (v2: one, under "unified")"""
    no_cgroup: str
    """why there is no cgroup (empty when there is one)"""

    def describe(self, rootfs: Path | None) -> str:
        """The start-up line."""
        who = (
            "as root: programs run as nobody, apart from the executor"
            if self.privileged
            else "in a user namespace of one uid: programs run as the executor's uid and could signal it (no "
            "privilege separation; run as root for it)"
        )
        limits = (
            f"cgroup {self.cgroup} limits (memory, pids, cpu)"
            if self.cgroup
            else f"NO cgroup ({self.no_cgroup}): rlimits per call instead, so a memory bomb ends `error`, not `oom`"
        )
        root = f"the image's root filesystem {rootfs}" if rootfs else "the host's /usr and /lib*, a generated /etc"
        return f"bwrap sandboxes {who}; {limits}; root: {root}"


def _cgroup_mounts() -> tuple[dict[str, Path], Path | None]:
    """v1 controller -> its mount point, and the v2 mount point (None if none), from /proc/self/mountinfo."""
    v1: dict[str, Path] = {}
    v2 = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, options = [*right.split(), "", ""][:3]
        mount_point = Path(left.split()[4])
        if fstype == "cgroup2":
            v2 = mount_point
        elif fstype == "cgroup":
            for option in options.split(","):
                if option in ("memory", "pids", "cpu"):
                    v1[option] = mount_point
    return v1, v2


def _own_cgroups() -> dict[str, str]:
    """controller ("" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            own[c] = path
    return own


def _find_cgroups(enabled: bool) -> tuple[str | None, dict[str, Path], str]:
    """(version, controller -> parent folder, why none). Each sandbox's cgroup goes under this process's own, so a
    limit the run is under (a container's, a job's) holds its sandboxes too."""
    if not enabled:
        return None, {}, "sandbox cgroups turned off (cgroup: false)"
    try:
        v1, v2 = _cgroup_mounts()
        own = _own_cgroups()
    except OSError as e:
        return None, {}, f"cannot read this process's cgroups ({e})"
    if "memory" in v1 and "pids" in v1:
        parents = {c: v1[c] / own.get(c, "/").lstrip("/") for c in ("memory", "pids", "cpu") if c in v1}
        bad = [str(p) for p in parents.values() if not os.access(p, os.W_OK)]
        if bad:
            return None, {}, f"cgroup v1 folders not writable: {', '.join(bad)}"
        return "v1", parents, ""
    if v2 is None:
        return None, {}, "no memory and pids cgroup controllers mounted"
    parent = v2 / own.get("", "/").lstrip("/")
    try:
        available = set((parent / "cgroup.controllers").read_text().split())
        if not {"memory", "pids"} <= available:
            return None, {}, f"cgroup v2 at {parent} lacks the memory or pids controller (has {sorted(available)})"
        enabled_now = set((parent / "cgroup.subtree_control").read_text().split())
        wanted = {"memory", "pids", "cpu"} & available
        if wanted - enabled_now:
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted - enabled_now)))
    except OSError as e:
        # EBUSY: this process's own cgroup holds processes, and v2 gives controllers to the children of a cgroup
        # with none (a container's root cgroup with its processes in it, unless the container is given its own)
        return None, {}, f"cannot give sandboxes cgroups under {parent} ({e.strerror or e})"
    return "v2", {"": parent}, ""


@cache
def host(cgroup: bool = True, user_namespace: bool = False) -> Host:
    """What bubblewrap sandboxes get on this host; SandboxError in one line when they cannot run here."""
    if why := unavailable():
        raise SandboxError(why)
    version, parents, why_not = _find_cgroups(cgroup)
    return Host(shutil.which("bwrap") or "bwrap", os.geteuid() == 0 and not user_namespace, version, parents, why_not)


@cache
def unavailable() -> str | None:
    """Why bubblewrap sandboxes cannot run on this host, in one line (missing binary, namespaces refused), or None."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (no `bwrap` on PATH): `apt-get install bubblewrap` or scripts/setup.sh"
    probe = [bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--", "true"]
    if os.geteuid() != 0:
        probe.insert(1, "--unshare-user")
    # A host that refuses the namespaces refuses them every time; the answer is kept for the process (@cache), so
    # one failed probe of a busy host (the suite saw one, beside Docker making containers) is tried again first.
    for _ in range(3):
        try:
            proc = subprocess.run(probe, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"bubblewrap cannot run: {e}"
            continue
        if proc.returncode == 0:
            return None
        said = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        why = f"bubblewrap's namespaces are refused on this host: {said}"
    return why


# -- a sandbox's cgroup ------------------------------------------------------------------------


class Cgroup:
    """One sandbox's cgroup folders (one per v1 controller, or one v2 folder)."""

    def __init__(self, version: str, dirs: dict[str, Path]):
        self.version = version
        self.dirs = dirs

    @classmethod
    def create(cls, h: Host, name: str, cfg: BwrapSandboxConfig) -> Cgroup:
        memory = parse_bytes(cfg.memory)
        made: dict[str, Path] = {}
        try:
            for controller, parent in h.cgroup_parents.items():
                d = parent / name
                d.mkdir()
                made[controller] = d
            group = cls(h.cgroup or "", made)
            group._limit(memory, cfg.pids, cfg.cpus)
        except OSError as e:
            cls(h.cgroup or "", made).remove()
            raise SandboxError(f"could not make the sandbox's cgroup {name}: {e}") from e
        return group

    def _limit(self, memory: int, pids: int, cpus: float) -> None:
        if self.version == "v2":
            d = self.dirs[""]
            (d / "memory.max").write_text(str(memory))
            with contextlib.suppress(FileNotFoundError):  # no swap accounting: no swap to limit
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(pids))
            with contextlib.suppress(FileNotFoundError):
                (d / "cpu.max").write_text(f"{int(cpus * 100_000)} 100000")
            return
        mem = self.dirs["memory"]
        (mem / "memory.limit_in_bytes").write_text(str(memory))
        with contextlib.suppress(FileNotFoundError):  # memsw: swap accounting, not on every host
            (mem / "memory.memsw.limit_in_bytes").write_text(str(memory))
        (self.dirs["pids"] / "pids.max").write_text(str(pids))
        if "cpu" in self.dirs:
            period = int((self.dirs["cpu"] / "cpu.cfs_period_us").read_text())
            (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))

    def record(self) -> dict:
        return {"version": self.version, "dirs": {c: str(d) for c, d in self.dirs.items()}}

    @classmethod
    def from_record(cls, record: dict, name: str) -> Cgroup:
        """The cgroup an owner.json names, for the sandbox `name`: only folders of that name under /sys/fs/cgroup
        (ValueError otherwise), since removing a cgroup kills every process in it and the record is read from disk."""
        dirs = {c: Path(d) for c, d in record["dirs"].items()}
        for d in dirs.values():
            if d.name != name or CGROUP_ROOT not in d.resolve().parents:
                raise ValueError(f"{d} is not the cgroup of the sandbox {name}")
        return cls(record["version"], dirs)

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    @property
    def memory_dir(self) -> tuple[Path, str]:
        """(folder, where the sandbox sees it): where the executor reads its OOM-kill counter, as in a container."""
        if self.version == "v2":
            return self.dirs[""], "/sys/fs/cgroup"
        return self.dirs["memory"], "/sys/fs/cgroup/memory"

    def pids(self) -> set[int]:
        found: set[int] = set()
        for f in self.procs_files:
            with contextlib.suppress(OSError, ValueError):
                found |= {int(x) for x in Path(f).read_text().split()}
        return found

    def remove(self, timeout_s: float = 10.0) -> None:
        """SIGKILL everything in it until it is empty, then remove its folders."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
        for d in self.dirs.values():
            for _ in range(200):  # a killed process leaves its cgroup a moment after its signal
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


# -- no new user namespace, no keyrings ---------------------------------------------------------

# seccomp's classic BPF over struct seccomp_data: nr at offset 0, arch at 4, args[0]'s low 32 bits at 16
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
CLONE_NEWUSER = 0x10000000
# per machine: (AUDIT_ARCH, unshare, clone, clone3, x32's bit or 0, (add_key, request_key, keyctl)) of the native ABI
# and of the 32-bit one it runs
_ABIS = {
    "x86_64": [
        (0xC000003E, 272, 56, 435, 0x40000000, (248, 249, 250)),
        (0x40000003, 310, 120, 435, 0, (286, 287, 288)),
    ],
    "aarch64": [(0xC00000B7, 97, 220, 435, 0, (217, 218, 219)), (0x40000028, 337, 120, 435, 0, (309, 310, 311))],
}


@cache
def seccomp_filter() -> bytes | None:
    """A seccomp program (cBPF, for bubblewrap's --seccomp) that refuses a new user namespace and the keyrings: unshare
    or clone with CLONE_NEWUSER gets EPERM, clone3 (whose flags sit in memory, out of the filter's reach) ENOSYS,
    add_key, request_key and keyctl EPERM, any other syscall passes; an ABI it does not know kills the process. None
    on a machine it has no syscall numbers for."""
    abis = _ABIS.get(platform.machine())
    if abis is None:
        return None
    code = [(_LD, 0, 0, 4)]  # the arch
    for arch, unshare, clone, clone3, x32, keyrings in abis:
        block = [(_LD, 0, 0, 0)]  # the syscall number
        if x32:  # x32 numbers on the native arch: none is needed, none passes
            block += [(_JGE, 0, 1, x32), (_RET, 0, 0, _ERRNO | errno.ENOSYS)]
        for nr in keyrings:
            block += [(_JEQ, 0, 1, nr), (_RET, 0, 0, _ERRNO | errno.EPERM)]
        block += [
            (_JEQ, 0, 1, clone3),
            (_RET, 0, 0, _ERRNO | errno.ENOSYS),
            (_JEQ, 1, 0, unshare),
            (_JEQ, 0, 3, clone),
            (_LD, 0, 0, 16),  # the flags: unshare's and clone's first argument
            (_JSET, 0, 1, CLONE_NEWUSER),
            (_RET, 0, 0, _ERRNO | errno.EPERM),
            (_RET, 0, 0, _ALLOW),
        ]
        code += [(_JEQ, 0, len(block), arch), *block]  # another arch: on to the next block, the arch still loaded
    code.append((_RET, 0, 0, _KILL))
    return b"".join(struct.pack("=HBBI", *op) for op in code)


@contextlib.contextmanager
def _seccomp() -> Iterator[tuple[list[str], tuple[int, ...]]]:
    """A bubblewrap's arguments that load `seccomp_filter`, and the file descriptor they name, to pass to it (read by
    bubblewrap at its start, closed here after the block). Unprivileged too: a user namespace keeps the keyrings
    of the process that made it."""
    program = seccomp_filter()
    if program is None:
        yield [], ()
        return
    fd = os.memfd_create("agentrl-seccomp")  # each bubblewrap its own: it reads the program to the end
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
        yield ["--seccomp", str(fd)], (fd,)
    finally:
        os.close(fd)


# -- the sandbox -------------------------------------------------------------------------------


def _generated_etc() -> Path:
    """A minimal /etc for host-rooted sandboxes (never the host's own), named by its content: made once per runtime
    folder (looked for at each start: the folder follows TMPDIR, which may change under a process)."""
    d = runtime_dir() / f"etc-{hashlib.sha256(json.dumps(ETC, sort_keys=True).encode()).hexdigest()[:12]}"
    if not d.is_dir():
        staging = Path(tempfile.mkdtemp(dir=runtime_dir()))
        for name, text in ETC.items():
            (staging / name).write_text(text)
        staging.chmod(0o755)
        with contextlib.suppress(OSError):  # another process made it first
            staging.rename(d)
        shutil.rmtree(staging, ignore_errors=True)
    return d


def resolve_rootfs(cfg: BwrapSandboxConfig) -> Path | None:
    """The root filesystem to bind, or None for the host's."""
    if cfg.rootfs == "host":
        return None
    if cfg.rootfs is not None:
        if not (cfg.rootfs / "usr").is_dir():
            raise SandboxError(f"bwrap rootfs {cfg.rootfs} has no usr/: not a root filesystem")
        return cfg.rootfs
    exported = rootfs_dir()
    return exported if exported.is_dir() else None


def _root_args(rootfs: Path | None) -> tuple[str, ...]:
    """The read-only root: a rootfs bound whole where it has every folder the sandbox mounts over (`SANDBOX_MOUNTS`:
    agentrl's exported and unpacked roots do); else a tmpfs with the rootfs's entries, or the host's system folders
    and a generated /etc, bound on it (a mount per entry: a fifth of bubblewrap's start-up more)."""
    return _root_binds(rootfs, _generated_etc() if rootfs is None else None)


@cache
def _root_binds(rootfs: Path | None, etc: Path | None) -> tuple[str, ...]:
    """`_root_args`, once per root and process, off each sandbox's start (a root's top-level entries do not change
    under a run)."""
    if rootfs is not None and all((rootfs / n).is_dir() and not (rootfs / n).is_symlink() for n in SANDBOX_MOUNTS):
        base, names, args = rootfs, [], ["--ro-bind", str(rootfs), "/"]
    elif rootfs is None:
        base, names = Path("/"), [n for n in HOST_DIRS if Path("/", n).exists()]
        args = ["--tmpfs", "/", "--ro-bind", str(etc), "/etc"]
    else:
        base, names = rootfs, sorted(p.name for p in rootfs.iterdir() if p.name not in SANDBOX_MOUNTS)
        args = ["--tmpfs", "/"]
    for name in names:
        path = base / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), f"/{name}"]
        elif path.is_dir():
            args += ["--ro-bind", str(path), f"/{name}"]
    python = next((p for p in ("usr/bin/python3", "usr/local/bin/python3") if (base / p).exists()), None)
    if python is None:
        raise SandboxError(f"no python3 in {base}/usr for the sandbox's executor")
    return tuple(args)


@cache
def brings_pytest(rootfs: Path) -> bool:
    """Whether a root filesystem has test tools of its own (an instance's image; the agentrl image's /opt/agentrl/site):
    then they are the sandbox's, as in its container, where the image's come first on the path."""
    places = (
        "usr/lib/python3*/*-packages/pytest",
        "usr/local/lib/python3*/*-packages/pytest",
        "opt/agentrl/site/pytest",
    )
    return any(next(rootfs.glob(p), None) is not None for p in places)


def _executor_args(rootfs: Path | None, bytecode: Path | None) -> list[str]:
    # a tmpfs (the root may be read-only already), 0755: else 0700, and the session (run as nobody) could not start
    args = ["--perms", "0755", "--size", str(1 << 20), "--tmpfs", "/agentrl"]
    for name in ("main.py", "executor.py"):
        args += ["--ro-bind", str(sandboxes_dir() / "python" / name), f"/agentrl/{name}"]
    if bytecode is not None:
        args += ["--ro-bind", str(bytecode), "/agentrl/__pycache__"]
    site = site_dir()
    # the host's root: always ours (whatever pytest the host has is not the sandbox image's)
    if site.is_dir() and (rootfs is None or not brings_pytest(rootfs)):
        args += ["--ro-bind", str(site), "/agentrl/site", "--setenv", "AGENTRL_SITE", "/agentrl/site"]
    return args


# Checked against the source's hash at each import (not its mtime, which a checkout does not keep): a stale file is
# read as absent, and the executor is compiled from source as before.
COMPILE = (
    "import py_compile as c; "
    "c.compile('/agentrl/executor.py', doraise=True, invalidation_mode=c.PycInvalidationMode.CHECKED_HASH)"
)


@cache
def _executor_bytecode(bwrap: str, privileged: bool, rootfs: Path | None) -> Path | None:
    """A __pycache__ folder with the executor's bytecode for the root's python3, bound in beside it (see main.py): a
    fifth of a cold start is compiling it. Compiled once per executor and root, by the root's python3 (its bytecode
    format is its own), in a sandbox as locked down as the programs' (an instance image's python3 is its author's
    code: run on the host, it would be root there), into a folder of that root's alone (so a root can plant
    bytecode only for its own executor, which runs its own python3 anyway). None, with a warning, where it cannot
    be made."""
    source = sandboxes_dir() / "python" / "executor.py"
    version = python_version(rootfs or Path("/"))
    root = "host" if rootfs is None else hashlib.sha256(str(rootfs.resolve()).encode()).hexdigest()[:12]
    folder = cache_dir() / "executor" / file_sha256(source)[:12] / root / "__pycache__"
    if version is not None and (folder / f"executor.cpython-{version[0]}{version[1]}.pyc").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    argv = [bwrap, *NAMESPACES, "--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", PATH]
    argv += ["--cap-drop", "ALL"] if os.geteuid() == 0 else []
    argv += [] if privileged else ["--unshare-user", "--disable-userns"]
    argv += [*_root_args(rootfs), "--dev", "/dev", "--proc", "/proc", "--perms", "0755", "--tmpfs", "/agentrl"]
    argv += ["--ro-bind", str(source), "/agentrl/executor.py", "--bind", str(folder), "/agentrl/__pycache__"]
    with _seccomp() as (seccomp, fds):
        done = subprocess.run(
            [*argv, *seccomp, "--", "python3", "-c", COMPILE], capture_output=True, text=True, timeout=60, pass_fds=fds
        )
    if done.returncode != 0:
        log.warning("bwrap: could not compile the executor (it starts from source): %s", done.stderr.strip()[-500:])
        return None
    return folder


class BwrapSandbox(ExecutorSandbox):
    """One bubblewrap sandbox. Create with `await BwrapSandbox.create(cfg)`; usually via SandboxPool."""

    def __init__(self, proc: asyncio.subprocess.Process, tree: Path, cgroup: Cgroup | None, limits: CallLimits):
        super().__init__(tree / "socket" / "exec.sock", limits, tree.name)
        self.proc = proc
        self.tree = tree
        self.cgroup = cgroup
        self._closed = False

    @classmethod
    async def create(cls, cfg: BwrapSandboxConfig | None = None) -> BwrapSandbox:
        cfg = cfg or BwrapSandboxConfig()
        h = host(cfg.cgroup, cfg.user_namespace)
        _announce(h, cfg)
        install()
        rootfs = resolve_rootfs(cfg)
        bytecode = _executor_bytecode(h.bwrap, h.privileged, rootfs)  # once per root and process, as install()
        name = f"{TREE_PREFIX}{secrets.token_hex(6)}"
        tree = runtime_dir() / name
        tree.mkdir(mode=0o700)
        # the sandbox sees this subfolder alone: owner.json (which names the cgroups whose processes are killed at
        # removal) and bubblewrap's stderr stay out of its reach, whichever uid it runs as
        (tree / "socket").mkdir(mode=0o700)
        cgroup = None
        try:
            if h.cgroup:
                cgroup = await asyncio.to_thread(Cgroup.create, h, name, cfg)
            owner = {**reaper.owner_labels(), "cgroup": cgroup.record() if cgroup else None}
            (tree / "owner.json").write_text(json.dumps(owner))
            # sh puts itself in the cgroup, then becomes bwrap: everything the sandbox starts is in it from the
            # first instruction (a preexec_fn would be unsafe in a threaded process)
            enter = "".join(f"echo $$ > {shlex.quote(f)} || exit 125; " for f in (cgroup.procs_files if cgroup else []))
            # stderr: a file, not a pipe nobody reads once it runs
            with _seccomp() as (seccomp, fds), (tree / "stderr").open("wb") as stderr:
                proc, ready = await start_executor(
                    "/bin/sh",
                    "-c",
                    f'{enter}exec "$@"',
                    "sh",
                    *cls._argv(h, cfg, rootfs, bytecode, tree, cgroup, seccomp),
                    stdin=subprocess.DEVNULL,
                    stdout=stderr,
                    stderr=stderr,
                    pass_fds=fds,
                )
        except BaseException:
            await asyncio.to_thread(_remove_tree, tree, cgroup)
            raise
        limits = cfg.limits
        if cgroup is None:  # the per-call rlimits stand in for the cgroup's limits
            limits = limits.model_copy(
                update={
                    "memory_bytes": limits.memory_bytes or parse_bytes(cfg.memory),
                    "max_processes": limits.max_processes or cfg.pids,
                }
            )
        sandbox = cls(proc, tree, cgroup, limits)
        try:
            await sandbox._wait_ready(ready, cfg.start_timeout_s)
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    @staticmethod
    def _argv(
        h: Host,
        cfg: BwrapSandboxConfig,
        rootfs: Path | None,
        bytecode: Path | None,
        tree: Path,
        cgroup: Cgroup | None,
        seccomp: list[str],
    ) -> list[str]:
        argv = [h.bwrap, *NAMESPACES, "--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"]
        if not h.privileged:
            argv += ["--unshare-user", "--disable-userns"]
        argv += _root_args(rootfs)
        argv += ["--dev", "/dev", "--mqueue", "/dev/mqueue", "--proc", "/proc"]
        argv += ["--perms", "1777", "--size", str(64 << 20), "--tmpfs", "/dev/shm"]  # as Docker's shm_size default
        argv += ["--perms", "1777", "--size", str(parse_bytes(cfg.tmp_size)), "--tmpfs", "/tmp"]
        # /work: the programs' (nobody's) home; tmpfs has no uid= option here, so it is open to all, and nobody else
        # is in the sandbox but the executor
        argv += ["--perms", "0777", "--size", str(parse_bytes(cfg.work_size)), "--tmpfs", "/work"]
        argv += ["--perms", "0755", "--size", str(16 << 20), "--tmpfs", "/code"]  # executor-only
        argv += _executor_args(rootfs, bytecode)
        argv += [
            "--perms",
            "0755",
            "--size",
            str(1 << 20),
            "--tmpfs",
            "/run",
            "--bind",
            str(tree / "socket"),
            SOCKET_IN_SANDBOX,
        ]
        if cgroup is not None:
            where, inside = cgroup.memory_dir
            argv += ["--tmpfs", "/sys", "--ro-bind", str(where), inside, "--remount-ro", "/sys"]
        argv += ["--remount-ro", "/", "--chdir", "/work"]
        argv += ["--setenv", "PATH", PATH, "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
        argv += seccomp  # no new user namespace, no keyrings (`_seccomp`)
        if h.privileged:
            argv += ["--cap-drop", "ALL"] + [a for c in ("SETUID", "SETGID", "KILL") for a in ("--cap-add", f"CAP_{c}")]
        elif os.geteuid() == 0:  # root asked for a user namespace: none of root's capabilities in it either
            argv += ["--cap-drop", "ALL"]
        argv += ["--", "python3", "/agentrl/main.py", "--socket", f"{SOCKET_IN_SANDBOX}/exec.sock"]
        if h.privileged:
            argv += ["--user", f"{NOBODY[0]}:{NOBODY[1]}"]
        return argv

    async def _wait_ready(self, fd: int, timeout_s: float) -> None:
        try:
            ready = await executor_ready(fd, timeout_s)
        except TimeoutError:
            raise SandboxError(f"{self.name}: executor did not start within {timeout_s}s") from None
        if not ready:
            with contextlib.suppress(TimeoutError):  # the pipe closes a moment before bwrap exits
                await asyncio.wait_for(self.proc.wait(), 1.0)
            said = (self.tree / "stderr").read_text(errors="replace").strip()[-2000:]
            raise SandboxError(f"{self.name}: bubblewrap exited at start-up ({self.proc.returncode}): {said}")

    async def _diagnose(self, error: BaseException) -> str:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 0.5)  # the socket can close a moment before bwrap exits
        if self.proc.returncode is not None:
            return f"sandbox exited (bubblewrap exit status {self.proc.returncode})"
        return f"executor unreachable in a running sandbox ({type(error).__name__}: {error})"

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()  # bwrap's child dies with it (--die-with-parent), and the pid namespace with that
        await self.proc.wait()
        await asyncio.to_thread(_remove_tree, self.tree, self.cgroup)


def _remove_tree(tree: Path, cgroup: Cgroup | None) -> None:
    if cgroup is not None:
        cgroup.remove()
    shutil.rmtree(tree, ignore_errors=True)


# -- owners and orphans --------------------------------------------------------------------------

_install_lock = threading.Lock()
_installed = False
_announced: set[tuple] = set()


def _announce(h: Host, cfg: BwrapSandboxConfig) -> None:
    """The start-up line, once per process and setting: a warning when the sandbox is less than Docker's."""
    key = (h.privileged, h.cgroup, cfg.rootfs)
    if key in _announced:
        return
    _announced.add(key)
    line = h.describe(resolve_rootfs(cfg))
    (log.info if h.privileged and h.cgroup else log.warning)("%s", line)


def collect_orphans(*, everything: bool = False) -> list[str]:
    """Remove the bwrap sandbox trees (their processes, cgroups and folders) whose owner process is gone, or all."""
    removed = []
    try:
        trees = [p for p in runtime_dir().iterdir() if p.name.startswith(TREE_PREFIX)]
    except OSError:
        return removed
    for tree in trees:
        try:
            owner = json.loads((tree / "owner.json").read_text())
        except (OSError, ValueError):
            owner = None  # a tree whose owner died before writing it, or one being made: judged by its age
            if time.time() - tree.stat().st_mtime < 60:
                continue
        if everything or owner is None or not reaper.owner_alive(owner):
            _remove_tree(tree, _owned_cgroup(owner, tree))
            removed.append(tree.name)
    return removed


def _owned_cgroup(owner: dict | None, tree: Path) -> Cgroup | None:
    """The cgroup a tree's owner.json names, if it is that sandbox's (else None, with a warning: its processes are
    not killed on that record's word)."""
    if not owner or not owner.get("cgroup"):
        return None
    try:
        return Cgroup.from_record(owner["cgroup"], tree.name)
    except (KeyError, TypeError, ValueError, OSError) as e:
        log.warning("bwrap: %s names a cgroup that is not its own (%s): left alone", tree / "owner.json", e)
        return None


def remove_session(session: str = reaper.SESSION_ID) -> int:
    """Remove this session's trees (at exit: sandboxes nobody closed)."""
    n = 0
    for tree in runtime_dir().glob(f"{TREE_PREFIX}*"):
        with contextlib.suppress(OSError, ValueError):
            owner = json.loads((tree / "owner.json").read_text())
            if owner.get(reaper.SESSION_LABEL) == session:
                _remove_tree(tree, _owned_cgroup(owner, tree))
                n += 1
    return n


def install() -> None:
    """Once per process: remove orphaned trees now."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
    orphans = collect_orphans()
    if orphans:
        log.warning("removed %d orphaned bwrap sandbox(es): %s", len(orphans), ", ".join(orphans))
    atexit.register(remove_session)
