#!/usr/bin/env python3
"""agentrl sandbox executor: the long-lived program inside every sandbox.

Standard library only (it must run on any base image with python3 >= 3.9).
It serves HTTP/1.0 over a Unix socket, one request at a time, one connection
per request, JSON in and out:

    GET    /health         -> {"ok": true, "session": bool}
    POST   /run            {"argv" | "code", "timeout_s", ...} -> result
    POST   /session        {"code", "timeout_s", ...} -> result; state persists
    DELETE /session        -> stops the persistent interpreter
    POST   /recycle        -> {"ok": bool, "removed": n, "reason": str}: as new, or why not
    PUT    /files?path=P   body = raw bytes, written as the sandbox user
    GET    /files?path=P   -> raw bytes; both for a regular file only (see open_regular)

A result is {"status", "exit_code", "signal", "stdout", "stderr", "truncated",
"wall_s", "cpu_s", "swept", "session_reset"} with status one of ok, error,
timeout, oom, output_limit, killed.

Privilege model (Docker). The executor runs as root inside the container with
only CAP_SETUID, CAP_SETGID and CAP_KILL; every program it starts runs as the
unprivileged sandbox user with no capabilities. So nothing an agent runs can
signal, ptrace, unlink or talk to the executor (connections from the sandbox
uid are refused by peer credentials). Otherwise an agent could kill its own
sandbox and turn a wrong answer into an "infrastructure failure", which the
trainer leaves out of the loss.

Python source (`code`) runs in a spare fork of an already-started interpreter
(see Spare), not in a new python3: that start-up would cost more than the rest
of the call. The spares are forked from a zygote, the executor started afresh,
which never serves a request: so no program inherits what the executor's
memory kept of earlier calls (see Zygote).

Every call ends with a sweep: all descendants of the executor except the
persistent interpreter are SIGKILLed until none is left. The executor is a
child subreaper, so a grandchild that setsid()-ed and double-forked away is
still its descendant and dies with the call. The persistent interpreter is
stopped (SIGSTOP) between its cells, so that nothing a cell started runs on
through later requests.

In local mode (LocalSandbox: no --user) the same program runs on the host as
the calling user. That is NOT isolation; it only applies limits. There, with no
pid namespace or cgroup to end the sandbox as a whole, a warden (--owner) stays
above the executor so that nothing outlives the owner process or the executor
(see become_warden).

It is started as `python3 main.py ARGS` (main.py beside it), so that this file
loads as a module, from its bytecode when that is at hand.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import gc
import math
import os
import resource
import select
import selectors
import signal
import socket
import stat
import struct
import sys
import time

# Imported where used, and by Server after its first answer (overlapping the zygote's imports for the first spare),
# not at start: what the executor imports at start is only what answering a health probe needs, as that first answer
# ends a sandbox's cold start (json, with re, was a tenth of it).
LATER = ("json",)
# What a sandbox starts: main.py, beside this file (see its docstring); the zygote and the session interpreter too.
ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "main.py")
# bwrap sandboxes: the test tools (requirements.txt), bound in from the host; an image has them on its path already
SITE = os.environ.get("AGENTRL_SITE")
if SITE and SITE not in sys.path:
    sys.path.append(SITE)
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
READ_CHUNK = 1 << 16
MAX_FILE_READ = 64 << 20
DEFAULTS = {
    "timeout_s": 10.0,
    "cpu_s": None,  # None: same as timeout_s
    "max_output_bytes": 1 << 20,  # stdout + stderr together
    "max_file_bytes": 64 << 20,  # RLIMIT_FSIZE for each file the program writes
    "max_open_files": 1024,
    "memory_bytes": None,  # RLIMIT_AS; the container's cgroup is the real limit
    "max_processes": None,  # RLIMIT_NPROC of the program's uid; a cgroup's pids limit is the real one
    "stdin": None,
    "env": {},
    "cwd": ".",
}


class BadRequest(Exception):
    pass


# ---------------------------------------------------------------- processes


class Executor:
    def __init__(self, workdir: str, tmpdir: str, codedir: str, user: tuple[int, int] | None):
        self.workdir = os.path.realpath(workdir)
        self.tmpdir = os.path.realpath(tmpdir)
        # Where `code` requests are written: only the executor can write there, so a
        # program that filled /work or /tmp cannot make the next call fail to start.
        self.codedir = os.path.realpath(codedir)
        self.user = user
        self.session: Session | None = None
        self.spare: Spare | None = None
        self.zygote: Zygote | None = None
        self.as_new = {place: place_state(place) for place in self.places()}  # what a recycle restores

    def places(self) -> list[str]:
        """The folders the sandbox user can write in: what a recycle empties."""
        places = [self.workdir, self.tmpdir] + (["/dev/shm", "/dev/mqueue"] if self.user is not None else [])
        return [p for p in places if os.path.isdir(p)]

    def _enter_call(self, req: dict, cpu_s: int | None) -> None:
        """In the new child: limits, then drop to the sandbox user for good."""
        if cpu_s is not None:  # SIGXCPU at the soft limit, SIGKILL a second later
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (req["max_file_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (req["max_open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if req["memory_bytes"]:
            resource.setrlimit(resource.RLIMIT_AS, (req["memory_bytes"],) * 2)
        if req["max_processes"]:
            resource.setrlimit(resource.RLIMIT_NPROC, (req["max_processes"],) * 2)
        try:  # make the program, not the executor, the OOM killer's first choice
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        if self.user is not None:
            uid, gid = self.user
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)

    def _env(self, extra: dict) -> dict:
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": self.workdir,
            "TMPDIR": self.tmpdir,
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        if SITE:
            env["PYTHONPATH"] = SITE
        env.update({str(k): str(v) for k, v in extra.items()})
        return env

    def _spawn(self, argv: list[str], req: dict, cpu_s: int | None, *, stdio=None, pass_fds=()):
        """fork + exec argv as a call's program; stdio: (stdin, stdout, stderr) fds, else pipes."""
        import subprocess

        stdin, stdout, stderr = stdio or (subprocess.DEVNULL, subprocess.PIPE, subprocess.PIPE)
        return subprocess.Popen(
            argv,
            cwd=self.resolve(req["cwd"]),
            env=self._env(req["env"]),
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            pass_fds=pass_fds,
            start_new_session=True,
            preexec_fn=lambda: self._enter_call(req, cpu_s),
        )

    def run(self, req: dict) -> dict:
        if ("code" in req) == ("argv" in req):
            raise BadRequest("give exactly one of 'argv' (a command) or 'code' (Python source)")
        argv = req.get("argv")
        if argv is not None and not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise BadRequest("'argv' must be a non-empty list of strings")
        # exec() and chdir() refuse a NUL byte (a ValueError, which would answer 500: the sandbox taken for failed)
        env = req["env"]
        if any("\0" in str(s) for s in [*(argv or ()), req["cwd"], *env, *env.values()]):
            raise BadRequest("argv, cwd and env cannot hold a NUL byte: no program can be given one")
        oom_before = oom_kills()
        t0 = time.monotonic()
        if "code" in req:
            path = os.path.join(self.codedir, "snippet.py")
            with open(path, "w") as f:  # for tracebacks, which read source lines from it
                f.write(req["code"])
            os.chmod(path, 0o644)
            spare = self.take_spare()
            spare.start(path, req, self.resolve(req["cwd"]), self._env(req["env"]))
            pid, stdin_fd, out_fd, err_fd = spare.pid, spare.stdin_w, spare.out_r, spare.err_r
        else:
            child, (stdin_fd, out_fd, err_fd) = std_pipes()
            try:
                proc = self._spawn(argv, req, cpu_limit(req), stdio=child)
            except OSError as e:
                for fd in (stdin_fd, out_fd, err_fd):
                    os.close(fd)
                if e.filename is None:  # a fork or pipe of ours failed, not the program: the sandbox's error
                    raise
                # exec() or chdir() refused the program or its cwd (Popen names which): missing, not executable, an
                # argument over 128 KiB (an agent's long command), a name too long. The caller's error, not the
                # sandbox's, which an agent could otherwise fake to have its episode left out of the loss.
                return result("error", 127, None, b"", str(e).encode(), False, 0.0, 0.0)
            finally:
                for fd in child:
                    os.close(fd)
            # We wait for it ourselves (wait4, for its rusage); Popen must never poll,
            # and so never reap, a pid the kernel may since have given to another child.
            proc.returncode = 0
            pid = proc.pid
        pidfd = os.pidfd_open(pid)
        feed_stdin(stdin_fd, (req["stdin"] or "").encode())  # no stdin: EOF at once
        cap = Capture(out_fd, err_fd, req["max_output_bytes"])
        outcome = cap.pump(pidfd, t0 + req["timeout_s"])
        if outcome != "done":
            kill_group(pid)
        _, wstatus, rusage = os.wait4(pid, 0)
        wall = time.monotonic() - t0
        os.close(pidfd)
        swept = self.sweep()
        cap.drain(blocking=True)
        os.close(out_fd)
        os.close(err_fd)
        cpu = rusage.ru_utime + rusage.ru_stime
        code = os.waitstatus_to_exitcode(wstatus)
        status, exit_code, sig = classify(outcome, code, oom_kills() > oom_before)
        out, err = cap.text()
        return result(status, exit_code, sig, out, err, cap.truncated, wall, cpu, swept)

    def run_session(self, req: dict) -> dict:
        if "code" not in req:
            raise BadRequest("/session needs 'code'")
        reset = False
        if self.session is None or not self.session.alive():
            reset = self.session is not None
            self.session = Session.start(self, req)
        self.session.thaw()
        r = self.session.run_cell(req)
        if r.pop("died"):
            self.session.stop()
            self.session = None
            reset = True
        else:
            self.session.freeze()
        r["swept"] = self.sweep()
        if self.session is not None:
            self.session.cap.drain(blocking=False)
        r["session_reset"] = reset
        return r

    def stop_session(self) -> None:
        if self.session is not None:
            self.session.stop()
            self.session = None
        self.sweep()

    def take_spare(self) -> Spare:
        spare, self.spare = self.spare, None
        return spare if spare is not None and spare.alive() else self.new_spare()

    def ensure_spare(self) -> None:
        """Between calls: have a forked child ready for the next Python source."""
        if self.spare is None:
            self.spare = self.new_spare()

    def new_spare(self) -> Spare:
        if self.zygote is None or not self.zygote.alive():
            self.zygote = Zygote.start()
        return self.zygote.spare()

    def sweep(self, *, everything: bool = False) -> int:
        """SIGKILL every descendant but the zygote, the session interpreter and the spare; reap; repeat.

        `everything`: the session and the spare too; the zygote, which runs nothing of the
        sandbox's, stays (see Zygote) unless the executor itself is stopping.
        """
        keep = {self.zygote.proc.pid} if self.zygote is not None else set()
        if not everything:
            keep |= {p.pid for p in (self.spare, self.session and self.session.proc) if p is not None}
        killed = kill_descendants(keep, self.reap)
        if not everything and self.session is not None and self.session.alive():
            # A program runs as the session's uid and may have continued it (SIGCONT): stopped again, now that
            # nothing is left to continue it, before the host's next request (its hidden tests, a grader's call).
            self.session.freeze()
        return killed

    def recycle(self) -> dict:
        """Between episodes: return the sandbox to its state at start, or say why it cannot be.

        Every process but the executor and its zygote dies (the session and the spare too). Then, as the
        sandbox user (who owns whatever programs wrote), everything is removed from the places
        that user can write: the work and tmp dirs and, in a container, /dev/shm, /dev/mqueue
        and System V IPC objects; each place itself gets back its mode and extended attributes
        (a program may set its own folder's, any bytes). It is proven, not assumed: if any
        process of the sandbox user is left, or any of those places is not empty or not as it
        was, the answer is not ok and the host discards the container instead of reusing it.
        """
        self.stop_session()
        self.sweep(everything=True)  # the spare too: it is forked again after this request
        places = self.places()
        removed = 0
        try:
            with self.file_io():
                for place in places:
                    for entry in os.listdir(place):
                        removed += remove_tree(os.path.join(place, entry))
                    restore_place(place, self.as_new[place])
                if self.user is not None:
                    removed += remove_ipc()
        except (FileError, OSError, RecursionError) as e:
            return {"ok": False, "removed": removed, "reason": f"could not clean: {e}"}
        for entry in os.listdir(self.codedir):  # the executor's own files
            remove_tree(os.path.join(self.codedir, entry))
        left = [p for p in places if os.listdir(p)]
        if left:
            return {"ok": False, "removed": removed, "reason": f"not empty after cleaning: {left}"}
        changed = [p for p in places if place_state(p) != self.as_new[p]]
        if changed:
            return {"ok": False, "removed": removed, "reason": f"mode or attributes not as new: {changed}"}
        if self.user is not None:
            if ipc_objects():
                return {"ok": False, "removed": removed, "reason": "System V IPC objects remain"}
            alive = user_processes(self.user[0])
            if alive:
                return {"ok": False, "removed": removed, "reason": f"processes of the sandbox user remain: {alive}"}
        return {"ok": True, "removed": removed, "reason": ""}

    def reap(self) -> None:
        for pid, wstatus in exited_children():
            if self.session is not None and pid == self.session.proc.pid:
                self.session.exit_status = wstatus
            if self.spare is not None and pid == self.spare.pid:
                self.spare = None
            if self.zygote is not None and pid == self.zygote.proc.pid:
                self.zygote.proc.returncode = os.waitstatus_to_exitcode(wstatus)

    # ---------------------------------------------------------------- files

    def resolve(self, path: str) -> str:
        """A path relative to the work dir (or absolute inside it or the tmp dir)."""
        full = os.path.normpath(os.path.join(self.workdir, path))
        for root in (self.workdir, self.tmpdir):
            if full == root or full.startswith(root + os.sep):
                return full
        raise BadRequest(f"path {path!r} is outside the work dir {self.workdir}")

    def write_file(self, path: str, data: bytes) -> int:
        full = self.resolve(path)
        with self.file_io():
            os.makedirs(os.path.dirname(full), exist_ok=True)
            # Truncated only once known to be a regular file: O_TRUNC would act on what the path is before the check.
            with os.fdopen(open_regular(full, os.O_WRONLY | os.O_CREAT), "wb") as f:
                f.truncate()
                f.write(data)
        return len(data)

    def read_file(self, path: str) -> bytes:
        full = self.resolve(path)
        with self.file_io(), os.fdopen(open_regular(full, os.O_RDONLY), "rb") as f:
            data = f.read(MAX_FILE_READ + 1)
        if len(data) > MAX_FILE_READ:
            raise BadRequest(f"{path} is larger than {MAX_FILE_READ} bytes")
        return data

    @contextlib.contextmanager
    def file_io(self):
        """File I/O with the sandbox user's rights and ownership; OSError -> FileError, ValueError -> BadRequest."""
        if self.user is not None:
            os.setegid(self.user[1])
            os.seteuid(self.user[0])
        try:
            yield
        except OSError as e:
            raise FileError(e) from e
        except ValueError as e:  # a path open() refuses outright: an embedded NUL byte
            raise BadRequest(f"bad path: {e}") from e
        finally:
            if self.user is not None:
                os.seteuid(0)
                os.setegid(0)


