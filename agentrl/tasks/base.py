"""Task records and task sets.

A *task* is one problem an episode is about: what the agent is told (`prompt`), and how its
work is judged, either hidden `tests` run against submitted code or an exact `answer`.
A *task set* is an iterable of tasks with seeded train/test splits.

Test specs say what a solution must do, not how a harness runs them: the grader
(`agentrl.env.grading`) runs them so that the solution never sees them.
"""

from __future__ import annotations

import abc
import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

Split = Literal["train", "test"]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class CallCase(_Spec):
    args: list[Any]
    """positional arguments, JSON values"""
    expected: Any
    """the expected return value, a JSON value (tuples compare equal to lists)"""


class CallTests(_Spec):
    """Call `entry_point` with each case's arguments; each case is one test."""

    kind: Literal["call"] = "call"
    entry_point: str
    """a function name, or `Class.method` (called on `Class()`, as LiveCodeBench's `Solution`)"""
    cases: list[CallCase]
    float_tol: float = 1e-6
    """floats match when within this absolute or relative tolerance"""


class AssertTests(_Spec):
    """Assert statements about `entry_point` (MBPP's shape); each statement is one test."""

    kind: Literal["assert"] = "assert"
    entry_point: str
    """the one name the statements may call into the solution; every other name is the test's own"""
    asserts: list[str]
    """one Python statement each, e.g. `assert add(1, 2) == 3`"""
    setup: str = ""
    """code run before the statements (imports, helpers); trusted, never sent to the solution"""


class CheckTests(_Spec):
    """A `check(candidate)` function (HumanEval's shape); the whole check is one test."""

    kind: Literal["check"] = "check"
    entry_point: str
    code: str
    """defines `check(candidate)`, which raises when the candidate is wrong"""
    prelude: str = ""
    """trusted code the check may use (HumanEval: the prompt, which defines helpers such as `poly`)"""


class IOCase(_Spec):
    stdin: str
    stdout: str
    """expected output; compared line by line with trailing whitespace ignored"""


class IOTests(_Spec):
    """Run the solution as a program with each case's stdin (LiveCodeBench's stdin shape)."""

    kind: Literal["io"] = "io"
    cases: list[IOCase]


class RepoTests(_Spec):
    """pytest node ids run on a repository after the agent's change (SWE-bench's shape). The repository, the hidden
    test files and the known fix are the task set's (`agentrl.tasks.repos`): too big to travel with every task."""

    kind: Literal["repo"] = "repo"
    FAIL_TO_PASS: list[str]
    """tests that fail before the fix and must pass after it"""
    PASS_TO_PASS: list[str]
    """tests that pass before and must keep passing"""


class ValueCheck(_Spec):
    """One checked expression of a value test: the outcome it must have, as the original code had it."""

    compare: Literal["==", "is", "truth"] = "=="
    """how the value is compared: `==`; `is` (None, True, False); `truth` (the value's truth, as a bare assert)"""
    value: Any = None
    """the expected value, in the grader's tagged plain-data encoding; unused with `raised`"""
    raised: str | None = None
    """the name of the exception class it must raise (that class or a subclass, as `pytest.raises`)"""


class ValueTest(_Spec):
    """A test whose code runs beside the code under test and reports only the plain values of its checked
    expressions; the verdict is the grader's, which alone holds `checks`."""

    code: str
    """defines `test()`; each checked expression is a call `__agentrl_check__(thunk, compare)`"""
    checks: list[ValueCheck]


class ValueTests(_Spec):
    """Value tests on the code the solution loads (a repository's package: the solution puts its folder on the path);
    each test is one test. What keeps a generated repository's grading out of its package's reach."""

    kind: Literal["values"] = "values"
    tests: list[ValueTest]


Tests = Annotated[CallTests | AssertTests | CheckTests | IOTests | RepoTests | ValueTests, Field(discriminator="kind")]


def test_count(tests: Tests) -> int:
    """How many tests a spec holds (a check function is one)."""
    match tests:
        case CallTests() | IOTests():
            return len(tests.cases)
        case AssertTests():
            return len(tests.asserts)
        case ValueTests():
            return len(tests.tests)
        case CheckTests():
            return 1
        case RepoTests():
            return len(tests.FAIL_TO_PASS) + len(tests.PASS_TO_PASS)


