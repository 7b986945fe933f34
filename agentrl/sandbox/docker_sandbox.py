"""DockerSandbox: a locked-down container whose executor is reached over a Unix socket.

Per call there is no `docker exec` (85-96 ms on the dev VM, BENCHMARKS.md): the host speaks HTTP
to the long-lived executor through a socket in a bind-mounted directory, which
works with `network_mode=none`.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from functools import cache
from pathlib import Path

import docker
import docker.errors
from docker.types import Mount
from pydantic import BaseModel, ConfigDict, Field

from agentrl.sandbox import reaper
from agentrl.sandbox.base import CallLimits, ExecutorSandbox, SandboxError, runtime_dir
from agentrl.sandbox.image import image_exists, image_tag

SOCKET_IN_CONTAINER = "/run/agentrl"


class DockerSandboxConfig(BaseModel):
    """How each sandbox container is started. Defaults are the locked-down ones."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    image: str | None = None
    """image to run; None: the agentrl image of sandboxes/ as this process first found it (`default_image`)"""
    memory: str = "512m"
    """memory limit of the container, tmpfs contents included (swap disabled)"""
    cpus: float = Field(1.0, gt=0)
    """CPU quota in cores"""
    pids: int = Field(256, ge=16)
    """process + thread limit of the container (stops fork bombs)"""
    work_size: str = "256m"
    """size of the /work tmpfs (the work dir, owned by the sandbox user)"""
    tmp_size: str = "64m"
    """size of the /tmp tmpfs"""
    network: str = "none"
    """docker network mode; anything but none lets programs reach the network"""
    start_timeout_s: float = Field(30.0, gt=0)
    """how long a container may take to start its executor"""
    limits: CallLimits = CallLimits()
    """default per-call limits"""


@cache
def docker_client() -> docker.DockerClient:
    """One client per process; a clear error when no engine answers."""
    try:
        client = docker.from_env(version="auto", max_pool_size=32)
        client.ping()
    except docker.errors.DockerException as e:
        raise SandboxError(
            f"cannot reach the Docker engine ({e}). Start it (`dockerd &`, or `bash scripts/setup.sh`), "
            "set DOCKER_HOST, or use LocalSandbox for trusted code."
        ) from e
    return client


@cache
def default_image() -> str:
    """The agentrl image for sandboxes/ as this process first found it (`agentrl sandbox build` makes it).

    Pinned, as a running program keeps the code it started with: a checkout that changes under a run (a pull, an
    edit of the executor) would otherwise make every later container start look for an image nobody built."""
    return image_tag()


_closing: set[asyncio.Task] = set()  # closes of sandboxes whose start's caller was cancelled


