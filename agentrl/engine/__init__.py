"""Inference engines by name, imported only when asked for (as Gymnasium registers envs), and the one
factory every command builds them with.

Built in: `hf` (transformers, CPU or GPU), `vllm` (in-process vLLM, GPU, extra `agentrl[vllm]`),
`openai` (any OpenAI-compatible server over HTTP, `agentrl serve` included); several of them behind one
engine (`engine.replicas`, `engine.base_urls`: `agentrl.engine.fleet`). Other packages add
engines through the entry-point group `agentrl.engines` (`name = "pkg.module:Class"`, a class
implementing `InferenceEngine.from_config`); `agentrl train` (`engine.kind`) and `agentrl eval`
(`--engine`) then build them like the built-in ones.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata

from agentrl.engine.base import Capabilities, ContextTooLong, Generation, InferenceEngine, SamplingParams
from agentrl.engine.config import EngineConfig, EngineModel

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


def engine_entry_point(name: str) -> str:
    """`"package.module:Class"` of the engine registered under `name` (built in, registered, or from the
    entry points of installed packages); an unknown name names the known ones and a close match."""
    if name not in ENGINES:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            ENGINES.setdefault(ep.name, ep.value)
    if name not in ENGINES:
        close = difflib.get_close_matches(name, ENGINES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise EngineNotFound(f"no engine named {name!r}.{hint} Known engines: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]


def engine_class(name: str) -> type[InferenceEngine]:
    """The engine class registered under `name` (imported now)."""
    module, _, attr = engine_entry_point(name).partition(":")
    return getattr(importlib.import_module(module), attr)


def _engine_type(cfg: EngineConfig) -> type[InferenceEngine]:
    if cfg.replicas is not None or cfg.base_urls:
        from agentrl.engine.fleet import Fleet

        return Fleet
    return engine_class(cfg.kind)


def build_engine(cfg: EngineConfig, model: EngineModel, *, version: int = 0, seed: int = 0) -> InferenceEngine:
    """The engine `cfg` names, serving `model`, from policy `version` on (not started: `async with` it); with
    `engine.replicas` or `engine.base_urls`, a `Fleet` of them behind one engine (`agentrl.engine.fleet`)."""
    return _engine_type(cfg).from_config(cfg, model, version=version, seed=seed)


def engine_unavailable(cfg: EngineConfig) -> str | None:
    """Why the engine `build_engine(cfg, ...)` would build cannot run here, or None (`InferenceEngine.unavailable`)."""
    return _engine_type(cfg).unavailable(cfg)


__all__ = [
    "ENGINES",
    "Capabilities",
    "ContextTooLong",
    "EngineConfig",
    "EngineModel",
    "EngineNotFound",
    "Generation",
    "InferenceEngine",
    "SamplingParams",
    "build_engine",
    "engine_class",
    "engine_entry_point",
    "engine_unavailable",
    "register_engine",
]
