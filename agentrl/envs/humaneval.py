"""humaneval: HumanEval problems; each reply is a solution, graded by the problem's check function."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agentrl.env import EnvConfig, StepResult, TextEnv
from agentrl.env.base import Message
from agentrl.env.grading import extract_code, grade
from agentrl.env.parsers import without_thoughts
from agentrl.tasks import Task


class HumanEvalConfig(EnvConfig):
    tasks: str = "humaneval"
    split: str = "all"
    max_turns: int = Field(1, ge=1)
    """attempts; after a failed one (when more remain) the agent reads the test feedback and retries"""
    outcome: Literal["fraction", "all"] = "all"
    """outcome reward: the fraction of tests passed, or 1 only when all pass (HumanEval has one check per task)"""
    test_timeout_s: float = Field(10.0, gt=0)
    """wall-clock limit of the task's check"""


class HumanEvalEnv(TextEnv):
    """HumanEval, single-turn by default; with max_turns > 1, failed attempts get test feedback."""

    description = "HumanEval (164 problems): reply with the function; graded by its check. Retries with feedback."
    reward_doc = (
        "outcome (on the final attempt): 1 when the check passes, else 0 (or the fraction with outcome=fraction). "
        "Earlier failed attempts earn 0 and get feedback: tests passed and the solution's first error."
    )
    Config = HumanEvalConfig
    cfg: HumanEvalConfig

    async def _reset(self, task: Task) -> list[Message]:
        if task.tests is None:
            raise ValueError(f"humaneval needs code tasks with tests; {task.id} is a question task")
        return [{"role": "user", "content": task.prompt}]

    async def _step(self, action: str) -> StepResult:
        # A reply without a fenced block is taken as raw code (a completion or a bare function).
        code = extract_code(action) or without_thoughts(action)
        r = await self.timed(grade(await self.sandbox(), self.task, code, test_timeout_s=self.cfg.test_timeout_s))
        outcome = r.outcome(self.cfg.outcome)
        info = {"tests_passed": r.passed, "tests_total": r.total}
        if outcome == 1.0 or self.turn + 1 >= self.cfg.max_turns:
            return StepResult(reward_breakdown={"outcome": outcome}, terminated=True, info={**info, "outcome": outcome})
        feedback = f"{r.summary()}\nFix the function and reply with the whole corrected function."
        return StepResult(observation=[{"role": "user", "content": feedback}], info=info)
