"""Where environments get their sandboxes: a warm pool shared by the envs of one event loop."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable

from agentrl.sandbox import Sandbox, SandboxConfig, SandboxPool

DEFAULT_POOL_SIZE = 4

_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SandboxSource] = weakref.WeakKeyDictionary()


class SandboxSource:
    """Hands one sandbox per episode to the envs attached to it.

    Pass a `SandboxPool` you own (`SandboxSource(pool)`) to share it between envs and
    close it yourself. Without one, the pool's sandboxes are `sandbox`'s backend (Docker by
    default), and `SandboxSource.default()` gives every env of the
    running event loop the same pool of them, started on first use and
    closed when the last env attached to it closes. A sync env runs its own event loop,
    so it gets a pool of its own: its next episode's sandbox starts while this one runs.
    `keep_open=True` (long-lived owners such as env workers, whose envs come and go) keeps
    the pool warm between episodes until `close()`, instead of stopping and restarting it.
    `reuse` and `max_size` are the pool's: how many more episodes a sandbox may serve after a proven-clean recycle,
    and how many may be alive at once (None: the pool's default, twice `size`).
    """

    def __init__(
        self,
        pool: SandboxPool | None = None,
        *,
        factory: Callable[[], Awaitable[Sandbox]] | None = None,
        size: int = DEFAULT_POOL_SIZE,
        keep_open: bool = False,
        reuse: int = 0,
        max_size: int | None = None,
        sandbox: SandboxConfig | None = None,
    ):
        self.config = sandbox or SandboxConfig()
        """the backend this source's sandboxes are of: an env that makes a sandbox of its own (repo_fix's instance
        images) makes it of the same"""
        self._keep_open = keep_open
        self._owned = pool is None
        self._factory = factory or self.config.factory()
        self._size = size
        self._reuse = reuse
        self._max_size = max_size
        self.pool = pool or SandboxPool(self._factory, size=size, reuse=reuse, max_size=max_size)
        self._started = not self._owned
        self._start_lock = asyncio.Lock()
        self._envs: weakref.WeakSet[object] = weakref.WeakSet()  # the envs attached (any object that holds leases)

    @classmethod
    def default(cls, size: int = DEFAULT_POOL_SIZE) -> SandboxSource:
        """The running loop's shared source (`size` applies when this call creates it)."""
        loop = asyncio.get_running_loop()
        if loop not in _per_loop:
            _per_loop[loop] = cls(size=size)
        return _per_loop[loop]

    async def start(self) -> None:
        """Start the pool now rather than at the first acquire (no-op once started)."""
        async with self._start_lock:
            if self._owned and self.pool._closed:  # its last env closed; this one came later
                self.pool = SandboxPool(self._factory, size=self._size, reuse=self._reuse, max_size=self._max_size)
                self._started = False
            if not self._started:
                await self.pool.start()
                self._started = True

    async def acquire(self, env: object) -> Sandbox:
        self._envs.add(env)
        await self.start()
        return await self.pool.acquire()

    async def release(self, sandbox: Sandbox) -> None:
        await self.pool.release(sandbox)

    async def fresh(self) -> Sandbox:
        """A new sandbox started now, outside the pool, for one use; give it back with `done`. It is a second sandbox
        an episode needs beside the one it holds (repo_fix grades in one). Taking it from the pool could deadlock:
        with every pooled sandbox held by an episode that waits for a second, none would come back."""
        return await self._factory()

    async def done(self, sandbox: Sandbox) -> None:
        """The end of a `fresh` sandbox's use: it is closed."""
        await sandbox.close()

    async def detach(self, env: object) -> None:
        """The env is closing; an owned pool closes with its last env."""
        self._envs.discard(env)
        if self._owned and not self._envs and not self._keep_open:
            await self.pool.close()

    async def close(self) -> None:
        """Close an owned pool (for `keep_open` sources; others close with their last env)."""
        if self._owned:
            await self.pool.close()
