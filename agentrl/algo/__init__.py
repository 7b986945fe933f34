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
from agentrl.algo.loss import OBJECTIVES, Objective, check_values, policy_loss, policy_objective, sequence_stats

__all__ = [
    "OBJECTIVES",
    "Advantages",
    "GiGPOAdvantages",
    "Objective",
    "check_values",
    "gigpo_advantages",
    "outcome_advantages",
    "per_token",
    "policy_loss",
    "policy_objective",
    "returns_to_go",
    "sequence_stats",
    "turn_advantages",
]
