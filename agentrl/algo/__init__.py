"""Algorithms: pure functions on tensors (losses, advantage estimators), the equations in their docstrings."""

from agentrl.algo.advantages import (
    Advantages,
    GiGPOAdvantages,
    gigpo_advantages,
    outcome_advantages,
    per_token,
    returns_to_go,
    turn_advantages,
)
from agentrl.algo.loss import OBJECTIVES, Objective, policy_loss, sequence_stats

__all__ = [
    "OBJECTIVES",
    "Advantages",
    "GiGPOAdvantages",
    "Objective",
    "gigpo_advantages",
    "outcome_advantages",
    "per_token",
    "policy_loss",
    "returns_to_go",
    "sequence_stats",
    "turn_advantages",
]
