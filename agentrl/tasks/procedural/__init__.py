"""Procedural Python coding tasks with hidden tests, in unbounded supply.

A task asks for one function, stated as a numbered list of steps (or a recurrence). Each step
is a primitive with random parameters, said three ways: an English sentence (the statement),
a Python expression (the reference solution's source) and a callable (which computes the
expected values). Tests check that the source and the callable agree on every case.

Layout, bottom up: `steps` holds what every family builds with (steps, conditions on integers,
programs, pipelines). Each family is one module drawing a program and its test inputs for a
level: `strings`, `lists`, `numbers`, `counting` (which reuses the lists family's steps before
its count or search) and `sequences`. `draft` dispatches on the family, redraws until a program
is fit and chooses its hidden and public cases (how strictly: its docstring). This module turns
a draft into a `Task`, and regenerates a task's program from its id for its reference solution.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Sequence
from typing import Any, Literal

from agentrl.tasks._generated import GeneratedTaskSet, task_rng
from agentrl.tasks.base import CallCase, CallTests, Task
from agentrl.tasks.procedural.draft import _FAMILIES, MAX_CASES, _choose, _draft
from agentrl.tasks.procedural.steps import _Program
from agentrl.tasks.solutions import printing

__all__ = ["ProceduralCodeTasks", "reading"]


def _call(entry_point: str, args: list[Any]) -> str:
    return f"{entry_point}({', '.join(map(repr, args))})"


class ProceduralCodeTasks(GeneratedTaskSet):
    """Write one small Python function, graded by hidden call tests.

    Families: strings (str -> str steps), lists (list -> list steps), numbers (int -> int steps),
    counting (list steps, then a count or search), sequences (the n-th term of a recurrence).
    Level = number of steps: 1, 2 or 3 (counting: a compound condition counts as a step;
    sequences: 1 is first order, 2 second order, 3 up to third order modulo m). Level 1 has
    only dozens of statements per family (tasks differ in their test inputs; a split keeps
    each statement on one side); levels 2 and 3 have far more. With the default 10 hidden
    cases, no expected value filled more than half of them in 1500 tasks measured, so no
    constant passes. A task takes about 1 ms to build.
    """

    name = "procedural"
    description = "generated Python functions (strings, lists, numbers, counting, recurrences), hidden call tests"
    FAMILIES = tuple(_FAMILIES)

    def __init__(
        self,
        *,
        families: Sequence[str] | None = None,
        levels: Sequence[int] | None = None,
        n_hidden: int = 10,
        n_public: int = 2,
    ):
        super().__init__(families=families, levels=levels)
        if n_hidden < 1 or n_public < 0 or n_hidden + n_public > MAX_CASES:
            raise ValueError(f"need n_hidden >= 1, n_public >= 0, n_hidden + n_public <= {MAX_CASES}")
        self.n_hidden = n_hidden
        self.n_public = n_public

    def split_key(self, task: Task) -> str:
        """The statement (starter code: signature and docstring), not the test inputs: two tasks
        asking for the same function land on the same side, so a held-out problem is never
        trained on with other inputs."""
        return hashlib.sha256(task.starter_code.encode()).hexdigest()

    def _build(self, task_id: str, family: str, level: int, rng: random.Random) -> Task:
        program, cases = _draft(family, level, rng)
        hidden, public = _choose(cases, self.n_hidden, self.n_public)
        entry = program.entry_point
        starter = program.starter()
        examples = "".join(f"{_call(entry, c.args)} == {c.expected!r}\n" for c in public)
        prompt = (
            "Implement this Python function; hidden tests check it, edge cases included.\n\n"
            f"```python\n{starter}```\n" + (f"\nExamples:\n{examples}" if examples else "")
        )
        return Task(
            id=task_id,
            prompt=prompt,
            starter_code=starter,
            tests=CallTests(entry_point=entry, cases=[CallCase(args=c.args, expected=c.expected) for c in hidden]),
            public_tests=CallTests(
                entry_point=entry, cases=[CallCase(args=c.args, expected=c.expected) for c in public]
            )
            if public
            else None,
            metadata={"family": family, "level": level, "source": "procedural"},
        )

    def reference_solution(self, task: Task) -> str:
        """The source of a correct solution to a procedural task, regenerated from its id (KeyError if not one)."""
        return _program(task).source()

    def sloppy_solution(self, task: Task, rng: random.Random, misread: float) -> str:
        """A solution as a sloppy reader writes it: each step that has a plausible misreading (rotating right for
        left, truncating for floor division, `>=` for "greater than", ...) is misread with probability `misread`.
        The hidden tests tell every such misreading apart where some input can."""
        return _program(task).sloppy_source(rng, misread)


def _program(task: Task) -> _Program:
    family, level, n = ProceduralCodeTasks._parse(task.id)
    return _draft(family, level, task_rng(ProceduralCodeTasks.name, family, level, n))[0]


def reading(task: Task, code: str) -> Literal["reference", "misread", "printed", "other"]:
    """How a solution relates to its task, by source (whitespace aside): the reference solution, the
    reference with one or more steps misread as `ProceduralCodeTasks.sloppy_solution` writes them, either
    of those with its result printed instead of returned (`solutions.printing`), or something else (a wrong
    constant, another operation: an error of capability rather than of reading)."""
    program, squash = _program(task), (lambda s: "".join(s.split()))
    mine = squash(code)
    if mine == squash(program.source()):
        return "reference"
    sources = [program.source(v) for v in itertools.product(*program.misread_bodies)]  # the reference among them
    if mine in {squash(s) for s in sources}:
        return "misread"
    return "printed" if mine in {squash(printing(s)) for s in sources} else "other"
