"""The update: M optimizer steps of the policy objective over a rollout batch, on one or many ranks.

The batch is split into M minibatches, one optimizer step each (gradients clipped to a
global norm). With several ranks each takes a disjoint share of every minibatch and FSDP2
averages gradients; each rank's loss is rescaled so that the update is that of the whole
minibatch: J is a mean over sequences (weighted by their row weights: 1/K each for an episode of K
sequences), so rank r's mean over its sequences of total weight n_r weighs n_r / n (× the world size, which
FSDP's average divides away).

Decoupled (algo.behaviour_weight other than 'none', docs/design.md §4): the ratio is taken against
lp_prox, the learner's logprobs before its first step on the batch, and lp_b weighs the terms. Minibatch
0's lp_prox is its own first forward, detached (at M = 1 it costs nothing); the others' are scored in one
no-grad pass before the first step.

Routing replay (algo.routing_replay, MoE, agentrl.train.replay): under R3 every forward of the update's
minibatches, that pass included, routes each position to the experts the engine recorded for it; under R2
minibatch m >= 1 routes to the learner's own sets from that same pass, before the first step. The KL
reference and the observers' own forwards route as the learner does: they measure its routing.

Scoring is `Scorer`'s (agentrl.train.scoring); what is watched besides the loss (engine/trainer
mismatch, expert flips, the rows the run records) is done by observers the step calls
(agentrl.train.diagnostics); handing the new weights to an engine is `WeightSync`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.distributed.tensor import DTensor

from agentrl.algo import policy_loss
from agentrl.models import loading
from agentrl.models.lora import is_lora
from agentrl.train.batch import TrainBatch
from agentrl.train.config import TrainerConfig, lr_factor
from agentrl.train.diagnostics import (
    ExpertFlips,
    Metrics,
    Mismatch,
    RouterDisagreement,
    ScoredMinibatch,
    UpdateObserver,
    staleness,
)
from agentrl.train.policy import causal_lm, gather_state, load_policy, meta_policy, prepare, train_device
from agentrl.train.replay import own_routing, position_routing, replayed_positions
from agentrl.train.scoring import Scorer


def router_aux_loss(router_logits: tuple[torch.Tensor, ...], top_k: int, mask: torch.Tensor) -> torch.Tensor:
    """Switch-style load balancing, transformers' convention: E · Σ_e (c_e / N) · P_e over the N real
    tokens of all layers, c_e the tokens with e among their top-k, P_e the mean router probability.

    With several ranks the counts and probability sums are summed over ranks first (a
    differentiable all-reduce), so the loss is the one of the whole minibatch, not a mean of
    per-rank losses: the update does not depend on how the minibatch was split.
    """
    logits = torch.cat(router_logits)  # (layers·B·L, E)
    keep = mask.reshape(-1).repeat(len(router_logits)).bool()
    probs = logits[keep].float().softmax(-1)
    E = probs.shape[-1]
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, -1).indices, 1.0)
    stats = torch.cat([probs.sum(0), chosen.sum(0), probs.new_tensor([len(probs)])])  # (2E + 1,)
    if dist.is_initialized() and dist.get_world_size() > 1:
        stats = dist_nn.all_reduce(stats)
    P, c, N = stats[:E], stats[E : 2 * E], stats[-1]
    return E * ((c / N) * (P / N)).sum()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip to a global norm (over all ranks' shards) and return the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # a DTensor under FSDP2


@dataclass
class _MinibatchShare:
    """This rank's share of one minibatch."""

    batch: TrainBatch
    n_local: float  # the weight of the sequences with generated tokens on this rank (their count when all weigh 1)
    n_global: float
    rows: list[int]  # the batch rows of `batch` (none when this rank holds a stand-in row)