class Task(_Spec):
    """One problem. Code tasks carry `tests`; question tasks carry an exact `answer`."""

    id: str
    """unique within its task set, stable across runs (e.g. `HumanEval/0`, `procedural/strings/2/17`)"""
    prompt: str
    """what the agent is told: the problem statement, including any starter code"""
    starter_code: str = ""
    """code the solution completes or implements (a signature and docstring); may be empty"""
    tests: Tests | None = None
    """hidden tests; the agent never sees them"""
    public_tests: Tests | None = None
    """tests the agent may see and run (usually the examples in the prompt)"""
    answer: str | None = None
    """the exact expected answer of a question task, compared after stripping whitespace"""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """source, difficulty, family, ... (JSON values)"""

    @model_validator(mode="after")
    def _tests_xor_answer(self) -> Task:
        if (self.tests is None) == (self.answer is None):
            raise ValueError(f"task {self.id!r}: give exactly one of `tests` (code task) or `answer` (question task)")
        return self

    def content_hash(self) -> str:
        """A hash of what defines the task (prompt, tests, answer), independent of its id."""
        body = self.model_dump(include={"prompt", "starter_code", "tests", "answer"}, mode="json")
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def in_test_split(key: str, seed: int, test_fraction: float) -> bool:
    """Seeded, order-independent split: a key's side depends only on (seed, key).

    Adding or removing other tasks never moves a task across the split.
    """
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction


def check_split(split: str, test_fraction: float) -> None:
    """ValueError unless `split` names a side and `test_fraction` is in (0, 1): anything but "test" (say "all")
    would otherwise quietly pick the train side."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")


class TaskSet(abc.ABC):
    """An iterable of tasks.

    Set these in ALL subclasses: `name` (short, as in `--tasks`) and `description` (one line).
    `sample(rng)` draws a task with the caller's generator, so an env seeded with `reset(seed=)`
    draws the same task every time. `split("train" | "test", seed=, test_fraction=)` returns a
    disjoint part: a task in the test split never appears in the train split.
    A set that knows its tasks' solutions overrides `reference_solution` (and `sloppy_solution`
    where it knows how they are misread), for demonstrations and harness checks, never for the agent.
    """

    name: str
    description: str

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Task]: ...

    @abc.abstractmethod
    def sample(self, rng: np.random.Generator) -> Task: ...

    @abc.abstractmethod
    def split(self, split: Split, *, seed: int = 0, test_fraction: float = 0.2) -> TaskSet: ...

    @abc.abstractmethod
    def get(self, task_id: str) -> Task:
        """The task with this id; KeyError when there is none."""

    def reference_solution(self, task: Task) -> str:
        """The source of a known-correct solution of one of this set's code tasks; KeyError when it has none."""
        raise KeyError(f"{task.id}: its task set ({self.name}) ships no reference solution")

    def sloppy_solution(self, task: Task, rng: random.Random, misread: float) -> str:
        """The reference solution with plausible misreadings, each step's with probability `misread`, where the
        set knows its misreadings; the reference solution itself elsewhere."""
        return self.reference_solution(task)


class ListTaskSet(TaskSet):
    """A finite task set held in memory (what every file and dataset loader returns).

    A split is of the same class, so a subclass keeps what it adds (its reference solutions).
    """

    def __init__(self, tasks: Sequence[Task], *, name: str, description: str):
        if not tasks:
            raise ValueError(f"task set {name!r} is empty")
        self.tasks = list(tasks)
        self._by_id = {t.id: t for t in self.tasks}
        if len(self._by_id) != len(self.tasks):
            dup = next(t.id for t in self.tasks if sum(u.id == t.id for u in self.tasks) > 1)
            raise ValueError(f"task set {name!r}: duplicate task id {dup!r}")
        self.name = name
        self.description = description

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    def sample(self, rng: np.random.Generator) -> Task:
        return self.tasks[int(rng.integers(len(self.tasks)))]

    def get(self, task_id: str) -> Task:
        return self._by_id[task_id]

    def split(self, split: Split, *, seed: int = 0, test_fraction: float = 0.2) -> ListTaskSet:
        check_split(split, test_fraction)
        # Split on content, not id: a task duplicated under two ids lands on one side only.
        want_test = split == "test"
        part = [t for t in self.tasks if in_test_split(t.content_hash(), seed, test_fraction) == want_test]
        return type(self)(part, name=f"{self.name}[{split}]", description=self.description)
