"""SandboxPool: warm sandboxes handed out one per episode, discarded after, refilled behind.

A used sandbox is never handed out again (the program may have left anything
in /work or /tmp); it is closed and a fresh one started in the background, so
`acquire` costs a health probe, not a container start. Idle sandboxes are
probed periodically and dead ones replaced. Starts and removals together are
bounded (`max_docker_ops`) so a large pool does not flood the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from agentrl.sandbox.base import Sandbox, SandboxError

log = logging.getLogger(__name__)


class SandboxPool:
    """Keeps `size` sandboxes warm.

    >>> pool = SandboxPool(lambda: DockerSandbox.create(cfg), size=8)
    >>> await pool.start()
    >>> async with pool.sandbox() as sb:
    ...     result = await sb.run_python("print(1)")
    >>> await pool.close()
    """

    def __init__(
        self,
        factory: Callable[[], Awaitable[Sandbox]],
        size: int,
        *,
        max_docker_ops: int = 4,
        health_interval_s: float = 5.0,
    ):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self.factory = factory
        self.size = size
        self.health_interval_s = health_interval_s
        self._ops = asyncio.Semaphore(max_docker_ops)
        self._idle: list[Sandbox] = []
        self._leased: set[Sandbox] = set()
        self._starting = 0
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()  # starts and discards
        self._health: asyncio.Task | None = None
        self._last_error: BaseException | None = None
        self._closed = False
        self.stats = {"started": 0, "discarded": 0, "replaced_dead": 0, "start_failures": 0}

    async def start(self) -> None:
        """Fill the pool and wait until every sandbox is up (raises if none could start)."""
        self._fill()
        self._health = asyncio.create_task(self._health_loop())
        async with self._changed:
            await self._changed.wait_for(lambda: self._starting == 0)
        if not self._idle:
            raise SandboxError(f"no sandbox could be started: {self._last_error}") from self._last_error

    async def acquire(self) -> Sandbox:
        """A healthy, never-used sandbox; waits while replacements start."""
        while True:
            self._fill()  # also retries after starts failed
            async with self._changed:
                await self._changed.wait_for(lambda: self._idle or self._closed or self._failing())
                if self._closed:
                    raise SandboxError("pool is closed")
                if not self._idle:
                    raise SandboxError(f"sandboxes fail to start: {self._last_error}") from self._last_error
                sandbox = self._idle.pop()
            healthy = await sandbox.healthy()
            # Start its replacement only now: a start's docker calls would slow the probe.
            self._fill()
            if healthy:
                self._leased.add(sandbox)
                return sandbox
            log.warning("a sandbox failed its health probe at acquire; replacing it")
            self.stats["replaced_dead"] += 1
            self._spawn(self._discard(sandbox))

    async def release(self, sandbox: Sandbox) -> None:
        """Give back a leased sandbox; it is closed in the background, never reused."""
        self._leased.discard(sandbox)
        self._spawn(self._discard(sandbox))

    @contextlib.asynccontextmanager
    async def sandbox(self) -> AsyncIterator[Sandbox]:
        sandbox = await self.acquire()
        try:
            yield sandbox
        finally:
            await self.release(sandbox)

    async def close(self) -> None:
        """Close every sandbox, idle and leased; safe to call twice."""
        self._closed = True
        if self._health is not None:
            self._health.cancel()
        # Starts and discards run to the end: a cancelled start would leak its container.
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        everything = self._idle + list(self._leased)
        self._idle.clear()
        self._leased.clear()
        await asyncio.gather(*(s.close() for s in everything), return_exceptions=True)
        async with self._changed:
            self._changed.notify_all()

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---------------------------------------------------------------- internals

    def _failing(self) -> bool:
        # Nothing idle, nothing on the way, and the last start failed: waiting would hang.
        return self._starting == 0 and self._last_error is not None

    def _fill(self) -> None:
        if self._closed:
            return
        for _ in range(self.size - len(self._idle) - self._starting):
            self._starting += 1
            self._spawn(self._start_one())

    async def _start_one(self) -> None:
        try:
            async with self._ops:
                sandbox = await self.factory()
        except Exception as e:
            self.stats["start_failures"] += 1
            self._last_error = e
            log.warning("sandbox start failed: %s", e)
            sandbox = None
        finally:
            self._starting -= 1
        if sandbox is not None:
            self.stats["started"] += 1
            self._last_error = None
            if self._closed:
                await sandbox.close()
                return
            self._idle.append(sandbox)
        async with self._changed:
            self._changed.notify_all()

    async def _discard(self, sandbox: Sandbox) -> None:
        self.stats["discarded"] += 1
        async with self._ops:
            await sandbox.close()

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_interval_s)
            for sandbox in list(self._idle):
                if not await sandbox.healthy() and sandbox in self._idle:
                    self._idle.remove(sandbox)
                    self.stats["replaced_dead"] += 1
                    self._spawn(self._discard(sandbox))
                    self._fill()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