class Trainer:
    def __init__(self, cfg: TrainerConfig, policy: nn.Module, reference: nn.Module | None = None) -> None:
        """`reference`: the KL penalty's frozen policy for full fine-tuning (a copy of the starting
        weights, loaded from the model path: a resume rebuilds it from there, never from a checkpoint).
        A LoRA policy needs none: its reference is the base model, adapters off."""
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.policy = policy
        self.lora = is_lora(policy)
        self.scorer = Scorer(policy, replay=cfg.algo.routing_replay != "none")  # refuses a policy it cannot replay
        self.device = train_device()
        if cfg.algo.kl_coef and not self.lora and reference is None:
            raise ValueError(
                "algo.kl_coef with full fine-tuning needs a reference policy (a frozen copy of the "
                "starting weights); with LoRA the base model is the reference"
            )
        self.reference = Scorer(reference.requires_grad_(False).eval()) if cfg.algo.kl_coef and not self.lora else None
        prepare(policy, cfg.model, self.device, root=self.scorer)
        if self.reference is not None:  # sharded like the policy; no backward, so no checkpointing
            prepare(
                reference,
                cfg.model.model_copy(update={"activation_checkpointing": False}),
                self.device,
                root=self.reference,
            )
        config = causal_lm(policy).config
        self.top_k = getattr(config, "num_experts_per_tok", 0)
        self.moe = bool(self.top_k) and bool(getattr(config, "num_experts", getattr(config, "num_local_experts", 0)))
        if not self.moe and not cfg.model.router_aux_loss:
            raise ValueError(
                "model.router_aux_loss=false does nothing on a dense model (it has no router to balance): drop "
                "model.router_aux_loss"
            )
        self.aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0)) if cfg.model.router_aux_loss else 0.0
        self.diagnostics: list[UpdateObserver] = [Mismatch()]
        """observers of every update"""
        if self.moe:
            self.diagnostics.append(ExpertFlips(self.top_k))
            self.diagnostics.append(RouterDisagreement(self.top_k))
        trainable = [p for p in self.scorer.parameters() if p.requires_grad]
        o = cfg.optim
        # fused: one kernel over all parameters (a 14M-parameter step on 2 CPU cores: 9 ms against foreach's 42 ms)
        self.optimizer = torch.optim.AdamW(trainable, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, o.warmup_steps, o.decay_steps, o.min_lr_ratio)
        )

    @classmethod
    def build(cls, cfg: TrainerConfig) -> Trainer:
        """The trainer of `cfg.model.path`, loaded and sharded over this process group (every rank calls it).
        Full fine-tuning with a KL penalty also loads its reference: the starting weights, from the model path
        (on resume too). Under torch.distributed both are built on the meta device and each rank loads only its
        shards (`agentrl.train.policy.meta_policy`); in one plain process (or with transformers 4, whose loading
        internals differ), `from_pretrained` in float32."""
        kl_reference = bool(cfg.algo.kl_coef) and cfg.model.lora is None
        if dist.is_initialized() and loading.supported():
            reference = meta_policy(cfg.model, frozen=True) if kl_reference else None
            return cls(cfg, meta_policy(cfg.model, seed=cfg.seed), reference)
        return cls(cfg, load_policy(cfg.model), load_policy(cfg.model) if kl_reference else None)

    def engine_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """What a weight sync sends an engine that holds its own copy, in `dtype` (None: as trained): the full
        state dict, gathered one parameter at a time, or under LoRA the adapter alone (peft's key names; the
        frozen base is never gathered). Every rank calls it (gathering shards is collective); rank 0 gets it.
        `agentrl.train.policy.state_bytes` of it is what one sync moves."""
        if not self.lora:
            state = gather_state(self.policy.state_dict(keep_vars=True), dtype)
            return state if self.rank == 0 else None
        from peft import get_peft_model_state_dict

        adapter = gather_state({n: p for n, p in self.policy.named_parameters() if p.requires_grad}, dtype)
        return get_peft_model_state_dict(self.policy, state_dict=adapter) if self.rank == 0 else None

    # -- data split --------------------------------------------------------------------

    def _minibatches(self, batch: TrainBatch) -> list[_MinibatchShare]:
        M = min(self.cfg.optim.minibatches, len(batch))
        order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(self.cfg.seed))
        shares = []
        for m in range(M):
            rows = order[m::M]
            n_global = float(batch.row_weight(rows)[batch.loss_mask[rows].any(-1).cpu()].sum())
            mine = rows[self.rank :: self.world]
            if len(mine) == 0:  # every rank runs forward and backward (FSDP's collectives): a row that counts nothing
                mb = batch.select(rows[:1])
                mb.loss_mask = torch.zeros_like(mb.loss_mask)
                shares.append(_MinibatchShare(mb, 0, n_global, []))
            else:
                mb = batch.select(mine)
                n_local = float(batch.row_weight(mine)[mb.loss_mask.any(-1).cpu()].sum())
                shares.append(_MinibatchShare(mb, n_local, n_global, mine.tolist()))
        return shares

    # -- the update --------------------------------------------------------------------

    def update(
        self, batch: TrainBatch, *observers: UpdateObserver, policy_version: int | None = None
    ) -> dict[str, float]:
        """M optimizer steps over the batch; returns metrics averaged over minibatches (and ranks).
        `observers` (every rank passes the same) watch it besides `self.diagnostics`. `policy_version`: the
        version of the weights held before the first step, to log the trained tokens' staleness (every rank
        passes the same; the batch needs its token_versions)."""
        algo = self.cfg.algo
        watching = [*self.diagnostics, *observers]
        shares = self._minibatches(batch)
        metrics = Metrics()
        if policy_version is not None:
            if batch.token_versions is None:
                raise ValueError("staleness needs the batch's token_versions (build_batch records them)")
            for k, v in staleness(batch.token_versions, batch.loss_mask, policy_version).items():
                metrics.log(k, v)
        decoupled, r2 = algo.behaviour_weight != "none", algo.routing_replay == "R2"
        routing = self._recorded_routing(shares)  # (B, L, layers, k) per minibatch, position-indexed, or None
        proximal: list[torch.Tensor | None] = [None] * len(shares)
        if decoupled or r2:  # the weights before any step: lp_prox, R2's routing; minibatch 0's is its own forward's
            with torch.no_grad():
                for m, s in enumerate(shares[1:], 1):
                    b = s.batch
                    lp, _, router = self.scorer(
                        b.input_ids, b.attention_mask, b.sampling, router=r2, routing=routing[m]
                    )
                    if decoupled:
                        proximal[m] = lp
                    if r2:
                        routing[m] = own_routing(router, b.attention_mask, self.top_k)
        self.scorer.train()
        for m, s in enumerate(shares):
            mb = s.batch
            lp, entropy, router = self.scorer(
                mb.input_ids, mb.attention_mask, mb.sampling, entropy=True, router=self.moe, routing=routing[m]
            )
            old, extra = mb.old_logprobs, {}
            if decoupled:
                old = lp.detach() if m == 0 else proximal[m]
                extra = {
                    "behaviour_logprobs": mb.old_logprobs,
                    "behaviour_weight": algo.behaviour_weight,
                    "behaviour_cap": algo.behaviour_cap,
                    "behaviour_level": algo.behaviour_level,
                }
            if algo.kl_coef:
                extra |= {"ref_logprobs": self._reference_logprobs(mb), "kl_coef": algo.kl_coef}
            if s.n_local:
                loss, loss_metrics = policy_loss(
                    lp,
                    old,
                    mb.advantages,
                    mb.loss_mask,
                    mode=algo.loss,
                    clip_low=algo.clip_low,
                    clip_high=algo.clip_high,
                    sequence_weights=mb.row_weights,
                    **extra,
                )
                for k, v in loss_metrics.items():
                    if k != "sequences":
                        metrics.log(k, v, s.n_local)
                metrics.log("entropy", float((entropy * mb.loss_mask).sum() / mb.loss_mask.sum()), s.n_local)
                metrics.log("loss", float(loss.detach()), s.n_local)
                if algo.routing_replay != "none":  # the share of real positions routed to a given set
                    real = int(mb.attention_mask.sum())
                    metrics.log("routing_replayed", replayed_positions(routing[m], mb.attention_mask) / real, real)
                loss = loss * (self.world * s.n_local / s.n_global)  # n_local > 0, so n_global > 0
            else:
                loss = lp.sum() * 0.0  # keeps this rank in the collectives
            if router is not None and self.aux_coef:
                aux = router_aux_loss(router, self.top_k, mb.attention_mask)
                loss = loss + self.aux_coef * aux
                metrics.log("router_aux_loss", float(aux.detach()))
            scored = ScoredMinibatch(m, mb, s.rows, s.n_local, lp, old, router, policy_version)
            for o in watching:
                o.minibatch(scored, metrics)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            trainable = [p for p in self.scorer.parameters() if p.requires_grad]
            metrics.log("grad_norm", clip_grad_norm(trainable, self.cfg.optim.max_grad_norm))
            self.optimizer.step()
            self.scheduler.step()
        self.scorer.eval()  # an engine sharing this module samples in eval mode
        for o in watching:
            o.finished(self.scorer, metrics)
        return metrics.reduce(self.world)

    def _recorded_routing(self, shares: list[_MinibatchShare]) -> list[torch.Tensor | None]:
        """Per minibatch, R3's replayed routing: the position view of the engine's record; None otherwise."""
        if self.cfg.algo.routing_replay != "R3":
            return [None] * len(shares)
        if shares[0].batch.routed_experts is None:
            raise ValueError(
                "algo.routing_replay R3 replays the engine's recorded routing, and this batch has none: "
                "the engine must record it (engine.record_routing: true, an hf engine)"
            )
        return [position_routing(s.batch.routed_experts) for s in shares]

    def _reference_logprobs(self, mb: TrainBatch) -> torch.Tensor:
        """lp_ref of the KL penalty: the frozen reference (full fine-tuning) or the base model, adapters off."""
        with torch.no_grad():
            if self.reference is not None:
                return self.reference(mb.input_ids, mb.attention_mask, mb.sampling)[0]
            with self.policy.disable_adapter():
                return self.scorer(mb.input_ids, mb.attention_mask, mb.sampling)[0]