def place_state(path: str) -> tuple[int, tuple[str, ...]]:
    """A folder's mode and the names of its extended attributes: what a program may set on the folder itself."""
    try:
        names = tuple(sorted(os.listxattr(path)))
    except OSError:  # a file system without extended attributes
        names = ()
    return stat.S_IMODE(os.stat(path).st_mode), names


def restore_place(path: str, state: tuple[int, tuple[str, ...]]) -> None:
    """The folder's mode and extended attributes back to `state` (its contents are the caller's)."""
    mode, names = state
    for name in place_state(path)[1]:
        if name not in names:
            os.removexattr(path, name)
    if stat.S_IMODE(os.stat(path).st_mode) != mode:
        os.chmod(path, mode)


# What a path may be instead of a regular file, each named in the refusal.
FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO"}
FILE_KINDS |= {stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def open_regular(full: str, flags: int) -> int:
    """An fd of the regular file at `full`, or OSError saying what else it is.

    The executor serves one request at a time, so an open() that blocks stalls the sandbox for good, and the host
    takes that for an infrastructure failure: a program must not be able to make one. So the last component is
    never followed (a link could lead to a FIFO or a device), and the open never waits (O_NONBLOCK: a FIFO with no
    other end, a device); whatever is not a regular file is then refused, before anything is read or written.
    """
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(full, flags, 0o644)
    except OSError as e:
        # ELOOP: a link (O_NOFOLLOW); ENXIO: a FIFO with no reader, or a socket; EISDIR: a directory, for writing.
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise
        mode = os.lstat(full).st_mode
        if stat.S_ISREG(mode):
            raise
    else:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return fd  # O_NONBLOCK left on: a regular file's reads and writes ignore it
        os.close(fd)
    kind = FILE_KINDS.get(stat.S_IFMT(mode), "something else")
    code = {stat.S_IFDIR: errno.EISDIR, stat.S_IFLNK: errno.ELOOP}.get(stat.S_IFMT(mode), errno.EINVAL)
    raise OSError(code, f"{full} is {kind}, not a regular file (only regular files are read or written)")


class FileError(Exception):
    """A file request failed because of the files (missing, disk full, ...): the caller's concern."""

    def __init__(self, error: OSError):
        # Without str(error)'s "[Errno N] ": the host puts the errno back (OSError(errno, this)), and said it twice.
        where = f": {error.filename!r}" if error.filename is not None else ""
        super().__init__(f"{error.strerror or error}{where}")
        self.errno = error.errno


class Spare:
    """A child forked between calls that waits for the next Python source to run.

    A new python3 costs ~17 ms of start-up per call here and a fork ~1.5 ms;
    forking ahead of time takes both off the call's path. The spare is forked by the
    zygote (so it inherits none of the executor's memory of earlier calls) and is the
    executor's child (see Zygote). It waits as root, blocked on its request pipe,
    because the call's limits are not known yet; it then drops to the sandbox user
    before running anything, so it can no more touch the executor than an exec-ed program.
    """

    def __init__(self, pid: int, req_w: int, stdin_w: int, out_r: int, err_r: int):
        self.pid, self.req_w, self.stdin_w, self.out_r, self.err_r = pid, req_w, stdin_w, out_r, err_r

    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def start(self, path: str, req: dict, cwd: str, env: dict) -> None:
        """Send the call; the child reads while we write, so any size of source fits.

        Not its stdin, which the program reads from its pipe: what a grader is sent there
        (hidden tests) must not be in the memory of the processes it forks."""
        import json  # (after start-up: see LATER)

        call = {"path": path, "req": {k: v for k, v in req.items() if k != "stdin"}, "cwd": cwd, "env": env}
        with os.fdopen(self.req_w, "wb") as f:
            f.write(json.dumps(call).encode())


def spare_main(ex: Executor, req_r: int, in_r: int, out_w: int, err_w: int) -> None:  # never returns: os._exit
    """The spare's life: wait for its call, enter it, run the source, exit."""
    import json  # (after start-up: see LATER)

    code = 127
    try:
        for fd, target in ((in_r, 0), (out_w, 1), (err_w, 2), (req_r, 3)):
            os.dup2(fd, target)
        os.closerange(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        with os.fdopen(3, "rb") as f:
            call = json.loads(f.read())
        ex._enter_call(call["req"], cpu_limit(call["req"]))
        libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # setuid cleared it
        os.chdir(call["cwd"])
        code = run_main(call["path"], call["req"]["code"], call["env"])
    except BaseException:  # report, then exit whatever happened
        with contextlib.suppress(BaseException):
            import traceback

            os.write(2, traceback.format_exc().encode())
    finally:
        os._exit(code)


class Zygote:
    """The process the spares are forked from: this file exec-ed afresh, which never serves a request.

    Forked from the executor, a spare would carry the executor's heap, where freed
    memory still holds earlier calls (a grader's hidden tests among them) for a program
    to read from /proc/self/mem. The zygote holds nothing but its start, at the cost of
    one idle interpreter per sandbox. It runs as root, like the executor, so the sandbox
    user cannot signal it; it survives `recycle`. A spare is forked through an
    intermediate that exits at once, so the spare is reparented to the executor (a
    child subreaper), which waits for it and reads its rusage as for any call; its pipes
    come back over a Unix socket (SCM_RIGHTS).
    """

    def __init__(self, proc, sock: socket.socket):
        self.proc, self.sock = proc, sock

    @classmethod
    def start(cls) -> Zygote:
        import subprocess

        ours, theirs = socket.socketpair()
        argv = [sys.executable, ENTRY, *sys.argv[1:], "--zygote", str(theirs.fileno())]
        proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        return cls(proc, ours)

    @classmethod
    def fork(cls, ex: Executor) -> Zygote:
        """At start-up, before any request: a fork of the executor is as clean as a fresh one (no call has been in its
        memory yet), one interpreter's start-up sooner: a sandbox's cold start. A zygote started later is exec-ed."""
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                keep = theirs.fileno()  # and stdio: nothing else of the executor's (its --ready-fd among them)
                os.closerange(3, keep)
                os.closerange(keep + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
                zygote_main(keep, ex)
            finally:
                os._exit(0)
        theirs.close()
        return cls(Forked(pid), ours)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spare(self) -> Spare:
        self.sock.sendall(b"s")
        msg, fds, _, _ = socket.recv_fds(self.sock, 32, 4)
        if len(fds) != 4 or not msg.isdigit():
            raise RuntimeError(f"the zygote could not fork a spare (sent {msg!r} and {len(fds)} descriptors)")
        return Spare(int(msg), *fds)


class Forked:
    """A child this process forked without exec: as much of Popen as Zygote uses."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by Executor.reap, which sets returncode
                self.returncode = -1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def zygote_main(fd: int, ex: Executor) -> None:
    """Fork a spare for every byte read on the socket, until it closes."""
    sock = socket.socket(fileno=fd)
    for name in RUNNER_MODULES:  # once here, for every spare (the executor starts without them)
        __import__(name)
    libc()  # spare_main's prctl
    gc.freeze()
    while sock.recv(1):
        req_r, req_w = os.pipe()
        (in_r, out_w, err_w), (stdin_w, out_r, err_r) = std_pipes()
        pid_r, pid_w = os.pipe()
        mid = os.fork()
        if mid == 0:
            with contextlib.suppress(BaseException):
                pid = os.fork()
                if pid == 0:
                    spare_main(ex, req_r, in_r, out_w, err_w)
                os.write(pid_w, str(pid).encode())
            os._exit(0)
        with os.fdopen(pid_r, "rb") as f:
            os.close(pid_w)
            pid = f.read()
        os.waitpid(mid, 0)  # now the spare is the executor's child
        socket.send_fds(sock, [pid], [req_w, stdin_w, out_r, err_r])
        for fd_ in (req_r, req_w, in_r, out_w, err_w, stdin_w, out_r, err_r):
            os.close(fd_)


class Session:
    """A persistent python3 (this file with --session) whose globals survive across cells.

    Cells go in on fd 3 and a one-line JSON reply per cell comes back on fd 4;
    stdout and stderr are pipes the executor reads while a cell runs.
    """

    def __init__(self, proc, ctl_w: int, reply_r: int, cap: Capture):
        self.proc, self.ctl_w, self.reply_r, self.cap = proc, ctl_w, reply_r, cap
        self.reply = os.fdopen(reply_r, "rb")
        self.exit_status: int | None = None

    @classmethod
    def start(cls, ex: Executor, req: dict) -> Session:
        ctl_r, ctl_w = os.pipe()
        reply_r, reply_w = os.pipe()
        argv = [sys.executable, ENTRY, "--session", str(ctl_r), str(reply_w)]
        # The interpreter lives across cells; it sets each cell's CPU limit itself.
        proc = ex._spawn(argv, req, None, pass_fds=(ctl_r, reply_w))
        os.close(ctl_r)
        os.close(reply_w)
        cap = Capture(proc.stdout.fileno(), proc.stderr.fileno(), req["max_output_bytes"])
        return cls(proc, ctl_w, reply_r, cap)

    def alive(self) -> bool:
        return self.exit_status is None and self.proc.poll() is None

    def freeze(self) -> None:
        """Stopped between its cells: a thread a cell started must not run on through later requests (the host
        writing tests, a program grading the work), which every other process of the sandbox cannot (the sweep)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGSTOP)
            # stopped before the next request is read (or gone: an exit is not consumed here, the sweep reaps it)
            os.waitid(os.P_PID, self.proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)

    def thaw(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)

    def run_cell(self, req: dict) -> dict:
        import json  # (after start-up: see LATER)

        self.cap.reset(req["max_output_bytes"])
        msg = json.dumps({"code": req["code"], "cpu_s": cpu_limit(req)})
        oom_before = oom_kills()
        t0 = time.monotonic()
        os.write(self.ctl_w, msg.encode() + b"\n")
        outcome = self.cap.pump(self.reply_r, t0 + req["timeout_s"])
        line = self.reply.readline() if outcome == "done" else b""
        wall = time.monotonic() - t0
        self.cap.drain(blocking=False)
        out, err = self.cap.text()
        if line:
            reply = json.loads(line)
            code = reply["exit_code"]
            status = "ok" if code == 0 else "error"
            return result(status, code, None, out, err, self.cap.truncated, wall, reply["cpu_s"], died=False)
        # Timed out, flooded, or the interpreter itself died (os._exit, a signal).
        if outcome != "done":
            kill_group(self.proc.pid)
        code = os.waitstatus_to_exitcode(self._wait())
        status, exit_code, sig = classify(outcome, code, oom_kills() > oom_before)
        return result(status, exit_code, sig, out, err, self.cap.truncated, wall, 0.0, died=True)

    def _wait(self) -> int:
        if self.exit_status is None:
            _, self.exit_status = os.waitpid(self.proc.pid, 0)
        return self.exit_status

    def stop(self) -> None:
        kill_group(self.proc.pid)
        if self.exit_status is None:
            with contextlib.suppress(ChildProcessError):
                self._wait()
        for f in (self.proc.stdout, self.proc.stderr, self.reply):
            f.close()
        os.close(self.ctl_w)


def session_main(ctl_fd: int, reply_fd: int) -> None:
    """The persistent interpreter: runs cells in one namespace, like a notebook kernel."""
    import json  # (after start-up: see LATER)

    ns = {"__name__": "__main__", "__builtins__": builtins}
    requests = os.fdopen(ctl_fd, "rb")
    replies = os.fdopen(reply_fd, "wb", buffering=0)
    for n, line in enumerate(requests, 1):
        cell = json.loads(line)
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(used) + cell["cpu_s"], hard))
        exit_code = run_code(cell["code"], f"<cell {n}>", ns, echo=True)
        sys.stdout.flush()
        sys.stderr.flush()
        cpu = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - used
        replies.write(json.dumps({"exit_code": exit_code, "cpu_s": cpu}).encode() + b"\n")


