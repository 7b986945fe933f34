"""Trainer settings: typed, every default here, checked before anything starts."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.models.lora import LoraSettings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def changed(section: BaseModel, *names: str) -> list[str]:
    """Those of `names` that `section` sets to other than their defaults: the settings a check of an inert
    combination may refuse. Being set is not enough: a run's saved config.yaml sets every field."""
    fields = type(section).model_fields
    return [
        n
        for n in names
        if n in section.model_fields_set and getattr(section, n) != fields[n].get_default(call_default_factory=True)
    ]


def lr_factor(step: int, warmup: int, decay: int, floor: float) -> float:
    """The learning-rate multiplier at optimizer step `step`: linear warmup from 1/(warmup + 1) over
    `warmup` steps, then cosine decay to `floor` by step `decay` (constant after; decay <= warmup: none)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (decay - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class AlgoConfig(_Strict):
    loss: Literal["gspo", "gspo_token", "grpo"] = "gspo_token"
    """the surrogate objective (docs/design.md §4)"""
    advantage: Literal["outcome", "turn", "gigpo"] = "turn"
    """'outcome': one group-normalised A_i per episode; 'turn': group-normalised return-to-go per turn; 'gigpo':
    the episode's group-normalised return plus ω × the turn's return-to-go normalised within its step group (the
    turns of the group's episodes that acted in the same environment state: `Turn.state_key`)"""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """discount of later turns' rewards in the return-to-go (advantages 'turn' and 'gigpo')"""
    gigpo_omega: float = Field(1.0, ge=0.0)
    """ω, the weight of GiGPO's step-level advantage (advantage 'gigpo' only)"""
    scale_advantages: bool = True
    """divide by the group's standard deviation (False: only subtract the mean, as Dr. GRPO)"""
    clip_low: float | None = None
    """ε_low; None: the loss's paper default (GSPO 3e-4, GRPO 0.2)"""
    clip_high: float | None = None
    """ε_high; None: the loss's paper default (GSPO 4e-4, GRPO 0.27)"""
    kl_coef: float = Field(0.0, ge=0.0)
    """β of a KL penalty to the initial policy; 0 turns it off (no reference model is kept)"""
    behaviour_weight: Literal["none", "truncate", "mask", "band"] = "none"
    """the decoupled objective (docs/design.md §4), for tokens sampled by an older policy version or an engine
    whose numerics differ from the learner's. 'none': the ratio against the engine's lp_b, unweighted;
    otherwise the ratio against the learner's own lp_prox (before its first step on the batch), each unit's term
    weighted by ŵ = exp(lp_prox − lp_b): 'truncate' at behaviour_cap C, 'mask' zeroed above C, 'band' zeroed
    outside [1/C, C] (IcePop)"""
    behaviour_level: Literal["auto", "token", "sequence"] = "auto"
    """the unit ŵ is taken over (not under 'none'): 'sequence', the geometric mean of a sequence's token
    ratios, weighing all its tokens; 'token', each token's own (not for loss 'gspo', one term per sequence);
    'auto', the loss's own level: sequence for gspo and gspo_token, token for grpo"""
    behaviour_cap: float = Field(2.0, gt=0.0, allow_inf_nan=False)
    """C of behaviour_weight (not under 'none'; > 1 for 'band'). 2, as truncated importance sampling (Yao et
    al., 2025) uses: w is about 1 where the engine sampled as the learner would, and a stale or mismatched unit
    weighs at most twice that. Below 1 it would cut the learner's own samples (w = 1) too"""
    routing_replay: Literal["none", "R2", "R3"] = "none"
    """MoE (Qwen3-MoE, Qwen2-MoE, Mixtral): the learner's forward routes to given top-k expert sets, the gate
    weights over each set recomputed from its own router logits, so the router still learns (docs/design.md §3).
    'R3' (arXiv:2510.11370): the engine's recorded sets at every position that conditions a generated token
    (prompt, observations, prefix-cache hits); the engine must record them (engine.record_routing, an hf engine).
    'R2': the learner's own sets from before the update, in every minibatch after the first (a no-op at
    optim.minibatches = 1, so a run refuses it there). 'none': the learner routes as it would"""
    async_level: int = Field(0, ge=0)
    """k: how many policy versions generation may run ahead of the learner. 0: rollout, update and sync in
    turn; k >= 1: the fleet samples the next batch while the learner trains (needs rollout.max_staleness >= k)"""
    filter_degenerate_groups: bool = False
    """leave groups whose rewards are all equal (zero advantage) out of the update, as dynamic sampling does"""

    @model_validator(mode="before")
    @classmethod
    def _read_old_keys(cls, data: Any) -> Any:
        """Configs saved before behaviour_weight (tests/data/run_v0): old_logprobs 'engine' is 'none';
        'recompute' with tis_cap C is 'truncate' at C, and without tis_cap (the ratio against lp_prox with no
        correction for lp_b, biased) 'truncate' at the default cap."""
        if not isinstance(data, dict) or not {"old_logprobs", "tis_cap"} & data.keys():
            return data
        data = dict(data)
        old, cap = data.pop("old_logprobs", "engine"), data.pop("tis_cap", None)
        if {"behaviour_weight", "behaviour_cap"} & data.keys():
            raise ValueError(
                "old_logprobs and tis_cap are the old spelling of behaviour_weight and behaviour_cap: "
                "set only the new keys"
            )
        if old not in ("engine", "recompute"):
            raise ValueError(f"old_logprobs (now behaviour_weight) takes 'engine' or 'recompute', got {old!r}")
        if old == "engine":
            if cap is not None:
                raise ValueError(
                    "tis_cap needs old_logprobs='recompute'; today both are behaviour_weight='truncate' "
                    "with behaviour_cap"
                )
            return data
        return data | {"behaviour_weight": "truncate"} | ({} if cap is None else {"behaviour_cap": cap})

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        if self.loss == "gspo" and self.advantage in ("turn", "gigpo"):
            raise ValueError(
                "loss 'gspo' takes one advantage per sequence: use advantage 'outcome' or loss 'gspo_token'"
            )
        if self.behaviour_weight == "band" and not self.behaviour_cap > 1:
            raise ValueError(
                f"behaviour_weight 'band' keeps the units whose ŵ lies in [1/behaviour_cap, "
                f"behaviour_cap]: it needs behaviour_cap > 1, got {self.behaviour_cap}"
            )
        if self.advantage == "outcome" and changed(self, "gamma"):
            raise ValueError(
                "algo.gamma discounts later turns' rewards in the per-turn return-to-go: it does nothing with "
                "algo.advantage=outcome; set algo.advantage=turn, or drop algo.gamma"
            )
        if self.advantage != "gigpo" and changed(self, "gigpo_omega"):
            raise ValueError("algo.gigpo_omega weighs GiGPO's step-level term: set algo.advantage=gigpo, or drop it")
        if self.behaviour_weight == "none" and (unused := changed(self, "behaviour_level", "behaviour_cap")):
            one = len(unused) == 1
            raise ValueError(
                f"{' and '.join(f'algo.{n}' for n in unused)} {'does' if one else 'do'} nothing with "
                "algo.behaviour_weight=none (the ratio against lp_b, unweighted): set algo.behaviour_weight=truncate, "
                f"mask or band, or drop {'it' if one else 'them'}"
            )
        if self.behaviour_weight != "none" and self.loss == "gspo" and self.behaviour_level == "token":
            raise ValueError(
                "loss 'gspo' has one term per sequence: behaviour_level 'token' has no token term to "
                "weigh; use behaviour_level 'sequence' (or 'auto'), or loss 'gspo_token'"
            )
        return self


class ModelConfig(_Strict):
    path: str = ""
    """a local Hugging Face folder or a hub id (when online)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """compute dtype: bfloat16 is FSDP2's mixed precision (bf16 parameters in forward and backward,
    float32 master weights and gradient reduction; `agentrl train` shards a single process too)"""
    lora: LoraSettings | None = None
    """None: full fine-tuning"""
    activation_checkpointing: bool = False
    """recompute each decoder layer's activations in backward"""
    cpu_offload: bool = False
    """FSDP2 keeps parameters and optimizer state on the CPU (a single process is sharded too)"""
    router_aux_loss: bool = True
    """MoE models: add the router's load-balancing loss (times the config's router_aux_loss_coef)"""
    compile: bool = False
    """torch.compile (inductor) each decoder layer's MLP, an MoE model's router and experts, for the learner's
    forwards and backwards (not the engine's: an engine then takes its own copy of the weights). The first update
    pays the compile (seconds to a minute), and each new grad mode or batch of one row a recompile"""


