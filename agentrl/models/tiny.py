"""Tiny random-init models of real architectures, sized for CPU tests and benchmarks.

The configs are the architectures' own transformers classes (so MoE routing, GQA,
RoPE and q/k norms are the real code paths) shrunk to a few layers; the vocabulary is
the project tokenizer's. `save_tiny` writes a checkpoint directory that `from_pretrained`
(and `agentrl serve --model DIR`) loads like any hub model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from agentrl.models.tokenizer import TemplateName, load_tokenizer

Arch = Literal["qwen3_moe", "qwen3", "llama", "mixtral"]

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
_ARCH: dict[str, dict] = {
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True
    ),
    "qwen3": {},
    "llama": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
}


def tiny_config(arch: Arch = "qwen3_moe", template: TemplateName = "qwen3", **overrides) -> PretrainedConfig:
    if arch not in _ARCH:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(_ARCH)}")
    tok = load_tokenizer(template)
    kw = {
        **_COMMON,
        **_ARCH[arch],
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        **overrides,
    }
    return AutoConfig.for_model(arch, **kw)


def tiny_model(
    arch: Arch = "qwen3_moe",
    *,
    seed: int = 0,
    template: TemplateName = "qwen3",
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> PreTrainedModel:
    """A random-init model; the same seed gives the same weights."""
    config = tiny_config(arch, template, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def save_tiny(
    path: str | Path, arch: Arch = "qwen3_moe", *, seed: int = 0, template: TemplateName = "qwen3", **overrides
) -> Path:
    """Write model + tokenizer (with its chat template) to `path`, loadable with `from_pretrained`."""
    path = Path(path)
    tiny_model(arch, seed=seed, template=template, **overrides).save_pretrained(path)
    load_tokenizer(template).save_pretrained(path)
    return path
