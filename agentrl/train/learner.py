"""The learner as the training loop drives it: `Learner`, and `LocalLearner`, the trainer in this process.

Two placements share one interface, so the loop (agentrl/train/build.py, loop.py) never asks where the ranks are:
- `LocalLearner`: this process is a learner rank (one process, or every `torchrun` rank running the loop; rank 0
  rolls out while the others wait for its broadcast);
- `RayLearner` (agentrl/train/ray_learner.py): the ranks are Ray actors running torch.distributed, and this
  process, the driver, rolls out and hands them each batch through the object store: no rank waits in a
  collective while episodes run.
"""

from __future__ import annotations

import asyncio
import functools
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from agentrl.train import checkpoint
from agentrl.train.batch import TrainBatch
from agentrl.train.diagnostics import RowRecorder
from agentrl.train.trainer import Trainer

T = TypeVar("T")


class Learner(ABC):
    lora: bool
    """the policy trains LoRA adapters (a weight sync sends only them)"""
    engine_device: str
    """where an engine in this process puts a copy of the weights it loads"""

    @property
    def shared_module(self) -> nn.Module | None:
        """The live policy an engine in this process may sample with (one unsharded process only)."""
        return None

    @abstractmethod
    async def update(
        self, batch: TrainBatch, recorder: RowRecorder | None = None, policy_version: int | None = None
    ) -> dict[str, float]:
        """M optimizer steps on `batch` (`Trainer.update`); `recorder`'s rows end up recorded here."""

    @abstractmethod
    async def engine_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """What a weight sync sends (`Trainer.engine_weights`), here on the lead (None elsewhere)."""

    @abstractmethod
    async def save(self, path: Path, state: dict[str, Any]) -> None:
        """A checkpoint of the ranks' shards, with the loop's `state` (JSON)."""

    @abstractmethod
    async def load(self, path: Path) -> dict[str, Any]:
        """Restore a checkpoint into every rank; returns its loop state."""

    @abstractmethod
    async def export(self, path: Path) -> None:
        """The policy as a plain Hugging Face folder (LoRA merged)."""

    async def close(self) -> None:  # noqa: B027 (a learner in this process holds nothing to release)
        """Release the ranks."""

    def placement(self) -> list[str]:
        """Where each rank runs (Ray node ids), for the run's log."""
        return []

    def metrics(self) -> dict[str, float]:
        """Figures for the run's metrics log, if any."""
        return {}


class LocalLearner(Learner):
    """This process's trainer (under torchrun, every rank runs the loop and calls the same methods)."""

    def __init__(self, trainer: Trainer, *, in_thread: bool) -> None:
        self.trainer = trainer
        self.lora = trainer.lora
        self.engine_device = str(trainer.device)
        self.in_thread = in_thread
        """update in a thread (asynchronous runs): the event loop goes on driving the next rollouts meanwhile
        (torch releases the GIL in its kernels)"""

    @property
    def shared_module(self) -> nn.Module | None:
        # sharded weights (FSDP2, a group of one included) cannot be sampled in place
        return None if dist.is_initialized() else self.trainer.policy

    async def update(
        self, batch: TrainBatch, recorder: RowRecorder | None = None, policy_version: int | None = None
    ) -> dict[str, float]:
        observers = (recorder,) if recorder is not None else ()
        step = functools.partial(
            self.trainer.update, batch.to(self.trainer.device), *observers, policy_version=policy_version
        )
        return await asyncio.to_thread(step) if self.in_thread else step()

    async def engine_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        return self.trainer.engine_weights(dtype)

    async def save(self, path: Path, state: dict[str, Any]) -> None:
        checkpoint.save(path, self.trainer, state)

    async def load(self, path: Path) -> dict[str, Any]:
        return checkpoint.load(path, self.trainer)

    async def export(self, path: Path) -> None:
        checkpoint.export_hf(self.trainer.scorer, path)


def broadcast(obj: T) -> T:
    """Rank 0's `obj` on every rank (itself when not distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