def run_main(path: str, source: str, env: dict) -> int:
    """In a forked child: run source as `python3 path` would, and return its exit code."""
    import io
    import types

    os.environ.clear()
    os.environ.update(env)
    sys.argv = [path]
    sys.path[0] = os.path.dirname(path)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), errors="surrogateescape")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), errors="surrogateescape", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace", write_through=True)
    main = types.ModuleType("__main__")
    main.__file__ = path
    sys.modules["__main__"] = main
    code = run_code(source, path, main.__dict__, echo=False)
    # What interpreter shutdown does (as multiprocessing's forked children do too).
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


# What run_code and spare_main import: not at the executor's start, which is a sandbox's cold start, but in the
# zygote (once, for every spare) and in the session interpreter.
RUNNER_MODULES = ("ast", "json", "linecache", "traceback")


def run_code(code: str, filename: str, ns: dict, *, echo: bool) -> int:
    """exec code in ns and return an exit code; echo: print a trailing expression's repr."""
    import ast
    import linecache
    import traceback

    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        tree = ast.parse(code, filename)
        tail = None
        if echo and tree.body and isinstance(tree.body[-1], ast.Expr):
            tail = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), ns)
        if tail is not None:
            value = eval(compile(tail, filename, "eval"), ns)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # report everything the code raised
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        return 1


