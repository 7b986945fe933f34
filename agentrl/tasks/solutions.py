"""Reference solutions, where a task set knows one: for demonstrations and harness checks, never for the agent."""

from __future__ import annotations

import random

from agentrl.tasks.base import Task


def reference_solution(task: Task) -> str:
    """The source of a known-correct solution of a code task; KeyError when its task set has none."""
    source = task.metadata.get("source")
    if source == "procedural":
        from agentrl.tasks.procedural import reference_solution as procedural

        return procedural(task)
    if source == "mbpp" and "reference_solution" in task.metadata:
        return task.metadata["reference_solution"]
    if source == "humaneval" and "canonical_solution" in task.metadata:
        return task.starter_code + task.metadata["canonical_solution"]
    raise KeyError(f"{task.id}: its task set ({source or 'unknown'}) ships no reference solution")


def sloppy_solution(task: Task, rng: random.Random, misread: float) -> str:
    """The reference solution with plausible misreadings, each step's with probability `misread`, where the task
    set knows its misreadings (procedural tasks); the reference solution itself elsewhere."""
    if task.metadata.get("source") == "procedural":
        from agentrl.tasks.procedural import sloppy_solution as procedural

        return procedural(task, rng, misread)
    return reference_solution(task)
