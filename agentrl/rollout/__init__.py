"""Rollouts: environments plus an inference engine, turned into token-exact trajectories.

The settings (`agentrl.rollout.config`) import here at once; the rest (the controller, the chat format, the
env-worker pools: torch, transformers and Ray) on first use, so that a run's config loads and is checked in a
fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentrl.rollout.config import EnvWorkersConfig, RolloutConfig

if TYPE_CHECKING:
    from agentrl.rollout.chat import ChatFormat, TemplatePrefixError
    from agentrl.rollout.controller import (
        ControllerState,
        Group,
        ParkedEpisode,
        RolloutBatch,
        RolloutController,
        RolloutStats,
    )
    from agentrl.rollout.pool import EnvWorkerHandle, EnvWorkerPool, WorkerDied, WorkerError
    from agentrl.rollout.trajectory import Segment, Status, Trajectory, TrajectoryError, Turn

_LAZY = {
    "agentrl.rollout.chat": ["ChatFormat", "TemplatePrefixError"],
    "agentrl.rollout.controller": [
        "ControllerState",
        "Group",
        "ParkedEpisode",
        "RolloutBatch",
        "RolloutController",
        "RolloutStats",
    ],
    "agentrl.rollout.pool": ["EnvWorkerHandle", "EnvWorkerPool", "WorkerDied", "WorkerError"],
    "agentrl.rollout.trajectory": ["Segment", "Status", "Trajectory", "TrajectoryError", "Turn"],
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

__all__ = [
    "ChatFormat",
    "ControllerState",
    "EnvWorkerHandle",
    "EnvWorkerPool",
    "EnvWorkersConfig",
    "Group",
    "ParkedEpisode",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutController",
    "RolloutStats",
    "Segment",
    "Status",
    "TemplatePrefixError",
    "Trajectory",
    "TrajectoryError",
    "Turn",
    "WorkerDied",
    "WorkerError",
]


def __getattr__(name: str) -> Any:  # PEP 562: the names above, imported on first use
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