# ---------------------------------------------------------------- helpers


class Capture:
    """Reads stdout and stderr of a child, keeping at most `limit` bytes in total."""

    def __init__(self, out_fd: int, err_fd: int, limit: int):
        self.fds = (out_fd, err_fd)
        self.open = set(self.fds)
        for fd in self.fds:
            os.set_blocking(fd, False)
        self.reset(limit)

    def reset(self, limit: int) -> None:
        self.limit = limit
        self.bufs = {fd: bytearray() for fd in self.fds}
        self.seen = 0

    @property
    def truncated(self) -> bool:
        return self.seen > self.limit

    def read(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        if not data:
            self.open.discard(fd)
            return
        room = self.limit - min(self.seen, self.limit)
        self.bufs[fd] += data[:room]
        self.seen += len(data)

    def pump(self, stop_fd: int, deadline: float) -> str:
        """Read until stop_fd is readable ("done"), the deadline ("timeout") or the cap."""
        with selectors.DefaultSelector() as sel:
            sel.register(stop_fd, selectors.EVENT_READ)
            for fd in self.open:
                sel.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "timeout"
                for key, _ in sel.select(left):
                    if key.fd == stop_fd:
                        return "done"
                    self.read(key.fd)
                    if key.fd not in self.open:
                        sel.unregister(key.fd)
                    if self.truncated:
                        return "output_limit"

    def drain(self, *, blocking: bool, budget_s: float = 2.0) -> None:
        """Read what is left. blocking: until EOF (every writer is dead by now)."""
        deadline = time.monotonic() + budget_s
        with selectors.DefaultSelector() as sel:
            for fd in self.open:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map() and time.monotonic() < deadline:
                ready = sel.select(max(0.0, deadline - time.monotonic()) if blocking else 0)
                if not ready:
                    return
                for key, _ in ready:
                    before = self.seen
                    self.read(key.fd)
                    if key.fd not in self.open or (not blocking and self.seen == before):
                        sel.unregister(key.fd)

    def text(self) -> tuple[bytes, bytes]:
        return bytes(self.bufs[self.fds[0]]), bytes(self.bufs[self.fds[1]])


def cpu_limit(req: dict) -> int:
    """Whole CPU seconds for RLIMIT_CPU: cpu_s, or the wall timeout when unset."""
    cpu_s = req["cpu_s"] if req["cpu_s"] is not None else req["timeout_s"]
    return max(1, math.ceil(cpu_s))


def std_pipes() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Pipes for a child's stdio: (its stdin, stdout, stderr ends), (our three ends)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    return (in_r, out_w, err_w), (in_w, out_r, err_r)


def feed_stdin(fd: int, data: bytes) -> None:
    # Whatever fits the pipe buffer (64 KiB); a program that reads none gets EOF after it.
    os.set_blocking(fd, False)
    with contextlib.suppress(BrokenPipeError, BlockingIOError):
        os.write(fd, data)
    os.close(fd)


def classify(outcome: str, code: int, oom: bool) -> tuple[str, int | None, int | None]:
    """(status, exit_code, signal) from how the call ended and the process's exit code."""
    sig = -code if code < 0 else None
    if outcome == "timeout":
        return "timeout", None, sig
    if outcome == "output_limit":
        return "output_limit", None, sig
    if sig is None:
        return ("ok" if code == 0 else "error"), code, None
    if sig == signal.SIGXCPU:
        return "timeout", None, sig
    if sig == signal.SIGKILL and oom:
        return "oom", None, sig
    return "killed", None, sig


def result(status, exit_code, sig, out: bytes, err: bytes, truncated, wall, cpu, swept=0, **extra):
    return {
        "status": status,
        "exit_code": exit_code,
        "signal": sig,
        "stdout": out.decode("utf-8", "replace"),
        "stderr": err.decode("utf-8", "replace"),
        "truncated": truncated,
        "wall_s": round(wall, 6),
        "cpu_s": round(cpu, 6),
        "swept": swept,
        **extra,
    }


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def exited_children():
    """(pid, wait status) of each child that has exited, reaped, without waiting for one that has not."""
    while True:
        try:
            pid, wstatus = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, wstatus


def kill_descendants(keep: set[int], reap) -> int:
    """SIGKILL every live descendant of this process not in `keep`, `reap()` (the caller's waits), repeat until none
    is left; how many were killed. As a child subreaper, a grandchild that setsid()-ed and double-forked away is one."""
    killed: set[int] = set()
    for _ in range(200):
        pids = descendants(os.getpid()) - keep
        if not pids:
            # A children file can leave out live children while others exit (proc_tid_children(5)),
            # as a fork bomb's do when killed: one scan of every process has the last word, or one
            # could outlive the sweep (seen once under load: after a fork bomb, the next call found
            # a process left with an empty command line, one exiting or a zombie).
            pids = _descendants_by_scan(os.getpid()) - keep
            if not pids:
                break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        reap()
        time.sleep(0.001)
    reap()
    return len(killed)


def descendants(root: int) -> set[int]:
    """Live (non-zombie) descendants of root.

    Walks /proc/PID/task/TID/children from root, so the common case (no
    descendants) costs one small read instead of a scan of every process;
    kernels without CONFIG_PROC_CHILDREN get the full /proc scan. The walk
    can miss processes while others exit; the sweep confirms with the scan.
    """
    if not HAVE_PROC_CHILDREN:
        return _descendants_by_scan(root)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    kids = f.read().split()
            except OSError:
                continue
            for kid in map(int, kids):
                if kid not in found:
                    found.add(kid)
                    todo.append(kid)
    return {pid for pid in found if (_stat(pid) or [b"Z"])[0] != b"Z"}


def _stat(pid: int | str) -> list[bytes] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ...]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()  # comm may contain spaces and parens


