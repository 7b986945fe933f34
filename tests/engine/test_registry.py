"""Engines by name: imported late, unknown names answered with a suggestion."""

from __future__ import annotations

import pytest

from agentrl.engine import ENGINES, EngineNotFound, engine_class, make_engine, register_engine
from agentrl.engine.hf import HFEngine
from agentrl.models.tiny import tiny_model


async def test_make_engine_builds_the_registered_class():
    engine = make_engine("hf", model=tiny_model("qwen3"), max_batch_size=2)
    assert isinstance(engine, HFEngine)
    await engine.close()


def test_unknown_engine_suggests_a_name():
    with pytest.raises(EngineNotFound, match=r"no engine named 'vlm'\. Did you mean 'vllm'\?"):
        engine_class("vlm")


def test_registered_engine_is_imported_when_asked_for(monkeypatch):
    monkeypatch.setitem(ENGINES, "mine", "agentrl.engine.hf:HFEngine")
    assert engine_class("mine") is HFEngine
    register_engine("later", "agentrl.engine.openai:OpenAIEngine")
    assert engine_class("later").name == "openai"
    del ENGINES["later"]
