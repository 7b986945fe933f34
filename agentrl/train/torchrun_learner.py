"""Learner ranks under torchrun: the driver is learner rank 0 of N, and ranks 1..N-1 only follow its calls.

`torchrun --nproc-per-node N -m agentrl train ...` starts N processes of one command. Rank 0 is the driver: it
runs the training loop (agentrl/train/loop.py) with a `TorchrunLearner`, and holds the engine, the rollouts and
the run folder like any driver. Every other rank runs `follow` and nothing else. All N build the same `Trainer`,
loaded and sharded over the N ranks. Then each driver call (update, engine weights, save, load, export) is its
method's name and arguments, broadcast from rank 0, and it runs on every rank at once: their collectives (FSDP2's,
the gathers of a sync or a checkpoint) need each other.

The calls travel on a gloo group of their own (pickled, as `broadcast_object_list` sends them, whatever the
training backend), whose timeout is a week: between calls the followers wait there while the driver rolls out
and evaluates, which may take longer than one collective of the training group may.
"""

from __future__ import annotations

import asyncio
import datetime
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from agentrl.train.batch import TrainBatch
from agentrl.train.config import TrainerConfig
from agentrl.train.diagnostics import RowRecorder
from agentrl.train.learner import Learner, LocalLearner
from agentrl.train.policy import init_distributed, shutdown_distributed
from agentrl.train.trainer import Trainer

CALL_WAIT = datetime.timedelta(days=7)
"""how long a follower waits for the driver's next call"""


def _join(cfg: TrainerConfig, *, threads: int | None, in_thread: bool) -> tuple[LocalLearner, ProcessGroup]:
    """Every rank: torchrun's process group, the group the calls travel on, and this rank's trainer."""
    if threads is not None:
        torch.set_num_threads(threads)
    init_distributed(cfg.model)
    try:
        calls = dist.new_group(backend="gloo", timeout=CALL_WAIT)
        torch.manual_seed(cfg.seed)
        return LocalLearner(Trainer.build(cfg), in_thread=in_thread), calls
    except BaseException:
        shutdown_distributed()
        raise


def _broadcast(call: tuple[str, tuple[Any, ...]] | None, group: ProcessGroup) -> tuple[str, tuple[Any, ...]] | None:
    """Rank 0's call on every rank (None: the driver is done)."""
    box = [call]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class TorchrunLearner(Learner):
    """Learner rank 0 of torchrun's N, in the driver's process."""

    def __init__(self, local: LocalLearner, calls: ProcessGroup) -> None:
        self.local = local
        self.lora = local.lora
        self.engine_device = local.engine_device  # rank 0's device: an engine here loads a whole copy there
        self._calls = calls
        self._lock = asyncio.Lock()  # one call at a time: every rank must run them in one order

    @classmethod
    def start(cls, cfg: TrainerConfig, *, threads: int | None, in_thread: bool) -> TorchrunLearner:
        """Join torchrun's ranks (their `follow` joins too) and build this rank's trainer."""
        return cls(*_join(cfg, threads=threads, in_thread=in_thread))

    async def _all(self, method: str, *args: Any) -> Any:
        async with self._lock:
            # in a thread: pickling a batch and waiting for every rank to take it does not hold up the rollouts
            await asyncio.to_thread(_broadcast, (method, args), self._calls)
            return await getattr(self.local, method)(*args)

    async def update(
        self, batch: TrainBatch, recorder: RowRecorder | None = None, policy_version: int | None = None
    ) -> dict[str, float]:
        return await self._all("update", batch, recorder, policy_version)  # the rows are gathered on rank 0

    async def engine_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        return await self._all("engine_weights", dtype)

    async def save(self, path: Path, state: dict[str, Any]) -> None:
        await self._all("save", path, state)

    async def load(self, path: Path) -> dict[str, Any]:
        return await self._all("load", path)

    async def export(self, path: Path) -> None:
        await self._all("export", path)

    async def close(self) -> None:
        async with self._lock:
            await asyncio.to_thread(_broadcast, None, self._calls)
        shutdown_distributed()


def follow(cfg: TrainerConfig, *, threads: int | None = None) -> None:
    """Ranks 1..N-1: build this rank's trainer, then run the driver's calls until it is done.

    Ctrl-C reaches every process torchrun started; the driver alone acts on it (it parks the rollouts, then
    saves a checkpoint, which needs these ranks), so here it is ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    local, calls = _join(cfg, threads=threads, in_thread=False)
    try:
        while (call := _broadcast(None, calls)) is not None:
            method, args = call
            asyncio.run(getattr(local, method)(*args))
    finally:
        shutdown_distributed()