def _descendants_by_scan(root: int) -> set[int]:
    """Live descendants of root, from one read of every process's parent.

    Zombies stay in the tree while it is walked: a child whose parent was read alive and then
    died still hangs off that parent's entry (its move to the reaper is not seen).
    """
    children: dict[int, list[int]] = {}
    zombies = set()
    for name in os.listdir("/proc"):
        fields = _stat(name) if name.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append(int(name))
            if fields[0] == b"Z":
                zombies.add(int(name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found - zombies


def remove_tree(path: str, depth: int = 0) -> int:
    """Remove a file, link or directory tree without following links; its owner can, whatever its mode."""
    if depth > 256:
        raise RecursionError(f"{path}: directories nested too deep to clean")
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return 1
    os.chmod(path, 0o700)  # a dir its owner made unreadable or unwritable
    n = sum(remove_tree(os.path.join(path, e), depth + 1) for e in os.listdir(path))
    os.rmdir(path)
    return n + 1


IPC_RMID = 0
IPC_KINDS = {"shm": "shmctl", "msg": "msgctl", "sem": "semctl"}  # /proc/sysvipc/NAME -> libc call


def ipc_objects() -> list[tuple[str, int]]:
    """(kind, id) of every System V IPC object in this IPC namespace."""
    found = []
    for kind in IPC_KINDS:
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        found += [(kind, int(row.split()[1])) for row in rows if row.strip()]
    return found


def remove_ipc() -> int:
    """Remove the IPC objects this (effective) user may remove; how many went. The caller checks none is left."""
    objects = ipc_objects()
    for kind, ident in objects:
        getattr(libc(), IPC_KINDS[kind])(ident, *((0,) if kind == "sem" else ()), IPC_RMID, None)
    return len(objects) - len(ipc_objects())


def user_processes(uid: int) -> list[int]:
    """Live processes whose real or effective uid is `uid`."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:3]
        except (OSError, StopIteration):
            continue
        if str(uid) in uids and (_stat(name) or [b"Z"])[0] != b"Z":
            pids.append(int(name))
    return pids


HAVE_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")
_LIBC = None


def libc():
    """The C library, through ctypes, loaded at its first use: not at the executor's start (a cold start)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def oom_kills() -> int:
    """The cgroup's OOM-kill counter (v2 memory.events or v1 memory.oom_control); 0 if none."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            continue
    return 0


# ---------------------------------------------------------------- the warden (local sandboxes)


def become_warden(owner: int, sandbox_dir: str | None, ready_fd: int | None) -> None:
    """Fork the executor and stay its parent as the local sandbox's warden: returns in the executor, never here.

    What ends a sandbox's processes, double-forked setsid() daemons among them (which leave any process group), is a
    living child subreaper above them: in a container or bwrap, pid 1 of their pid namespace; locally, the executor,
    which a SIGKILL stops from sweeping, its orphans going to init. So the process the host starts is a child
    subreaper that runs nothing: once the owner process (the host) exits, the executor exits, or the host's close
    sends it SIGTERM, it SIGKILLs every process under it (the executor's orphans are its own by then), removes
    `sandbox_dir`, and exits as the executor did. If the warden dies first, the executor gets SIGTERM (its sweep,
    then exit). Not covered: both SIGKILLed at once (their process group, say); that takes a pid namespace or a
    cgroup (bwrap, Docker).

    The owner is watched by a pidfd, not PR_SET_PDEATHSIG, which fires when the thread that started the warden ends.
    """
    if libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        import ctypes

        sys.exit(f"executor: prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    try:
        owner_fd = os.pidfd_open(owner)
    except ProcessLookupError:
        owner_fd = None
    if owner_fd is None or os.getppid() != owner:  # checked after pidfd_open: the fd is that very process's
        remove_sandbox_dir(sandbox_dir)
        sys.exit(f"executor: owner process {owner} is gone")
    warden = os.getpid()
    pid = os.fork()
    if pid == 0:
        libc().prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != warden:  # the warden died before that
            os._exit(1)
        os.close(owner_fd)
        return
    if ready_fd is not None:
        os.close(ready_fd)  # the executor's alone: its exit before it is ready then closes the pipe
    executor_fd = os.pidfd_open(pid)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a byte on wake_w ends the wait
    select.select([owner_fd, executor_fd, wake_r], [], [])
    status = None

    def reap() -> None:
        nonlocal status
        for got, wstatus in exited_children():
            if got == pid:
                status = wstatus

    kill_descendants(set(), reap)
    if status is None:
        _, status = os.waitpid(pid, 0)
    remove_sandbox_dir(sandbox_dir)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # the executor died of a signal: so does the warden, for the host to tell
        with contextlib.suppress(OSError):  # SIGKILL's action is not ours to set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 1)


def remove_sandbox_dir(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError, RecursionError):
            remove_tree(path)


# ---------------------------------------------------------------- HTTP


class Server:
    """The Unix socket the host calls: one connection at a time, one request each.

    Not socketserver: its import (threading with it) was a sixth of the executor's start-up, which is a sandbox's
    cold start; and not http.server (with http.client, email and ssl), for the same reason: the host speaks one
    small dialect of HTTP/1.0 to it, read by Handler.
    """

    def __init__(self, path: str, executor: Executor):
        self.executor = executor
        # Bound and listening under another name, then renamed: the host waits for `path` to appear and connects
        # at once, and a socket file that exists before listen() refuses that connection.
        staging = path + ".new"
        for stale in (path, staging):
            if os.path.exists(stale):
                os.unlink(stale)
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.socket.bind(staging)
        self.socket.listen(16)
        os.chmod(staging, 0o666)  # the host side may be a non-root docker user
        os.rename(staging, path)

    def serve_forever(self) -> None:
        while True:
            conn, _ = self.socket.accept()
            with conn:
                conn.settimeout(Handler.timeout)  # a client that connects and says nothing does not stall the sandbox
                try:
                    Handler(conn, self).handle()
                except OSError:  # the client went away, or timed out, mid-request
                    pass
                except Exception:  # a bug of ours: said, and the next request served
                    import traceback

                    traceback.print_exc()
            for name in LATER:  # after the first answer (the end of a cold start); at once after that
                __import__(name)
            self.executor.ensure_spare()  # between requests, off the next call's path


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 409: "Conflict", 500: "Internal Server Error"}
MAX_HEADER_LINES = 64


class Handler:
    """One HTTP/1.0 request per connection: a request line, headers, a Content-Length body."""

    timeout = 30

    def __init__(self, connection: socket.socket, server: Server):
        self.connection, self.server = connection, server
        self.rfile = connection.makefile("rb")

    def handle(self) -> None:
        user = self.server.executor.user
        if user is not None:
            creds = self.connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid == user[0]:  # the sandboxed program itself: never served
                return
        try:
            method, path, _version = self.rfile.readline(65537).decode("latin-1").split()
            self.route, _, self.query = path.partition("?")
            self.headers = {}
            for _ in range(MAX_HEADER_LINES):
                line = self.rfile.readline(65537).decode("latin-1")
                if line in ("\r\n", "\n", ""):
                    break
                name, _, value = line.partition(":")
                self.headers[name.strip().lower()] = value.strip()
        except (OSError, ValueError):  # a dropped connection, or not a request line
            return
        handler = getattr(self, f"do_{method}", None)
        if handler is None:
            return self._json(400, {"error": f"no method {method}"})
        handler()

    def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        head = f"HTTP/1.0 {code} {REASONS[code]}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
        self.connection.sendall(head.encode("latin-1") + body)

    def _json(self, code: int, obj) -> None:
        import json  # (after start-up: see LATER)

        self._reply(code, json.dumps(obj).encode())

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("content-length", 0)))

    def _dispatch(self, fn) -> None:
        try:
            fn()
        except BadRequest as e:
            self._json(400, {"error": str(e)})
        except FileError as e:
            self._json(409, {"error": str(e), "errno": e.errno})
        except Exception as e:
            import traceback  # here: an error's alone (see Server)

            self._json(500, {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})

    def _request(self) -> dict:
        import json  # (after start-up: see LATER)

        try:
            body = json.loads(self._body() or b"{}")
        except ValueError as e:
            raise BadRequest(f"body is not JSON: {e}") from None
        unknown = set(body) - set(DEFAULTS) - {"argv", "code"}
        if unknown:
            raise BadRequest(f"unknown fields {sorted(unknown)}; valid: {[*sorted(DEFAULTS), 'argv', 'code']}")
        return {**DEFAULTS, **body}

    def _path_param(self) -> str:
        import urllib.parse  # here, not at start-up: a file request's alone (the import is a sandbox's cold start)

        query = urllib.parse.parse_qs(self.query)
        if "path" not in query:
            raise BadRequest("missing ?path=")
        return query["path"][0]

    def do_GET(self) -> None:
        ex = self.server.executor
        route = self.route
        if route == "/health":  # written out: often the first request, answered before json is imported (LATER)
            self._reply(200, b'{"ok": true, "session": %s}' % (b"true" if ex.session is not None else b"false"))
        elif route == "/files":
            self._dispatch(lambda: self._reply(200, ex.read_file(self._path_param()), "application/octet-stream"))
        else:
            self._json(404, {"error": f"no route {route}"})

    def do_PUT(self) -> None:
        ex = self.server.executor
        if self.route != "/files":
            return self._json(404, {"error": "no route"})
        self._dispatch(lambda: self._json(200, {"bytes": ex.write_file(self._path_param(), self._body())}))

    def do_POST(self) -> None:
        ex = self.server.executor
        route = self.route
        handlers = {"/run": ex.run, "/session": ex.run_session}
        if route == "/recycle":
            return self._dispatch(lambda: self._json(200, ex.recycle()))
        if route not in handlers:
            return self._json(404, {"error": f"no route {route}"})

        def call():
            req = self._request()
            self._json(200, handlers[route](req))

        self._dispatch(call)

    def do_DELETE(self) -> None:
        ex = self.server.executor
        if self.route != "/session":
            return self._json(404, {"error": "no route"})
        self._dispatch(lambda: (ex.stop_session(), self._json(200, {"ok": True})))


USAGE = (
    "usage: main.py --socket PATH [--workdir DIR] [--tmpdir DIR] [--codedir DIR] [--user UID:GID] [--ready-fd FD]"
    " [--owner PID [--sandbox-dir DIR]]"
)


def parse_args(argv: list[str]) -> dict:
    """The command line, read by hand: importing argparse (with gettext and its own parsing) was a sixth of a
    sandbox's cold start. --session and --zygote are the executor's own, for the interpreters it starts.

    --ready-fd: a pipe to write "ready" to once the socket is served, and close (a sandbox started with a pipe: bwrap,
    local); its host reads that, not the socket file's appearance, and an end of file says the executor is gone.

    --owner PID: a local sandbox's, started by process PID: a warden stays above the executor (become_warden) and
    removes --sandbox-dir at the end."""
    opts: dict = {"socket": None, "workdir": "/work", "tmpdir": "/tmp", "codedir": "/code", "user": None}
    opts.update({"ready-fd": None, "owner": None, "sandbox-dir": None, "session": None, "zygote": None})
    args = iter(argv)
    for arg in args:
        name = arg[2:] if arg.startswith("--") else ""
        if name not in opts:
            sys.exit(f"executor: unknown argument {arg!r}\n{USAGE}")
        try:
            if name == "session":
                opts[name] = (int(next(args)), int(next(args)))
            elif name in ("zygote", "ready-fd", "owner"):
                opts[name] = int(next(args))
            else:
                opts[name] = next(args)
        except (StopIteration, ValueError):
            sys.exit(f"executor: {arg} needs {'two numbers' if name == 'session' else 'a value'}\n{USAGE}")
    return opts


def main() -> None:
    gc.enable()  # main.py loads this module without it; the zygote, its spares and the session inherit it
    args = parse_args(sys.argv[1:])
    if args["session"]:
        return session_main(*args["session"])
    user = tuple(int(x) for x in args["user"].split(":")) if args["user"] else None
    executor = Executor(args["workdir"], args["tmpdir"], args["codedir"], user)
    if args["zygote"] is not None:
        return zygote_main(args["zygote"], executor)
    if not args["socket"]:
        sys.exit(f"executor: --socket is required\n{USAGE}")
    # Python's KeyboardInterrupt handler would let a stray SIGINT kill the server.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if args["owner"] is not None:
        become_warden(args["owner"], args["sandbox-dir"], args["ready-fd"])
    os.umask(0o022)

    def terminate(signum, frame):  # leave nothing running behind us
        executor.zygote = None  # so the sweep kills it too
        executor.sweep(everything=True)
        os._exit(0)

    # First, so that it imports what the spares need (RUNNER_MODULES) while the executor goes on with its start.
    executor.zygote = Zygote.fork(executor)  # before the SIGTERM handler, which is the executor's alone
    signal.signal(signal.SIGTERM, terminate)
    if libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:  # before any request, which can leave orphans
        import ctypes

        sys.exit(f"executor: prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    # The first spare after the socket, made while the host reads the first answer (Server.serve_forever): the
    # zygote, forked, is ready at once (an exec-ed one took over 10 s on a machine busy starting dozens of
    # containers, which held the first request, a health probe, past its timeout).
    server = Server(args["socket"], executor)
    if args["ready-fd"] is not None:
        os.write(args["ready-fd"], b"ready\n")
        os.close(args["ready-fd"])
    gc.freeze()  # forked children's GC then never walks (and copies) the executor's objects
    server.serve_forever()
