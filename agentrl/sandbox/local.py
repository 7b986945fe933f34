"""LocalSandbox: the executor as a plain host subprocess. Limits, not isolation.

For trusted development without Docker. It applies the same per-call limits
(rlimits, wall clock, output cap, process-tree sweep) but the program runs as
you, with your network and your files. Docker stays the default.

No process outlives the sandbox, though no pid namespace or cgroup ends it as a
whole: the process started here is the executor's warden (`become_warden` in
the executor), a child subreaper that kills everything under it, double-forked
setsid() daemons included, and removes the sandbox's folder when this process
exits (SIGKILL too), when the executor dies (SIGKILL too), or at `close()`; if
the warden is killed, the executor sweeps its own tree and exits. What escapes:
processes of a sandbox whose warden and executor are SIGKILLed at once (their
process group, say), and the folder when the warden and this process both are.
No reaper is needed for the rest: `agentrl sandbox gc` has nothing local to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from agentrl.sandbox.base import CallLimits, ExecutorSandbox, SandboxError, executor_ready, start_executor
from agentrl.sandbox.image import sandboxes_dir

log = logging.getLogger(__name__)
NOT_ISOLATION = (
    "LocalSandbox is NOT isolation: programs run as your user with your network and files. "
    "Use it only for trusted code; DockerSandbox is the default."
)


@functools.cache
def _say_not_isolation() -> None:
    """Once a process (a pool makes several, a spare among them): one line in the log, where the run's lines go."""
    log.warning(NOT_ISOLATION)


class LocalSandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    limits: CallLimits = CallLimits(memory_bytes=2 << 30)
    """per-call limits; with no cgroup, memory is capped by RLIMIT_AS"""
    start_timeout_s: float = 10.0
    """how long the executor may take to start"""


class LocalSandbox(ExecutorSandbox):
    def __init__(self, proc: asyncio.subprocess.Process, root: Path, limits: CallLimits):
        super().__init__(root / "exec.sock", limits, f"local-{proc.pid}")
        self.proc = proc
        self.root = root
        self.workdir = root / "work"

    @classmethod
    async def create(cls, cfg: LocalSandboxConfig | None = None) -> LocalSandbox:
        cfg = cfg or LocalSandboxConfig()
        _say_not_isolation()
        root = Path(tempfile.mkdtemp(prefix="agentrl-local-"))
        (root / "work").mkdir()
        (root / "tmp").mkdir()
        (root / "code").mkdir()
        try:
            proc, ready_fd = await start_executor(
                sys.executable,
                str(sandboxes_dir() / "python" / "main.py"),
                "--socket",
                str(root / "exec.sock"),
                "--workdir",
                str(root / "work"),
                "--tmpdir",
                str(root / "tmp"),
                "--codedir",
                str(root / "code"),
                "--owner",
                str(os.getpid()),
                "--sandbox-dir",
                str(root),
                start_new_session=True,
            )
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        sandbox = cls(proc, root, cfg.limits)
        try:
            ready = await executor_ready(ready_fd, cfg.start_timeout_s)
        except TimeoutError:
            ready = False
        except BaseException:
            await sandbox.close()
            raise
        if not ready:
            await sandbox.close()
            raise SandboxError(
                f"local executor did not start within {cfg.start_timeout_s}s (exit code {proc.returncode})"
            )
        return sandbox

    async def _diagnose(self, error: BaseException) -> str:
        with contextlib.suppress(TimeoutError):  # the warden exits a moment after the executor, once it swept
            await asyncio.wait_for(self.proc.wait(), 0.5)
        if self.proc.returncode is not None:
            return f"local executor exited with {self.proc.returncode}"
        return f"local executor unreachable ({type(error).__name__}: {error})"

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()  # the warden kills everything under it, removes the folder, then exits
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                self.proc.kill()  # then the executor sweeps its own tree (it gets SIGTERM when the warden dies)
                await self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
