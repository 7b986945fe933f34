"""Without vLLM installed, the `vllm` engine says how to get it (the engine itself needs a GPU machine)."""

from __future__ import annotations

import importlib.util

import pytest

from agentrl.engine import EngineConfig, EngineModel, build_engine
from agentrl.engine.vllm import VLLMEngine

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")


@pytest.mark.parametrize(
    "build",
    [lambda: build_engine(EngineConfig(kind="vllm"), EngineModel("some/model")), lambda: VLLMEngine("some/model")],
)
def test_missing_vllm_names_the_extra(build):
    with pytest.raises(ImportError, match=r"pip install 'agentrl\[vllm\]'"):
        build()
