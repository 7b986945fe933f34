"""code_sandbox: write a Python solution over several turns, running code and the examples, then submit it."""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field

from agentrl.env import StepResult, ToolEnv, ToolEnvConfig
from agentrl.env.base import Message
from agentrl.env.grading import assemble_solution, extract_code, grade, run_tests
from agentrl.env.tools import ToolCall, ToolError, ToolOutput, tool
from agentrl.envs._format import run_output
from agentrl.tasks import Task
from agentrl.tasks.solutions import PERFECT, Expert

SYSTEM = """You are solving a Python programming task in a sandbox. You have {turns} turns.
Each turn, call one or more tools:
- run_python(code): run code and read its output;
- run_tests(code): run your solution against the task's examples;
- submit(code): submit your complete solution. It is graded on hidden tests and ends the task.
Only submitted code is graded. Submit before your turns run out."""


class CodeSandboxConfig(ToolEnvConfig):
    outcome: Literal["fraction", "all"] = "fraction"
    """outcome reward: the fraction of hidden tests passed, or 1 only when all pass"""
    public_tests_reward: float = Field(0.1, ge=0)
    """shaping: this much in total, split over the public tests, paid the first time each passes in run_tests"""
    run_timeout_s: float = Field(10.0, gt=0)
    """wall-clock limit of one run_python call"""
    test_timeout_s: float = Field(5.0, gt=0)
    """wall-clock limit of one test (hidden or public)"""
    persistent: bool = False
    """run_python keeps variables between calls (a notebook) instead of a fresh process per call"""
    code_block_submits: bool = True
    """a message with no tool call but a ```python block submits that block"""


class CodeSandboxEnv(ToolEnv):
    """Multi-turn coding: run code and the examples in a sandbox, then submit for hidden tests."""

    description = "Multi-turn Python coding in a Docker sandbox; the submission is graded on hidden tests."
    reward_doc = (
        "outcome (on submit): fraction of hidden tests passed (or 1/0 with outcome=all); "
        "public_tests: public_tests_reward/n for each example test passing for the first time in run_tests; "
        "malformed: malformed_penalty per bad tool call or message without an action. "
        "No submission within max_turns: truncated, no outcome."
    )
    Config = CodeSandboxConfig
    cfg: CodeSandboxConfig

    async def _reset(self, task: Task) -> list[Message]:
        if task.tests is None or task.tests.kind == "repo":
            what = "a question task" if task.tests is None else "a repository task (use repo_fix)"
            raise ValueError(f"code_sandbox needs function-level code tasks with tests; {task.id} is {what}")
        self._public_passed: set[int] = set()
        return [
            {"role": "system", "content": SYSTEM.format(turns=self.cfg.max_turns)},
            {"role": "user", "content": task.prompt},
        ]

    async def _step(self, action: str) -> StepResult:
        result = await super()._step(action)
        if not result.terminated and self.turn + 2 == self.cfg.max_turns:
            result.observation.append({"role": "user", "content": "One turn left: submit your solution now."})
        return result

    @tool
    async def run_python(self, code: str) -> ToolOutput:
        """Run Python code in your sandbox and return its exit status and output.

        Args:
            code: Python source to run.
        """
        sandbox = await self.sandbox()
        run = sandbox.run_cell if self.cfg.persistent else sandbox.run_python
        return run_output(await self.timed(run(code, timeout_s=self.cfg.run_timeout_s)))

    @tool
    async def run_tests(self, code: str) -> ToolOutput:
        """Run a complete solution against the task's example tests and report which pass.

        Args:
            code: The complete solution (the function with its imports).
        """
        if self.task.public_tests is None:
            raise ToolError("this task has no example tests; test your code with run_python")
        sandbox = await self.sandbox()
        solution = assemble_solution(self.task, code)
        r = await self.timed(
            run_tests(sandbox, self.task.public_tests, solution, test_timeout_s=self.cfg.test_timeout_s)
        )
        lines = [f"{r.passed}/{r.total} example tests passed."]
        if r.load_error:
            lines.append(f"Your code failed before the tests ran:\n{r.load_error}")
        lines += [f"example {i + 1}: {o.error}" for i, o in enumerate(r.outcomes) if not o.passed and not r.load_error]
        if r.output:
            lines.append(f"your code printed:\n{r.output}")
        newly = {i for i, o in enumerate(r.outcomes) if o.passed} - self._public_passed
        self._public_passed |= newly
        shaping = self.cfg.public_tests_reward * len(newly) / r.total if r.total else 0.0
        return ToolOutput(content="\n".join(lines), reward={"public_tests": shaping} if newly else {})

    @tool
    async def submit(self, code: str) -> ToolOutput:
        """Submit your complete solution. It is graded on hidden tests and the task ends.

        Args:
            code: The complete solution (the function with its imports).
        """
        sandbox = await self.sandbox()
        await self.timed(sandbox.reset_session())  # nothing of the agent's may run beside the grader
        r = await self.timed(grade(sandbox, self.task, code, test_timeout_s=self.cfg.test_timeout_s))
        outcome = r.outcome(self.cfg.outcome)
        return ToolOutput(
            content=r.summary(),
            reward={"outcome": outcome},
            terminated=True,
            info={"outcome": outcome, "tests_passed": r.passed, "tests_total": r.total},
        )

    def demonstration(self, task: Task, rng: random.Random, *, expert: Expert = PERFECT) -> list[str]:
        """Submit the expert's solution (the task set's reference one, or with the imperfect expert's mistakes); half
        the time run it on the examples first. Either way it submits what it wrote, whatever the examples said."""
        code = expert.solution(self.task_set, task, rng)
        submit = self.parser.format(ToolCall(name="submit", arguments={"code": code}))
        if task.public_tests is not None and self.cfg.max_turns > 1 and rng.random() < 0.5:
            return [self.parser.format(ToolCall(name="run_tests", arguments={"code": code})), submit]
        return [submit]

    async def _no_call(self, text: str) -> StepResult:
        code = extract_code(text) if self.cfg.code_block_submits else None
        if code is None:
            return self.malformed(
                "no tool call found. Call run_python, run_tests or submit in <tool_call> tags.", role="user"
            )
        out = await self.tools["submit"]({"code": code})
        return StepResult(
            observation=[{"role": "user", "content": out.content}],
            reward_breakdown=out.reward,
            terminated=True,
            info=out.info,
        )