def _close_unclaimed(start: asyncio.Future) -> None:
    """A start whose caller was cancelled has ended: close the sandbox it made, which nobody else will."""
    if start.cancelled() or start.exception() is not None:
        return
    task = asyncio.ensure_future(start.result().close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


class DockerSandbox(ExecutorSandbox):
    """One container. Create with `await DockerSandbox.create(cfg)`; usually via SandboxPool.

    The container: network none, every capability dropped but the three the
    executor needs to run programs as `nobody` (SETUID, SETGID, KILL), programs
    with none, no-new-privileges, read-only root, tmpfs /work and /tmp, memory
    (no swap), CPU and pids limits, docker's init as PID 1, owner labels.
    """

    def __init__(self, client, container, sockdir: Path, limits: CallLimits):
        super().__init__(sockdir / "exec.sock", limits, container.name)
        self.client = client
        self.container = container
        self.sockdir = sockdir
        self._closed = False

    @classmethod
    async def create(cls, cfg: DockerSandboxConfig | None = None) -> DockerSandbox:
        cfg = cfg or DockerSandboxConfig()
        client = docker_client()
        reaper.install(client)
        # The start is a thread, which goes on when its caller is cancelled (an episode past its time limit, making
        # a sandbox to grade in): shielded, so that the container it makes is then removed, not left running.
        start = asyncio.ensure_future(asyncio.to_thread(cls._create_blocking, client, cfg))
        try:
            return await asyncio.shield(start)
        except asyncio.CancelledError:
            start.add_done_callback(_close_unclaimed)
            raise

    @classmethod
    def _create_blocking(cls, client, cfg: DockerSandboxConfig) -> DockerSandbox:
        image = cfg.image or default_image()
        if not image_exists(client, image):
            raise SandboxError(f"sandbox image {image} not found: run `agentrl sandbox build`")
        token = secrets.token_hex(6)
        sockdir = runtime_dir() / token
        sockdir.mkdir()
        # Writable for the container's root (no CAP_DAC_OVERRIDE) until the socket exists.
        sockdir.chmod(0o777)
        labels = {**reaper.owner_labels(), reaper.SOCKDIR_LABEL: str(sockdir)}
        try:
            # Made, then started: a start that fails (an OCI runtime error, a missing network) leaves a made
            # container, which `containers.run` would not give back to be removed.
            container = client.containers.create(
                image,
                name=f"agentrl-{token}",
                detach=True,
                init=True,
                user="0:0",
                network_mode=cfg.network,
                cap_drop=["ALL"],
                cap_add=["SETUID", "SETGID", "KILL"],
                security_opt=["no-new-privileges"],
                read_only=True,
                tmpfs={
                    "/work": f"rw,exec,nosuid,nodev,size={cfg.work_size},uid=65534,gid=65534,mode=0755",
                    "/tmp": f"rw,exec,nosuid,nodev,size={cfg.tmp_size},mode=1777",
                    "/code": "rw,noexec,nosuid,nodev,size=16m,mode=0755",  # executor-only
                },
                mem_limit=cfg.memory,
                memswap_limit=cfg.memory,
                nano_cpus=int(cfg.cpus * 1e9),
                pids_limit=cfg.pids,
                labels=labels,
                mounts=[Mount(SOCKET_IN_CONTAINER, str(sockdir), type="bind")],
            )
        except docker.errors.DockerException as e:
            shutil.rmtree(sockdir, ignore_errors=True)
            raise SandboxError(f"could not start a sandbox container from {image}: {e}") from e
        sandbox = cls(client, container, sockdir, cfg.limits)
        try:
            container.start()
            sandbox._wait_for_socket(cfg.start_timeout_s)
        except BaseException as e:
            reaper.remove(client, container)
            if isinstance(e, docker.errors.DockerException):
                raise SandboxError(f"could not start a sandbox container from {image}: {e}") from e
            raise
        # Lock the dir: the sandbox user can no longer create or unlink anything in it.
        sockdir.chmod(0o755)
        return sandbox

    def _wait_for_socket(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + 0.5
        while not self.socket_path.exists():
            now = time.monotonic()
            if now > deadline:
                raise SandboxError(f"{self.name}: executor did not start within {timeout_s}s")
            if now > next_check:  # a container that died at start-up will never make the socket
                next_check = now + 0.5
                self.container.reload()
                if self.container.status not in ("created", "running"):
                    logs = self.container.logs(tail=20).decode(errors="replace")
                    raise SandboxError(f"{self.name}: container exited during start-up:\n{logs}")
            time.sleep(0.002)

    async def _diagnose(self, error: BaseException) -> str:
        def inspect() -> str:
            # The socket can close a moment before the engine records the exit: poll briefly.
            for _ in range(20):
                try:
                    self.container.reload()
                except docker.errors.NotFound:
                    return f"container vanished ({type(error).__name__}: {error})"
                except docker.errors.DockerException as e:
                    return f"docker engine unreachable ({e})"
                state = self.container.attrs["State"]
                if state["Status"] != "running":
                    return (
                        f"container {state['Status']} (exit code {state.get('ExitCode')}, "
                        f"OOMKilled={state.get('OOMKilled')})"
                    )
                time.sleep(0.05)
            return f"executor unreachable in a running container ({type(error).__name__}: {error})"

        return await asyncio.to_thread(inspect)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(reaper.remove, self.client, self.container)
