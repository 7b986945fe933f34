"""Tools: typed Python functions an agent calls by name with JSON arguments.

The JSON schema comes from the signature and the Google-style docstring, through
`transformers.utils.get_json_schema`, the same schema chat templates render; the
arguments are validated by a pydantic model built from the same signature, in pydantic's strict JSON mode:
the types the schema names, as JSON has them. `true` is not an integer, `"3"` is not a number, 3.0 is not an
integer (an int is a number); a lax coercion would hide a policy that writes its calls wrongly from the reward and
from the agent, where the strict error tells it exactly what to fix.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from transformers.utils import get_json_schema

from agentrl.env.base import FailureClass
from agentrl.sandbox import ExecResult


class ToolError(Exception):
    """Raised by a tool for bad input it can explain (e.g. a division by zero): the agent reads it."""


class ToolArgumentError(ValueError):
    """The agent called a tool with arguments that do not fit its schema."""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    arguments: dict[str, Any]


class ToolOutput(BaseModel):
    """What a tool returns when it does more than answer: rewards, or the end of the episode."""

    model_config = ConfigDict(extra="forbid")

    content: str
    reward: dict[str, float] = {}
    """named reward terms this call earned (added to the step's reward_breakdown)"""
    terminated: bool = False
    """the call ended the episode (e.g. a submission was graded)"""
    info: dict[str, Any] = {}
    """keys added to the step's info"""
    run: ExecResult | None = None
    """the sandbox run behind the result, if one: its status and streams go to the step's record of calls"""
    failure: FailureClass | None = None
    """the step's failure class when this result sets it (repo_fix's `tampered`); None: as the step goes"""


class Tool:
    """A function with a schema. `await tool(arguments)` validates, calls, and returns a ToolOutput.

    Bad arguments raise `ToolArgumentError` with a message meant for the agent.
    """

    def __init__(self, fn: Callable[..., str | ToolOutput | Awaitable[str | ToolOutput]]):
        self.fn = fn
        self.schema = get_json_schema(fn)
        self.name: str = self.schema["function"]["name"]
        self.description: str = self.schema["function"].get("description", "")
        fields = {
            p.name: (p.annotation, ... if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(fn, eval_str=True).parameters.values()
        }
        self._args = create_model(f"{self.name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)

    async def __call__(self, arguments: dict[str, Any]) -> ToolOutput:
        try:
            # arguments are parsed JSON: validated as that JSON (a list for a tuple is right there)
            args = self._args.model_validate_json(json.dumps(arguments), strict=True)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'arguments'}: {err['msg']}" for err in e.errors())
            raise ToolArgumentError(f"bad arguments for {self.name}: {problems}") from None
        out = self.fn(**{k: getattr(args, k) for k in type(args).model_fields})
        if inspect.isawaitable(out):
            out = await out
        return out if isinstance(out, ToolOutput) else ToolOutput(content=str(out))


def tool(fn: Callable) -> Callable:
    """Mark an environment method as a tool; `ToolEnv` collects the marked methods."""
    fn.__agentrl_tool__ = True
    return fn
