"""Agent programs as environments: an agent written outside agentrl, trained and evaluated as an env is.

`agentrl.register("my_agent", agent="my_pkg:run", env="repo_fix", **env_settings)` (`agentrl.env.registry.Agent`;
or, in a package's
pyproject, `my_agent = "my_pkg:AGENT"` under `[project.entry-points."agentrl.envs"]`, with
`AGENT = agentrl.Agent("my_pkg:run", env="repo_fix")`) declares one. `run` is

    async def run(task: AgentTask, client: openai.AsyncOpenAI, sandbox: AgentSandbox) -> float | None

any code that talks to the model only through `client` and runs its commands only through `sandbox`. In a
training run (`agentrl train --env my_agent`) or an evaluation (`agentrl eval --env my_agent`) each episode's
`client` is a session of the run's gateway (`agentrl.rollout.gateway`): every call is recorded, token for
token, into the episode's trajectory.

- **Grading.** With an env named, that env's tasks, sandboxes and grading apply: after `run` returns, the
  env grades what the agent left in the workspace exactly as its own loop grades a submission (`repo_fix`: the
  repository's diff against the hidden tests), whatever `run` returns. Without one, the `workspace` env gives a
  task and a bare sandbox, and `run` returns the reward: such an agent grades itself.
- **Where it runs.** The agent's own Python runs in the driver's process, on the driver's host, not in a
  sandbox: only the commands it sends through `sandbox` run in one. Register only code you trust as you trust
  the training script.
- **Failures.** An agent that raises, never calls the model, or outlives `rollout.agent_timeout_s` fails its
  episode (never scored, left out of the loss, counted); the run goes on and its sandbox and session are closed.
- **Resume.** Agent episodes are never parked: an iteration waits for them. An episode in flight when a run
  stops is restarted on resume (a new episode of its group), never replayed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.env.base import Message

if TYPE_CHECKING:
    import openai

    from agentrl.sandbox import ExecResult

AgentRun = Callable[["AgentTask", "openai.AsyncOpenAI", "AgentSandbox"], Awaitable[float | None]]

MODEL = "policy"
"""the model name an agent asks its client for (the policy being trained); another name is refused (404)"""

SELF_GRADED = "workspace"
"""the env an agent registered without `env=` runs on"""


@dataclass(frozen=True)
class AgentTask:
    """What an agent program is asked to do: the env's opening messages for the task, and its tools."""

    id: str
    messages: list[Message]
    """the env's opening messages (system and user), as its own loop would send them"""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """the env's tool schemas (OpenAI's format); an agent may offer its own instead"""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """The last user message: the task statement."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


class AgentSandbox:
    """The episode's workspace. `await sandbox.run(command)` runs a bash command there, as the named env's shell
    runs it (`repo_fix`: in the repository, cwd and exported variables kept between commands)."""

    def __init__(self, run: Callable[[str], Awaitable[ExecResult]]) -> None:
        self._run = run

    async def run(self, command: str) -> ExecResult:
        """Its exit code, stdout and stderr (`ExecResult`), or a timeout status."""
        if not isinstance(command, str):
            raise TypeError(f"a command is a str, got {type(command).__name__}")
        return await self._run(command)
