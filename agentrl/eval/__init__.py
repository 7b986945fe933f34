"""Evaluation: greedy, sandboxed episodes on held-out tasks, scored the way training scores them."""

from agentrl.eval.heldout import EpisodeResult, EvalConfig, EvalResult, HeldOutEval, success

__all__ = ["EpisodeResult", "EvalConfig", "EvalResult", "HeldOutEval", "success"]
