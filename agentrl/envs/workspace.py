"""`workspace`: a task and a bare sandbox, the host of an agent program registered without an env.

`agentrl.register("my_agent", agent="my_pkg:run")` (no `env=`) runs `run` on tasks of this env's task set, its
commands in a fresh sandbox of the run's backend; the env grades nothing: `run` returns the reward (such an agent
grades itself).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from agentrl.env.base import EnvConfig, FailureClass, Message, StepResult, TextEnv
from agentrl.sandbox import ExecResult
from agentrl.tasks import Task


class WorkspaceConfig(EnvConfig):
    command_timeout_s: float = Field(60.0, gt=0)
    """the longest one of the agent's commands may run"""


class WorkspaceEnv(TextEnv):
    """A task set's task and a bare sandbox: hosts an agent program that grades itself."""

    description = "A task and a bare sandbox: the host of an agent program that grades itself (no env named)."
    reward_doc = "what the agent program's run returns: such an agent grades itself"
    Config = WorkspaceConfig
    cfg: WorkspaceConfig
    hosts_agents = True

    async def _reset(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.prompt}]

    async def _step(self, action: str) -> StepResult:
        return StepResult(
            observation=[{"role": "user", "content": "This env hosts agent programs: it takes no messages."}],
            failure=FailureClass.AGENT,
            error="workspace takes no messages",
            terminated=True,
        )

    async def agent_run(self, command: str) -> ExecResult:
        sandbox = await self.sandbox()
        return await self.timed(sandbox.run(["bash", "-c", command], timeout_s=self.cfg.command_timeout_s))

    async def agent_grade(self) -> tuple[float | None, dict[str, Any]]:
        self._done = True
        await self._release_sandbox()
        return None, {}
