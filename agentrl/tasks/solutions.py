"""A scripted expert's solutions: a task set's reference solution (`TaskSet.reference_solution`), written
with a beginner's flaws where asked. For demonstrations and harness checks, never for the agent."""

from __future__ import annotations

import ast
import random

from pydantic import BaseModel, ConfigDict, Field

from agentrl.tasks.base import Task, TaskSet


def printing(code: str) -> str:
    """`code` with every `return EXPR` written `print(EXPR)`: a beginner's habit (the function then returns
    None, and an early return no longer leaves it). The rest of the source is kept as it was written."""
    lines = [line.encode() for line in code.splitlines(keepends=True)]  # AST columns count UTF-8 bytes
    returns = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Return) and n.value is not None]
    # From the last return up, so earlier positions stay valid; a return spans its own lines only.
    for node in sorted(returns, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        first, last = node.lineno - 1, node.end_lineno - 1
        text = b"".join(lines[first : last + 1])
        end = len(text) - len(lines[last]) + node.end_col_offset
        value = ast.get_source_segment(code, node.value)
        lines[first : last + 1] = [text[: node.col_offset] + f"print({value})".encode() + text[end:]]
    return b"".join(lines).decode()


class Expert(BaseModel):
    """How a scripted expert errs when it writes a task's solution; all zero: the reference solution.

    An imperfect expert's demonstrations give a starting policy something for RL to remove:
    misreadings are per step and statement, the printing habit is one decision shared by every task.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    misread: float = Field(0.0, ge=0, le=1)
    """each step it can misread (procedural tasks), it misreads with this probability"""
    prints: float = Field(0.0, ge=0, le=1)
    """with this probability a solution prints its result instead of returning it (`printing`)"""
    wrong_file: float = Field(0.0, ge=0, le=1)
    """repository tasks: with this probability it looks for the bug in the wrong file and submits no change"""
    sloppy_edit: float = Field(0.0, ge=0, le=1)
    """repository tasks: with this probability it retypes the text to replace with the whitespace wrong, so the
    edit fails, and submits no change"""
    typo_path: float = Field(0.0, ge=0, le=1)
    """repository tasks: with this probability it first names the right module with a typo, and the view fails"""
    recover: float = Field(0.0, ge=0, le=1)
    """repository tasks: after each of those errors, with this probability it recovers instead of submitting
    (views the right file, retypes the edit exactly) and goes on: a fix RL can make the habit, since the policy
    has seen it"""
    mask_errors: bool = False
    """repository tasks: its erring calls are context, not targets (`Mistake`, weight 0 in the demonstration), so a
    policy fine-tuned on it learns the recovery without the error"""

    @property
    def perfect(self) -> bool:
        return not (self.misread or self.prints or self.wrong_file or self.sloppy_edit or self.typo_path)

    def solution(self, task_set: TaskSet, task: Task, rng: random.Random) -> str:
        """This expert's solution of `task`, one of `task_set`'s (which knows its reference solution): random
        choices from `rng`, none drawn for a flaw at rate 0."""
        code = task_set.sloppy_solution(task, rng, self.misread) if self.misread else task_set.reference_solution(task)
        return printing(code) if chance(self.prints, rng) else code


def chance(rate: float, rng: random.Random) -> bool:
    """True with probability `rate`; at rate 0 nothing is drawn, so a flaw added to an expert leaves the
    demonstrations of every seed made without it unchanged."""
    return bool(rate) and rng.random() < rate


PERFECT = Expert()
"""the expert that writes the reference solution"""
