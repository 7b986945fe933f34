"""Engines by name: imported late, unknown names answered with a suggestion."""

from __future__ import annotations

import pytest

from agentrl.config import ConfigError, load
from agentrl.engine import (
    ENGINES,
    EngineConfig,
    EngineModel,
    EngineNotFound,
    build_engine,
    engine_class,
    register_engine,
)
from agentrl.engine.hf import HFEngine
from agentrl.models.tiny import save_tiny, tiny_model


async def test_build_engine_builds_the_configured_class(tmp_path):
    path = str(save_tiny(tmp_path / "m", "qwen3"))
    own = build_engine(EngineConfig(max_batch_size=2, dtype="bfloat16"), EngineModel(path))
    assert type(own) is HFEngine and own.max_batch_size == 2
    assert own.capabilities.dtype == "bfloat16" and not own.capabilities.shares_module
    with pytest.raises(ValueError, match="holds its own weights"):
        await own.update_weights()  # a copy must be sent its new weights
    module = tiny_model("qwen3")
    shared = build_engine(EngineConfig(), EngineModel(path, module=module), version=3)
    assert shared.model is module and shared.capabilities.shares_module and shared.version == 3
    assert await shared.update_weights() == 4
    for e in (own, shared):
        await e.close()


def test_an_unknown_engine_kind_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"no engine named 'vlm'\. Did you mean 'vllm'\?"):
        load(EngineConfig, {"kind": "vlm"})


def test_unknown_engine_suggests_a_name():
    with pytest.raises(EngineNotFound, match=r"no engine named 'vlm'\. Did you mean 'vllm'\?"):
        engine_class("vlm")


def test_registered_engine_is_imported_when_asked_for(monkeypatch):
    monkeypatch.setitem(ENGINES, "mine", "agentrl.engine.hf:HFEngine")
    assert engine_class("mine") is HFEngine
    register_engine("later", "agentrl.engine.openai:OpenAIEngine")
    assert engine_class("later").name == "openai"
    del ENGINES["later"]