class OptimConfig(_Strict):
    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    """optimizer steps of linear learning-rate warmup from lr / (warmup_steps + 1)"""
    decay_steps: int = Field(0, ge=0)
    """cosine decay of the learning rate to min_lr_ratio · lr, ending at this optimizer step
    (counting warmup; iterations × minibatches decays over the whole run); 0: constant after warmup"""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """where the cosine decay ends, as a share of lr (with decay_steps only)"""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """gradients are clipped to this global norm before every step"""
    minibatches: int = Field(4, ge=1)
    """M: the rollout batch is split into M minibatches, one optimizer step each (the GSPO paper used 4)"""
    microbatch_tokens: int = Field(0, ge=0)
    """a token budget per forward: each minibatch runs as micro-batches of at most this many padded positions
    per rank (rows × their longest; a longer row alone), longest rows first, their gradients summed into the
    minibatch's one step, so a step of many tokens fits in memory. The update is the same (to rounding) whatever
    the budget: the learning-rate schedule counts optimizer steps, which it does not change, and a resume may
    change it. 0: each minibatch in one forward"""

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        # lr_factor decays only from warmup_steps to decay_steps
        if 0 < self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"optim.decay_steps={self.decay_steps} ends the cosine decay no later than the warmup "
                f"(optim.warmup_steps={self.warmup_steps}): it does nothing; set optim.decay_steps > "
                "optim.warmup_steps, or drop it"
            )
        if self.decay_steps <= self.warmup_steps and changed(self, "min_lr_ratio"):
            raise ValueError(
                "optim.min_lr_ratio is where the cosine decay ends: it does nothing without optim.decay_steps; "
                "set optim.decay_steps > optim.warmup_steps (iterations x minibatches decays over the whole run), "
                "or drop optim.min_lr_ratio"
            )
        return self


class TrainerConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    seed: int = 0
