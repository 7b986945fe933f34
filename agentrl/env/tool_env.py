"""ToolEnv: an environment whose agent acts by calling tools."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from agentrl.env.base import EnvConfig, FailureClass, Message, StepResult, TextEnv
from agentrl.env.parsers import get_parser
from agentrl.env.tools import Tool, ToolArgumentError, ToolCall, ToolError
from agentrl.sandbox import ExecResult


class ToolEnvConfig(EnvConfig):
    parser: str = "hermes"
    """tool-call format of the model's messages (hermes = Qwen's <tool_call> JSON)"""
    malformed_penalty: float = Field(-0.1, le=0)
    """reward added per malformed call (bad JSON, unknown tool, wrong arguments) or message with no action"""
    max_calls_per_turn: int = Field(4, ge=1)
    """calls after this many in one message are not run (and penalised as malformed)"""
    max_observation_chars: int = Field(4000, ge=200)
    """a tool result longer than this is cut in the middle"""


class ToolEnv(TextEnv):
    """A TextEnv whose methods marked `@tool` are the agent's tools.

    A step parses the message's tool calls and runs them in order; each result (or the
    reason a call could not run) comes back as a `tool` message. A call that returns a
    `ToolOutput` with `terminated=True` ends the episode, and later calls in the message
    are not run. A message with no call goes to `_no_call(text)`, which each env defines
    (an answer, a submission, or a reminder).
    """

    Config = ToolEnvConfig
    cfg: ToolEnvConfig

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.parser = get_parser(self.cfg.parser)
        self.tools = {
            t.name: t for t in (Tool(getattr(self, n)) for n in dir(type(self)) if _is_tool(getattr(type(self), n)))
        }

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def _no_call(self, text: str) -> StepResult:
        raise NotImplementedError

    def malformed(self, message: str, *, role: str = "tool") -> StepResult:
        """A turn the agent wasted: its reason as an observation, the penalty as reward."""
        return StepResult(
            observation=[{"role": role, "content": f"Error: {message}"}],
            reward_breakdown={"malformed": self.cfg.malformed_penalty},
            failure=FailureClass.AGENT,
            error=message,
        )

    async def _step(self, action: str) -> StepResult:
        parsed = self.parser.parse(action)
        if not parsed.calls and not parsed.errors:
            return await self._no_call(parsed.content)
        obs: list[Message] = []
        reward: dict[str, float] = {}
        calls: list[dict[str, Any]] = []  # the record of this turn's calls (what `agentrl view` shows)
        info: dict[str, Any] = {"calls": calls}
        problems: list[str] = []
        limit = self.cfg.max_observation_chars

        def penalise(problem: str, call: ToolCall | None = None) -> None:
            problems.append(problem)
            obs.append({"role": "tool", "content": clip(f"Error: {problem}", limit)})
            reward["malformed"] = reward.get("malformed", 0.0) + self.cfg.malformed_penalty
            calls.append(_record(call, "malformed", problem, limit))

        terminated = False
        declared: FailureClass | None = None  # a tool's own verdict on the step (ToolOutput.failure)
        i = 0  # calls read so far
        for call in parsed.written:  # in the message's order: a chat template pairs results with calls by position
            if isinstance(call, str):
                penalise(call)
                continue
            tool, i = self.tools.get(call.name), i + 1
            if i > self.cfg.max_calls_per_turn:
                penalise(f"at most {self.cfg.max_calls_per_turn} tool calls per message; {call.name} was not run", call)
            elif tool is None:
                penalise(f"there is no tool {call.name!r}; the tools are {sorted(self.tools)}", call)
            else:
                try:
                    out = await tool(call.arguments)
                except ToolArgumentError as e:
                    penalise(str(e), call)
                    continue
                except ToolError as e:  # the tool explains a problem with valid input: a normal result
                    obs.append({"role": "tool", "content": clip(f"Error: {e}", limit)})
                    calls.append(_record(call, "error", str(e), limit))
                    continue
                obs.append({"role": "tool", "content": clip(out.content, limit)})
                calls.append(_record(call, "ok", out.content, limit, out.run))
                for name, value in out.reward.items():
                    reward[name] = reward.get(name, 0.0) + value
                info.update(out.info)
                declared = out.failure or declared
                if out.terminated:
                    terminated = True
                    break
        failure = declared or (FailureClass.AGENT if problems else FailureClass.OK)
        error = "; ".join(problems) if problems else None
        return StepResult(
            observation=obs, reward_breakdown=reward, terminated=terminated, failure=failure, error=error, info=info
        )


def _record(
    call: ToolCall | None, status: str, output: str, limit: int, run: ExecResult | None = None
) -> dict[str, Any]:
    """One call as the record keeps it: texts clipped like observations."""
    args = {k: clip(v, limit) if isinstance(v, str) else v for k, v in call.arguments.items()} if call else None
    rec = {"tool": call.name if call else None, "arguments": args, "status": status, "output": clip(output, limit)}
    if run is not None:
        rec["run"] = {
            "status": run.status.value,
            "exit_code": run.exit_code,
            "stdout": clip(run.stdout, limit),
            "stderr": clip(run.stderr, limit),
            "wall_s": round(run.wall_s, 4),
        }
    return rec


def _is_tool(attr: Any) -> bool:
    return getattr(attr, "__agentrl_tool__", False)


def clip(text: str, limit: int) -> str:
    """Keep the head and the tail (where errors and results are) of a long text."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"
