"""Grading: run a task's hidden tests on submitted code, in the sandbox, out of the code's reach.

Function-level tests (call / assert / check) go to `sandboxes/programs/grader.py` in one
sandbox call: a non-dumpable grader process holds the tests and judges; the solution runs
in a separate worker process and only plain data crosses between them (see that file for
why each reward hack fails). Program-level tests (io) run the solution once per case with
the case's stdin and compare its stdout here, on the host, so the expected output never
enters the sandbox.

The hidden tests must be the last thing a sandbox sees before the agent's code runs there
again in an executor-forked process: the executor's memory may still hold the request.
The built-in envs grade hidden tests only at the end of an episode, or with no agent code
running in between (the worker is a fresh exec, so it inherits nothing).

Infrastructure failures raise `SandboxError` (the caller marks the episode failed); a broken
task (its own setup code raises) raises `TaskError`. Everything else is a `GradeResult`.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from agentrl.env.parsers import without_thoughts
from agentrl.sandbox import Sandbox, SandboxError
from agentrl.sandbox.image import sandboxes_dir
from agentrl.tasks import IOTests, RepoTests, Task, Tests, test_count


class TaskError(RuntimeError):
    """The task itself is broken (its test setup raises): no solution can pass it."""


class TestOutcome(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    passed: bool
    error: str | None = None
    """why it failed; solution-side errors only, never the test's expected values"""
    where: Literal["solution", "test", "timeout", "crash", "output"] | None = None
    """solution: it raised; test: wrong answer; timeout; crash: its process died or hung the
    channel; output: a program's stdout differed"""


class GradeResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    outcomes: list[TestOutcome]
    load_error: str | None = None
    """the solution failed before any test ran (raised or exited at import)"""
    output: str = ""
    """the solution's own prints (capped)"""
    grader_status: str = "ok"
    """the grader's sandbox status; not ok when the solution killed, starved or outran it"""

    @property
    def passed(self) -> int:
        return sum(o.passed for o in self.outcomes)

    @property
    def total(self) -> int:
        return len(self.outcomes)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def outcome(self, rule: Literal["fraction", "all"]) -> float:
        """The outcome reward: the fraction of tests passed, or 1.0 only when all pass."""
        return self.fraction if rule == "fraction" else float(self.passed == self.total)

    def summary(self) -> str:
        """What the agent may read: counts and the solution's own first error, no test content."""
        head = f"{self.passed}/{self.total} tests passed."
        if self.load_error:
            return f"{head} Your code failed before any test ran:\n{self.load_error}"
        if self.grader_status != "ok":
            return f"{head} Grading was cut short ({self.grader_status}) by your code."
        first = next((o for o in self.outcomes if not o.passed), None)
        if first is None:
            return head
        detail = {"test": "a wrong answer", "timeout": "a timeout", "output": "wrong output"}.get(first.where or "")
        return f"{head} First failure: {detail or first.error}"


@functools.cache
def grader_source() -> str:
    return (sandboxes_dir() / "programs" / "grader.py").read_text()


_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str | None:
    """The last fenced code block of a message (```python ... ```) outside its thoughts, or None if it has none."""
    blocks = _FENCE.findall(without_thoughts(text))
    return blocks[-1] if blocks else None


def top_level_names(code: str) -> set[str] | None:
    """Names a module binds at top level (functions, classes, assignments); None if it won't parse."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def assemble_solution(task: Task, code: str) -> str:
    """The program to grade from what the agent submitted.

    Two submission styles are accepted, as HumanEval's completions and chat models' full
    functions: code that defines the entry point gets the starter code's imports put in
    front (chat answers often drop `from typing import List`); code that does not is taken
    as the continuation of the starter code (a function body) and appended to it.
    """
    entry = getattr(task.tests, "entry_point", None)
    if entry is None or not task.starter_code:
        return code
    defined = top_level_names(code)
    if defined is not None and entry.partition(".")[0] in defined:
        # Top-level import lines, read as text: starter code may not parse (LiveCodeBench's ends in an empty body).
        imports = [line for line in task.starter_code.splitlines() if re.match(r"(import|from)\s", line)]
        return "\n".join([*imports, code]) if imports else code
    return task.starter_code.rstrip("\n") + "\n" + code


async def run_tests(
    sandbox: Sandbox, tests: Tests, solution: str, *, test_timeout_s: float = 5.0, max_total_s: float = 120.0
) -> GradeResult:
    """Run `tests` against `solution` (an assembled program) and report each test's outcome."""
    if isinstance(tests, RepoTests):
        raise ValueError("repository tasks are graded on a repository, not a solution: use the repo_fix env")
    if isinstance(tests, IOTests):
        return await _run_io(sandbox, tests, solution, test_timeout_s)
    request = {"solution": solution, "tests": tests.model_dump(mode="json"), "test_timeout_s": test_timeout_s}
    n = test_count(tests)
    # One test may spend test_timeout_s in its call and as much again restarting a crashed worker.
    timeout_s = min(max_total_s, 2 * test_timeout_s * (n + 1) + 5.0)
    r = await sandbox.run_python(grader_source(), stdin=json.dumps(request), timeout_s=timeout_s)
    if not r.ok:  # the solution killed the grader, or exhausted its time or memory
        cut = TestOutcome(passed=False, error=f"grading ended early: {r.status}", where="crash")
        return GradeResult(outcomes=[cut] * n, grader_status=str(r.status))
    try:
        report = json.loads(r.stdout)
    except ValueError as e:  # the grader always prints a report when it exits 0
        raise SandboxError(f"grader printed no report: {r.stdout[:200]!r} {r.stderr[-500:]!r}") from e
    if "task_error" in report:
        raise TaskError(report["task_error"])
    return GradeResult(
        outcomes=[TestOutcome(**o) for o in report["tests"]], load_error=report["load_error"], output=report["output"]
    )


def _lines(text: str) -> list[str]:
    """Output as judges compare it: trailing whitespace and trailing blank lines ignored."""
    return [line.rstrip() for line in text.rstrip().splitlines()]


async def _run_io(sandbox: Sandbox, tests: IOTests, solution: str, test_timeout_s: float) -> GradeResult:
    outcomes = []
    output = ""
    for case in tests.cases:
        r = await sandbox.run_python(solution, stdin=case.stdin, timeout_s=test_timeout_s)
        output = output or r.stderr[-2000:]
        if not r.ok:
            where = "timeout" if r.status == "timeout" else "solution"
            error = r.stderr.strip().splitlines()[-1:] or [str(r.status)]
            outcomes.append(TestOutcome(passed=False, error=error[0][:2000], where=where))
        elif _lines(r.stdout) != _lines(case.stdout):
            outcomes.append(TestOutcome(passed=False, error="wrong output", where="output"))
        else:
            outcomes.append(TestOutcome(passed=True))
    return GradeResult(outcomes=outcomes, output=output)


async def grade(sandbox: Sandbox, task: Task, code: str, **kw) -> GradeResult:
    """Assemble the submitted code (`assemble_solution`) and run the task's hidden tests."""
    if task.tests is None:
        raise ValueError(f"task {task.id!r} is a question task: check it with check_answer")
    return await run_tests(sandbox, task.tests, assemble_solution(task, code), **kw)


def check_answer(task: Task, answer: str) -> bool:
    """Exact match of a question task's answer, ignoring surrounding whitespace."""
    if task.answer is None:
        raise ValueError(f"task {task.id!r} is a code task: it has tests, not an answer")
    return answer.strip() == task.answer.strip()
