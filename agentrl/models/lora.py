"""LoRA as agentrl trains it: the settings (`model.lora`) and the peft wrapping they describe.

Shared by the learner (`agentrl train`) and the engines that must hold the same adapters
(`agentrl serve --lora-rank`, an engine's own copy of the policy).
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from peft import LoraConfig
    from torch import nn
    from transformers import PreTrainedModel

EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # transformers' fused MoE experts


class LoraSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, ge=1)
    """r of the low-rank update"""
    alpha: float = 32.0
    """the update is scaled by alpha / rank"""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """module names that get adapters (attention by default)"""
    experts: bool = False
    """also adapt the MoE expert projections (3D expert parameters)"""

    @model_validator(mode="after")
    def _experts_take_no_dropout(self) -> LoraSettings:
        if self.experts and self.dropout:
            raise ValueError(
                f"lora.experts with lora.dropout={self.dropout}: peft's adapters on expert parameters take no "
                "dropout; set lora.dropout=0"
            )
        return self


def is_lora(model: object) -> bool:
    """Whether `model` is a peft model (its adapters train, or take updates). Imports nothing: a model can
    only be one once peft is imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def with_lora(model: PreTrainedModel, lora: LoraSettings) -> nn.Module:
    """A peft model whose only trainable parameters are the adapters."""
    return peft_model(model, peft_config(lora, model))


def peft_model(model: PreTrainedModel, config: LoraConfig) -> nn.Module:
    """`peft.get_peft_model`. peft (0.21) reads `is_gradient_checkpointing`, which transformers 5.24 deprecates: the
    warning is about peft's call, not the user's, so it is not shown. Nor is its warning that an adapter sits on a
    tied embedding: the learner reads the head's base weight, and an export unties the head before it merges
    (`agentrl.train.checkpoint.export_hf`), the complication it warns of."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        warnings.filterwarnings("ignore", "Model has `tie_word_embeddings=True` and a tied layer", UserWarning)
        return get_peft_model(model, config)


def peft_config(lora: LoraSettings, model: nn.Module) -> LoraConfig:
    """peft's `LoraConfig` of these settings on `model` (its parameter names say where the experts are;
    a meta-device model is enough)."""
    from peft import LoraConfig

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    named = next((n for n, m in model.named_modules() if m is head), "") if head is not None else ""
    if named and (name := named.rpartition(".")[2]) in lora.target_modules:
        raise ValueError(
            f"lora.target_modules: {name} is the output head, whose logprobs the learner computes from its base "
            "weight (in chunks, never the whole logits): an adapter there would never train; leave it out"
        )
    target_parameters = None
    if lora.experts:
        names = {n for n, _ in model.named_parameters()}
        target_parameters = [p for p in EXPERT_PARAMETERS if any(n.endswith(p) for n in names)]
        if not target_parameters:
            raise ValueError(f"lora.experts: the model has no fused expert parameters ({', '.join(EXPERT_PARAMETERS)})")
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        target_parameters=target_parameters,
    )
