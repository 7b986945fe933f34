"""Weight sync: how the learner's new weights reach the engine after an update, chosen once when the run
is built, from what the engine declares (`InferenceEngine.capabilities`) and whether the policy trains LoRA.

- `SharedModule`: the engine samples with the learner's own module (one process): the update runs
  inside `engine.paused(new_version=True)`, which moves the policy version as it ends;
- `LoraAdapter`: only the adapter's tensors are sent;
- `FullState`: the full state dict, gathered from the shards.

The driver makes it and calls it; the learner gathers what it sends from its ranks.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import ClassVar

import torch

from agentrl.engine.base import InferenceEngine
from agentrl.train.learner import Learner

WIRE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "bfloat16_weights": torch.bfloat16,
}
"""an engine's declared dtype (`Capabilities.dtype`) -> what its weights are sent in (bfloat16_weights: the
engine rounds its weights to bfloat16, so bfloat16 carries them exactly)"""


class WeightSync(ABC):
    in_place: ClassVar[bool] = False
    """the engine samples the learner's own module: it never holds weights of its own to refresh"""

    def __init__(self, learner: Learner, engine: InferenceEngine) -> None:
        self.learner = learner
        self.engine = engine
        self.dtype = WIRE_DTYPES.get(engine.capabilities.dtype)
        """what the tensors travel in: the engine's own dtype (it would cast them on arrival); None: as trained"""

    def updating(self) -> AbstractContextManager[None]:
        """Wraps the update: what the engine must not do meanwhile."""
        return contextlib.nullcontext()

    @abstractmethod
    async def push(self) -> int:
        """Hand the updated weights to the engine; returns its new policy version."""


class FullState(WeightSync):
    async def push(self) -> int:
        return await self.engine.update_weights(await self.learner.engine_weights(self.dtype))


class LoraAdapter(WeightSync):
    async def push(self) -> int:
        return await self.engine.update_weights(lora=await self.learner.engine_weights(self.dtype))


class SharedModule(WeightSync):
    in_place = True

    def __init__(self, learner: Learner, engine: InferenceEngine) -> None:
        super().__init__(learner, engine)
        self._moved = False  # an update moved the engine's version since the last push

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        # no decode step reads the weights while the optimizer writes them, and the first after it is the new version's
        with self.engine.paused(new_version=True):
            yield
        self._moved = True

    async def push(self) -> int:
        """The version the update moved the engine to; with no update since the last push (a resume: the module
        holds the checkpoint's weights, the engine starts a version behind), the move is now."""
        if self._moved:
            self._moved = False
            return self.engine.version
        return await self.engine.update_weights()


def weight_sync(learner: Learner, engine: InferenceEngine) -> WeightSync:
    """The sync for this learner and engine (a started one: its capabilities are known)."""
    if engine.capabilities.shares_module:
        if not engine.capabilities.pausable:
            raise ValueError(
                f"the {engine.name} engine shares the learner's module but cannot pause: an update "
                "would change weights under a decode step"
            )
        return SharedModule(learner, engine)
    kind = "lora" if learner.lora else "full"
    if kind not in engine.capabilities.weight_updates:
        takes = ", ".join(sorted(engine.capabilities.weight_updates)) or "no tensors"
        raise ValueError(
            f"the {engine.name} engine takes {takes} as weight updates, and this run sends "
            f"{'LoRA adapters' if kind == 'lora' else 'full state dicts'}"
        )
    return LoraAdapter(learner, engine) if kind == "lora" else FullState(learner, engine)
