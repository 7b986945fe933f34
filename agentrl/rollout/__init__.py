"""Rollouts: environments plus an inference engine, turned into token-exact trajectories."""

from agentrl.rollout.chat import ChatFormat, TemplatePrefixError
from agentrl.rollout.config import EnvWorkersConfig, RolloutConfig
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
