"""Rank 0's rollouts, at most `algo.async_level` (k) policy versions ahead of the learner.

A producer task rolls out iterations in order into a queue; the learner takes them with `next`.
Asking for iteration i lets the producer start every rollout up to i + k: with k = 0 rollout i
starts only when the learner asks for it (rollout, update and sync take turns, as a synchronous
loop); with k = 1 rollout i + 1 samples while the learner trains on batch i, and so on. Rollout i
then starts after at least i − k weight syncs of this process and is trained after i, so its new
tokens are at most k versions old when trained; episodes waiting in the controller (parked, or
finished beside a parked one) are kept only while they stay within `rollout.max_staleness` when
trained (the controller's `ahead`), and `Run._check_staleness` checks every trained token against
the bound.

A checkpoint needs the controller between two rollouts: `quiesce` stops new ones and waits for
the one running, and returns what is queued and not trained yet (saved with the checkpoint).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Pipeline(Generic[T]):
    """The producer over `roll_out(iteration, ahead)` for iterations [first, last); `ahead`: the weight syncs
    that may still come before the learner trains that iteration's batch (the learner is on `_wanted`, and
    syncs once per iteration)."""

    def __init__(
        self, roll_out: Callable[[int, int], Awaitable[T]], *, k: int, first: int, last: int, stop: asyncio.Event
    ) -> None:
        self.k = k
        self._roll_out = roll_out
        self._first, self._last = first, last
        self._allowed = first - 1  # the last iteration the producer may start
        self._wanted = first - 1  # the last iteration the learner asked for
        self._stop = stop
        self._held = False
        self._busy = False
        self._cv = asyncio.Condition()
        self._queue: asyncio.Queue[T] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.idle_s = 0.0
        """the producer's time waiting for permission (the fleet idle but for held-out evaluation)"""

    async def __aenter__(self) -> Pipeline:
        self._task = asyncio.create_task(self._produce())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _produce(self) -> None:
        for it in range(self._first, self._last):
            t0 = time.perf_counter()
            async with self._cv:
                await self._cv.wait_for(lambda it=it: self._may_start(it))
                self._busy = True
            self.idle_s += time.perf_counter() - t0
            try:
                item = await self._roll_out(it, it - self._wanted)
            finally:
                async with self._cv:
                    self._busy = False
                    self._cv.notify_all()
            self._queue.put_nowait(item)

    def _may_start(self, it: int) -> bool:
        # once stopping, only a rollout the learner waits for (it returns at once, with what is complete)
        limit = self._wanted if self._stop.is_set() else self._allowed
        return it <= limit and not self._held

    async def next(self, iteration: int) -> T:
        """Iteration `iteration`'s rollout (waiting for it); lets the producer run up to `iteration + k`."""
        async with self._cv:
            self._wanted = iteration
            self._allowed = max(self._allowed, iteration + self.k)
            self._cv.notify_all()
        get = asyncio.ensure_future(self._queue.get())
        try:
            await asyncio.wait({get, self._task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            get.cancel()  # left waiting, it would take a rollout queued later
            raise
        if not get.done():
            get.cancel()
            self._task.result()  # the producer's error
            raise RuntimeError("the rollout producer ended before the learner's iterations did")
        return get.result()

    async def quiesce(self) -> list[T]:
        """Hold the producer between two rollouts (until `release`); the rollouts queued and not trained."""
        async with self._cv:
            self._held = True
            await self._cv.wait_for(lambda: not self._busy)
        return list(self._queue._queue)  # a snapshot: they stay queued for the learner

    async def release(self) -> None:
        async with self._cv:
            self._held = False
            self._cv.notify_all()
