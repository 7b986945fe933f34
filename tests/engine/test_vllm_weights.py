"""What the vllm engine hands vLLM's loaders as full weights, checked without vLLM: the checkpoint's
layout (transformers 5 fuses MoE experts in memory; vLLM reads per-expert checkpoint names)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from agentrl.models.layout import checkpoint_layout
from agentrl.models.tiny import save_tiny


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen3"])
def test_full_weights_take_the_checkpoints_names_and_shapes(tmp_path, arch):
    path = save_tiny(tmp_path / arch, arch, seed=0)
    disk = {}
    for f in sorted(path.glob("*.safetensors")):
        disk |= load_file(f)
    state = AutoModelForCausalLM.from_pretrained(path).state_dict()
    sent = checkpoint_layout(path, state)
    assert sent.keys() == disk.keys()
    for name, value in disk.items():
        assert torch.equal(sent[name], value), name
    if arch != "qwen3":  # the in-memory names are not the checkpoint's: without the conversion vLLM would refuse them
        assert state.keys() != disk.keys()
