"""Routing replay (docs/design.md §3): the learner's MoE layers route positions to given top-k expert sets.

R3 replays the engine's recorded sets (`TrainBatch.routed_experts`), R2 the learner's own from before the
update. Only the choice of experts is replayed: the gate weights over a replayed set are recomputed from the
learner's own router logits by the architecture's formula (`replay_gate`), so the router still learns, and
the router logits a forward reports are the router's own.

How a record reaches the routers: the scorer passes `routing_replay=(b, l, layers, k)` to the decoder,
which hands unknown keyword arguments to every decoder layer and on to its `self_attn`. A forward pre-hook
on each MoE layer's `self_attn` takes it out (attention never sees it) and leaves the layer's column for
the forward hook on the same layer's `mlp.gate`, which runs next. Not a pre-hook on the decoder layer: under
activation checkpointing transformers checkpoints the layer's `forward`, not its `__call__`, so the
backward's recomputation runs the submodules' hooks again but not the layer's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from agentrl.train.policy import causal_lm

SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral")
"""the architectures (config.model_type) whose gate formula `gate_normalises` knows"""


def gate_normalises(config: PretrainedConfig) -> bool:
    """Whether the architecture's gate divides its top-k probabilities by their sum (transformers'
    `*TopKRouter.forward`): Qwen3-MoE and Qwen2-MoE iff `norm_topk_prob` (Qwen2-MoE's shared expert and its
    sigmoid gate are outside the router: replay leaves them alone), Mixtral always."""
    if config.model_type in ("qwen3_moe", "qwen2_moe"):
        return bool(config.norm_topk_prob)
    if config.model_type == "mixtral":
        return True
    raise ValueError(
        f"routing replay knows the gates of {', '.join(SUPPORTED)}, not {config.model_type!r} (a dense "
        f"model has no routing to replay): set algo.routing_replay to 'none'"
    )


def replay_gate(logits: torch.Tensor, indices: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The gate weights (N, k), float32, of the experts `indices` (N, k) under router logits (N, E):
    p = softmax(logits) over all E experts in float32, w_j = p[indices_j], and if `normalize`
    w_j / Σ_j' w_j'. On the router's own top-k it is the router's own weights, bit for bit."""
    w = logits.float().softmax(-1).gather(-1, indices)
    return w / w.sum(-1, keepdim=True) if normalize else w


def position_routing(routed: torch.Tensor) -> torch.Tensor:
    """The position view (B, L, layers, k) of a token-indexed record (`TrainBatch.routed_experts`, token t holding
    the routing of position t − 1, the forward that predicted it): position p's experts are token p + 1's
    record; the last position predicts no token of the batch and has none (-1)."""
    return torch.cat([routed[:, 1:], torch.full_like(routed[:, :1], -1)], 1)


def own_routing(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """(B, L, layers, k) int16: the top-k experts per position and MoE layer as the learner's routers choose them
    from their logits (B·L, E) per layer (top-k of the float32 softmax, in the routers' order); -1 on padding."""
    B, L = attention_mask.shape
    sets = [r.float().softmax(-1).topk(top_k, -1).indices.view(B, L, top_k) for r in router_logits]
    return torch.where(attention_mask.bool()[..., None, None], torch.stack(sets, 2), -1).to(torch.int16)


def replayed_positions(routing: torch.Tensor | None, attention_mask: torch.Tensor) -> torch.Tensor | int:
    """How many real positions have a recorded set in some layer (none without `routing` (B, L, layers, k)), on
    the device."""
    if routing is None:
        return 0
    return ((routing[..., 0] >= 0).any(-1) & attention_mask.bool()).sum()


class RoutingReplay:
    """Routing replay installed on a causal LM (a peft model, sharded by FSDP2 or not): its forwards called with
    `routing_replay=(b, l, layers, k)` (one column per MoE layer, in order; -1 where a position keeps its own
    routing) route each recorded position to its recorded experts with `replay_gate`'s weights; forwards without
    it are untouched, bit for bit."""

    def __init__(self, model: nn.Module) -> None:
        lm = causal_lm(model)
        self.normalize = gate_normalises(lm.config)
        moe = [layer for layer in lm.get_decoder().layers if isinstance(getattr(layer.mlp, "gate", None), nn.Module)]
        if not moe:
            raise ValueError(f"routing replay needs MoE layers; this {lm.config.model_type} model has none")
        self.layers = len(moe)
        self.top_k = int(lm.config.num_experts_per_tok)
        self._columns: list[torch.Tensor | None] = [None] * self.layers  # layer j's (b, l, k), between its hooks
        for j, layer in enumerate(moe):
            layer.self_attn.register_forward_pre_hook(self._take(j), with_kwargs=True)
            layer.mlp.gate.register_forward_hook(self._replay(j))

    def check(self, routing: torch.Tensor) -> None:
        """A routing (B, L, layers, k) must have a column per MoE layer, of the routers' k."""
        if routing.shape[2:] != (self.layers, self.top_k):
            raise ValueError(
                f"a routing record of {routing.shape[2]} layers × {routing.shape[3]} experts; the "
                f"policy routes {self.layers} MoE layers to {self.top_k} experts each"
            )

    def _take(self, j: int) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            routing = kwargs.pop("routing_replay", None)
            self._columns[j] = None if routing is None else routing[:, :, j]
            return args, kwargs

        return hook

    def _replay(self, j: int) -> Callable[[nn.Module, tuple, tuple], tuple | None]:
        def hook(module: nn.Module, args: tuple, out: tuple) -> tuple | None:
            column, self._columns[j] = self._columns[j], None
            if column is None:
                return None
            logits, scores, indices = out  # (N, E), (N, k), (N, k)
            recorded = column.reshape(-1, column.shape[-1]).to(indices.device, torch.long)
            has = (recorded[:, :1] >= 0).expand_as(indices)
            chosen = torch.where(has, recorded, indices)
            # the router's own weights where nothing is recorded; its cast (Qwen: the logits' dtype, Mixtral: none)
            w = replay_gate(logits, chosen, self.normalize).to(scores.dtype)
            return logits, torch.where(has, w, scores), chosen

        # eager inside a compiled MoE block (model.compile): traced, it would specialise the block to each layer's j
        return torch.compiler.disable(hook)
