"""Environments: Gymnasium's Env with chat messages in and assistant text out, tools, grading, registry."""

import importlib

from agentrl.env.base import (
    AssistantText,
    ChatMessages,
    EnvConfig,
    FailureClass,
    Message,
    ResetInfo,
    StepInfo,
    StepResult,
    TextEnv,
)
from agentrl.env.registry import EnvInfo, env_id, list_envs, make, register
from agentrl.env.sandboxes import SandboxSource

# Tools pull in transformers (for its JSON-schema builder, ~1 s): imported on first use.
_LAZY = {
    "Tool": "agentrl.env.tools",
    "ToolCall": "agentrl.env.tools",
    "ToolError": "agentrl.env.tools",
    "ToolOutput": "agentrl.env.tools",
    "tool": "agentrl.env.tools",
    "ToolEnv": "agentrl.env.tool_env",
    "ToolEnvConfig": "agentrl.env.tool_env",
    "ToolCallParser": "agentrl.env.parsers",
    "HermesParser": "agentrl.env.parsers",
    "ParsedAction": "agentrl.env.parsers",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentrl.env' has no attribute {name!r}")


__all__ = [
    "AssistantText",
    "ChatMessages",
    "EnvConfig",
    "EnvInfo",
    "FailureClass",
    "Message",
    "ResetInfo",
    "SandboxSource",
    "StepInfo",
    "StepResult",
    "TextEnv",
    "env_id",
    "list_envs",
    "make",
    "register",
    *_LAZY,
]
