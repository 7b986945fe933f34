"""A model's weights as its checkpoint lays them out, for the engines that load weights as they load a checkpoint
(vLLM, in process or a `vllm serve` server reading a folder): transformers 5 fuses some weights on load (MoE
experts into 3D `gate_up_proj` / `down_proj`), and its own `revert_weight_conversion` splits them back, as
`save_pretrained` does."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from agentrl.models.loading import meta_model


@functools.cache
def meta_model_at(path: str) -> nn.Module:
    """The causal LM at `path` on the meta device, without weights (one per path): its parameter names and weight
    conversions, all that `checkpoint_layout` and a LoRA config (`agentrl.models.lora.peft_config`) read. Nothing
    is held, so the dtype is immaterial."""
    from transformers import AutoConfig

    return meta_model(AutoConfig.from_pretrained(path), torch.float32)


def checkpoint_layout(path: str | Path, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers module's state dict under the names and shapes of its checkpoint at `path` (what
    `save_pretrained` writes)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(meta_model_at(str(path)), dict(state_dict))
