"""Inference engines by name, imported only when asked for (as Gymnasium registers envs).

Built in: `hf` (transformers, CPU or GPU), `vllm` (in-process vLLM, GPU, extra `agentrl[vllm]`),
`openai` (any OpenAI-compatible server over HTTP, `agentrl serve` included). Other packages add
engines through the entry-point group `agentrl.engines` (`name = "pkg.module:Class"`).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
from typing import Any

from agentrl.engine.base import ContextTooLong, Generation, InferenceEngine, SamplingParams

ENTRY_POINT_GROUP = "agentrl.engines"

ENGINES: dict[str, str] = {
    "hf": "agentrl.engine.hf:HFEngine",
    "vllm": "agentrl.engine.vllm:VLLMEngine",
    "openai": "agentrl.engine.openai:OpenAIEngine",
}


class EngineNotFound(KeyError):
    """No engine is registered under that name."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


def register_engine(name: str, entry_point: str) -> None:
    """Register `"package.module:Class"` under `name`; nothing is imported until it is used."""
    ENGINES[name] = entry_point


def engine_class(name: str) -> type[InferenceEngine]:
    """The engine class registered under `name` (imported now)."""
    if name not in ENGINES:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            ENGINES.setdefault(ep.name, ep.value)
    if name not in ENGINES:
        close = difflib.get_close_matches(name, ENGINES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise EngineNotFound(f"no engine named {name!r}.{hint} Known engines: {', '.join(sorted(ENGINES))}")
    module, _, attr = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def make_engine(name: str, **kwargs: Any) -> InferenceEngine:
    """`make_engine("openai", base_url="http://127.0.0.1:8000")`: the engine's constructor gets `kwargs`."""
    return engine_class(name)(**kwargs)


__all__ = [
    "ENGINES",
    "ContextTooLong",
    "EngineNotFound",
    "Generation",
    "InferenceEngine",
    "SamplingParams",
    "engine_class",
    "make_engine",
    "register_engine",
]
