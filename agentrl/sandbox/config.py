"""The sandbox setting of a run (`sandbox:`): which backend makes every sandbox, wherever one is made.

    docker  a locked-down container (the default): needs a Docker engine
    bwrap   bubblewrap namespaces and a cgroup, no daemon: Linux with Debian's `bubblewrap` package
    local   a host process: limits, NOT isolation (trusted code only)

Nothing above the sandbox layer knows which it has: each makes `Sandbox`es that speak the same executor protocol.
Nothing falls back from one to another: a backend that cannot run here is refused in one line (`unavailable`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict

from agentrl.sandbox.base import Sandbox

Backend = Literal["docker", "bwrap", "local"]


class SandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    backend: Backend = "docker"
    """docker: a locked-down container (needs a Docker engine); bwrap: bubblewrap namespaces, no daemon (needs
    Debian's `bubblewrap`); local: a host process, NOT isolation (trusted code only)"""

    def factory(self) -> Callable[[], Awaitable[Sandbox]]:
        """Starts one sandbox of this backend, with the backend's locked-down defaults."""
        if self.backend == "docker":
            from agentrl.sandbox.docker_sandbox import DockerSandbox

            return DockerSandbox.create
        if self.backend == "bwrap":
            from agentrl.sandbox.bwrap import BwrapSandbox

            return BwrapSandbox.create
        from agentrl.sandbox.local import LocalSandbox

        return LocalSandbox.create

    def unavailable(self) -> str | None:
        """Why this backend cannot make sandboxes on this machine, in one line naming what to do; None if it can."""
        if self.backend == "docker":
            from agentrl.sandbox.base import SandboxError
            from agentrl.sandbox.docker_sandbox import docker_client

            try:
                docker_client()
            except SandboxError:
                return (
                    "no Docker engine answers (start one: `bash scripts/setup.sh`), or run sandboxes without a daemon: "
                    "--set sandbox.backend=bwrap (`--backend bwrap` for agentrl sandbox and agentrl envs)"
                )
            return None
        if self.backend == "bwrap":
            from agentrl.sandbox import bwrap

            return bwrap.unavailable()
        return None

    def watch(self) -> int | None:
        """In a process that makes sandboxes and may die without running atexit (an env worker): start a watchdog that
        removes its sandboxes once it is gone, where they would outlive it, and return its pid. Docker's containers
        would (their daemon keeps them: `reaper.watch`); bwrap's die with their owner (--die-with-parent), and local
        ones (trusted host processes) carry no owner record: None."""
        if self.backend != "docker":
            return None
        from agentrl.sandbox import reaper

        return reaper.watch()

    def collect_orphans(self) -> list[str]:
        """Remove this host's sandboxes of this backend whose owner process is gone (a dead env worker's); their
        names. Local sandboxes carry no owner record: none."""
        if self.backend == "docker":
            from agentrl.sandbox import reaper
            from agentrl.sandbox.docker_sandbox import docker_client

            return reaper.collect_orphans(docker_client())
        if self.backend == "bwrap":
            from agentrl.sandbox import bwrap

            return bwrap.collect_orphans()
        return []

    def describe(self) -> str:
        """One line on what these sandboxes are here (bwrap: its privilege, cgroup and root; local: not isolation)."""
        if self.backend == "bwrap":
            from agentrl.sandbox import bwrap

            return bwrap.host().describe(bwrap.resolve_rootfs(bwrap.BwrapSandboxConfig()))
        if self.backend == "local":
            from agentrl.sandbox.local import NOT_ISOLATION

            return NOT_ISOLATION
        return "docker sandboxes: locked-down containers"
