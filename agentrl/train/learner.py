"""The learner as the training loop's driver sees it: `Learner`, and `LocalLearner`, the trainer in this process.

The driver (the one process that runs the loop: rollouts, logging, checkpoints, the engine) hands batches out
and gets metrics and weights back through `Learner` alone, wherever the ranks are:
- `LocalLearner`: the trainer in this process (a plain module, or FSDP2 over a group of one for bf16 mixed
  precision or CPU offload);
- `TorchrunLearner` (agentrl/train/torchrun_learner.py): under `torchrun`, this process is learner rank 0 of N
  and the other ranks wait for its calls;
- `RayLearner` (agentrl/train/ray_learner.py): the ranks are Ray actors.

Each call is made by the driver once; a learner of several ranks runs it on every rank at once (their
collectives need each other) and answers with rank 0's result.
"""

from __future__ import annotations

import asyncio
import functools
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agentrl.train import checkpoint
from agentrl.train.batch import TrainBatch
from agentrl.train.config import TrainerConfig
from agentrl.train.diagnostics import RowRecorder
from agentrl.train.policy import init_distributed, needs_fsdp, shutdown_distributed
from agentrl.train.trainer import Trainer


class Learner(ABC):
    lora: bool
    """the policy trains LoRA adapters (a weight sync sends only them)"""
    engine_device: str
    """where an engine in the driver's process puts a copy of the weights it loads"""

    @property
    def shared_module(self) -> nn.Module | None:
        """The live policy an engine in the driver's process may sample with (one unsharded process only)."""
        return None

    @abstractmethod
    async def update(
        self, batch: TrainBatch, recorder: RowRecorder | None = None, policy_version: int | None = None
    ) -> dict[str, float]:
        """M optimizer steps on `batch` (`Trainer.update`); `recorder`'s rows end up recorded here."""

    @abstractmethod
    async def engine_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """What a weight sync sends (`Trainer.engine_weights`): the whole state, or the LoRA adapter (None on a
        rank other than 0 of several)."""

    @abstractmethod
    async def save(self, path: Path, state: dict[str, Any]) -> None:
        """A checkpoint of the ranks' shards, with the loop's `state` (JSON)."""

    @abstractmethod
    async def load(self, path: Path) -> dict[str, Any]:
        """Restore a checkpoint into every rank; returns its loop state."""

    @abstractmethod
    async def export(self, path: Path) -> None:
        """The policy as a plain Hugging Face folder (LoRA merged)."""

    async def close(self) -> None:  # noqa: B027 (a plain module in this process holds nothing to release)
        """Release the ranks."""

    def placement(self) -> list[str]:
        """Where each rank runs (Ray node ids), for the run's log."""
        return []

    def metrics(self) -> dict[str, float]:
        """Figures for the run's metrics log, if any."""
        return {}


class LocalLearner(Learner):
    """This process's trainer: the whole learner, or one rank of several (`TorchrunLearner`, a Ray actor's)."""

    def __init__(self, trainer: Trainer, *, in_thread: bool, group: bool = False) -> None:
        self.trainer = trainer
        self.lora = trainer.lora
        self.engine_device = str(trainer.device)
        self.in_thread = in_thread
        """update in a thread (asynchronous runs): the event loop goes on driving the next rollouts meanwhile
        (torch releases the GIL in its kernels)"""
        self._group = group  # the process group of one that `start` joined, left on `close`

    @classmethod
    def start(cls, cfg: TrainerConfig, *, in_thread: bool) -> LocalLearner:
        """The trainer in this process; FSDP2's policies (bf16 mixed precision, CPU offload) shard it over a
        process group of one, joined here."""
        group = needs_fsdp(cfg.model)
        if group:
            init_distributed(cfg.model)
        try:
            return cls(Trainer.build(cfg), in_thread=in_thread, group=group)
        except BaseException:
            if group:
                shutdown_distributed()
            raise

    @property
    def shared_module(self) -> nn.Module | None:
        # sharded weights (FSDP2, a group of one included) cannot be sampled in place; compiled MLPs would recompile
        # for the engine's shapes under inference mode
        return None if dist.is_initialized() or self.trainer.cfg.model.compile else self.trainer.policy

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

    async def close(self) -> None:
        if self._group:
            shutdown_distributed()
            self._group = False
