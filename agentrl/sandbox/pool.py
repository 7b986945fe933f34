"""SandboxPool: warm sandboxes handed out one per episode, refilled behind.

By default a used sandbox is never handed out again (the program may have left
anything behind); it is closed and a fresh one started in the background, so
`acquire` costs a health probe, not a container start. With `reuse=N` a used
sandbox is recycled instead, up to N times: the executor kills every process
and empties every place the sandbox user can write, and proves it (see
`Sandbox.recycle`); one that cannot be proven clean is discarded as before. A
container start costs a few hundred ms of CPU, a recycle a few ms: on a small
machine running many short episodes, starts are most of the rollout time.
With reuse the pool holds `size` containers: an acquire waits for one to come back,
and only when none has for `patience_s` (they are held for long) starts another,
discarded on its return unless a waiter needs it. Never more than `max_size` are alive
(2 x `size` by default): past that, waiters wait for a return however long it takes, since
each container costs memory (~30 MB) and an evaluation with thousands of episodes in flight,
each holding its sandbox while the engine writes its next turn, would otherwise start one
per waiter until the machine runs out. Idle sandboxes are probed periodically and dead ones replaced. Starts and
removals together are bounded (`max_docker_ops`) so a large pool does not
flood the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from agentrl.sandbox.base import Sandbox, SandboxError
from agentrl.sandbox.config import SandboxConfig

log = logging.getLogger(__name__)


class SandboxPool:
    """Keeps `size` sandboxes warm.

    >>> pool = SandboxPool(lambda: DockerSandbox.create(cfg), size=8)  # or SandboxConfig(backend="bwrap")
    >>> await pool.start()
    >>> async with pool.sandbox() as sb:
    ...     result = await sb.run_python("print(1)")
    >>> await pool.close()
    """

    def __init__(
        self,
        factory: Callable[[], Awaitable[Sandbox]] | SandboxConfig,
        size: int,
        *,
        max_docker_ops: int = 4,
        health_interval_s: float = 5.0,
        reuse: int = 0,
        patience_s: float = 2.0,
        max_size: int | None = None,
    ):
        max_size = 2 * size if max_size is None else max_size
        if size < 1 or reuse < 0 or max_size < size:
            raise ValueError(
                f"pool size must be >= 1, reuse >= 0 and max_size >= size, got size={size}, reuse={reuse}, "
                f"max_size={max_size}"
            )
        self.factory = factory.factory() if isinstance(factory, SandboxConfig) else factory
        self.size = size
        self.max_size = max_size
        self.reuse = reuse
        self.patience_s = patience_s
        self._starved = 0  # waiters past patience_s
        self._waiting = 0  # callers of acquire waiting for an idle sandbox
        self._last_back = time.monotonic()  # when a sandbox last became idle (started or recycled)
        self._uses: dict[Sandbox, int] = {}  # episodes each sandbox has served
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
        self.stats = {"started": 0, "discarded": 0, "recycled": 0, "replaced_dead": 0, "start_failures": 0, "peak": 0}

    async def start(self) -> None:
        """Fill the pool and wait until every sandbox is up (raises if none could start)."""
        self._fill()
        self._health = asyncio.create_task(self._health_loop())
        async with self._changed:
            await self._changed.wait_for(lambda: self._starting == 0)
        if not self._idle:
            raise SandboxError(f"no sandbox could be started: {self._last_error}") from self._last_error

    async def acquire(self) -> Sandbox:
        """A healthy sandbox, never used (or recycled and proven clean); waits while one starts or comes back."""

        def ready() -> bool:
            return bool(self._idle) or self._closed or self._failing()

        while True:
            self._fill()  # also retries after starts failed
            async with self._changed:
                starved = False
                self._waiting += 1
                try:
                    while not ready():
                        try:
                            await asyncio.wait_for(self._changed.wait_for(ready), self.patience_s)
                        except TimeoutError:
                            # With reuse, leased sandboxes count as coming back, but one may be held for long
                            # (a parked episode keeps its sandbox until the next iteration). When none has
                            # come back for patience_s, every waiter gets a start of its own; release
                            # discards the surplus. While they do come back, waiters wait: a busy pool
                            # (every sandbox in a long episode) must not grow a container per waiter.
                            if time.monotonic() - self._last_back < self.patience_s:
                                continue
                            self._starved += not starved
                            starved = True
                            for _ in range(min(self._starved - self._starting, self.max_size - self._alive())):
                                self._starting += 1
                                self._spawn(self._start_one())
                finally:
                    self._starved -= starved
                    self._waiting -= 1
                if self._closed:
                    raise SandboxError("pool is closed")
                if not self._idle:
                    raise SandboxError(f"sandboxes fail to start: {self._last_error}") from self._last_error
                sandbox = self._idle.pop()
                self._leased.add(sandbox)  # counted while probed: with reuse it is one that comes back
            try:
                healthy = await sandbox.healthy()
            except asyncio.CancelledError:  # the caller was cancelled: the lease must not leak
                self._leased.discard(sandbox)
                self._spawn(self._discard(sandbox))
                self._fill()
                raise
            if not healthy:
                self._leased.discard(sandbox)
            # Start its replacement only now: a start's docker calls would slow the probe.
            self._fill()
            if healthy:
                return sandbox
            log.warning("a sandbox failed its health probe at acquire; replacing it")
            self.stats["replaced_dead"] += 1
            self._spawn(self._discard(sandbox))

    async def release(self, sandbox: Sandbox) -> None:
        """Give back a leased sandbox: recycled in the background while it may be reused, else closed.

        One not leased is left alone: given back twice, a second recycle would put it in `_idle` twice (two
        episodes then share it), and a second discard would close it under the recycle. (One given back, leased
        again, then given back by its first holder cannot be told from its new holder's: callers release once.)"""
        if sandbox not in self._leased:
            if not self._closed:  # close() closed the leased ones: their release comes after
                log.warning(
                    "sandbox %s given back but not leased (released twice?): left alone",
                    getattr(sandbox, "name", sandbox),
                )
            return
        self._leased.discard(sandbox)
        self._uses[sandbox] = self._uses.get(sandbox, 0) + 1
        held = self._alive()  # this one aside
        # A waiter takes the surplus, past its patience or not: discarded, it would wait for a start instead.
        wanted = held < self.size or (self._waiting > len(self._idle) and held < self.max_size)
        if self._uses[sandbox] <= self.reuse and wanted and not self._closed:
            self._starting += 1  # on its way back to idle, as a start is
            self._spawn(self._recycle(sandbox))
        else:
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

    def _alive(self) -> int:
        """Containers idle, leased, or on their way to idle (starting or being recycled)."""
        return len(self._idle) + len(self._leased) + self._starting

    def _failing(self) -> bool:
        # Nothing idle, nothing on the way, and the last start failed: waiting would hang.
        return self._starting == 0 and self._last_error is not None

    def _fill(self) -> None:
        """Keep `size` sandboxes that are idle or on their way to idle: starting, being recycled, or
        leased and reusable (they come back). Without reuse that is `size` idle ones."""
        if self._closed:
            return
        returning = sum(self._uses.get(sb, 0) < self.reuse for sb in self._leased)
        for _ in range(self.size - len(self._idle) - self._starting - returning):
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
            self._last_back = time.monotonic()
        async with self._changed:
            self._changed.notify_all()

    async def _recycle(self, sandbox: Sandbox) -> None:
        try:
            clean = await sandbox.recycle()
        finally:
            self._starting -= 1
        if clean and not self._closed:
            self.stats["recycled"] += 1
            self._idle.append(sandbox)
            self._last_back = time.monotonic()
        else:
            await self._discard(sandbox)
            self._fill()
        async with self._changed:
            self._changed.notify_all()

    async def _discard(self, sandbox: Sandbox) -> None:
        self._uses.pop(sandbox, None)
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
        self.stats["peak"] = max(self.stats["peak"], self._alive())
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
