"""Evaluation: greedy, sandboxed episodes on held-out tasks, scored the way training scores them.

The settings (`agentrl.eval.config`) import here at once; the evaluator (`agentrl.eval.heldout`, on the rollout
controller) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentrl.eval.config import EvalConfig

if TYPE_CHECKING:
    from agentrl.eval.heldout import EpisodeResult, EvalResult, HeldOutEval, success

_HELDOUT = ("EpisodeResult", "EvalResult", "HeldOutEval", "success")
__all__ = ["EpisodeResult", "EvalConfig", "EvalResult", "HeldOutEval", "success"]


def __getattr__(name: str) -> Any:  # PEP 562: the evaluator's names, imported on first use
    if name not in _HELDOUT:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("agentrl.eval.heldout"), name)
