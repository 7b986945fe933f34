"""The update: M optimizer steps of the policy objective over a rollout batch, on one or many ranks.

The batch's rows with a generated token (the others have no term in J) are split into M minibatches, one optimizer
step each (gradients clipped to a global norm). With a token budget (optim.microbatch_tokens) a minibatch runs as
micro-batches, each one forward and backward, their gradients accumulated into its one step. With several ranks each
takes a disjoint share of every micro-batch and FSDP2 averages gradients; each share's loss is rescaled so that the
update is that of the whole minibatch: J is a mean over sequences (weighted by their row weights: 1/K each for an
episode of K sequences), so a share's mean over its sequences of total weight n_r weighs n_r / n (× the world size,
which FSDP's average divides away). The router's load-balancing loss, which is not a mean over sequences, is taken
per micro-batch (over all ranks) and weighted by its share of the minibatch's tokens.

Nothing in a step reads a value back from the device: the split reads what it needs once, before the first
step (host copies of the ids and masks, which the scorer plans from, and the batch's checks), the loss and the
metrics stay on the device, and `Metrics.reduce` reads them all at the end.

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

from agentrl.algo import check_values, policy_objective
from agentrl.algo.loss import Mean
from agentrl.engine.base import SamplingParams
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
from agentrl.train.policy import (
    causal_lm,
    gather_once_a_step,
    gather_state,
    load_policy,
    meta_policy,
    prepare,
    reshard,
    train_device,
    trainable_state,
)
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
    keep = mask.reshape(-1).repeat(len(router_logits)).to(torch.float32)[:, None]  # (layers·B·L, 1)
    probs = logits.float().softmax(-1)
    E = probs.shape[-1]
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, -1).indices, 1.0)
    stats = torch.cat([(keep * probs).sum(0), (keep * chosen).sum(0), keep.sum(0)])  # (2E + 1,), the real tokens'
    if dist.is_initialized() and dist.get_world_size() > 1:
        stats = dist_nn.all_reduce(stats)
    P, c, N = stats[:E], stats[E : 2 * E], stats[-1]
    return E * ((c / N) * (P / N)).sum()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to a global norm (over all ranks' shards) and return the norm before clipping, on the device."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm  # a DTensor under FSDP2


@dataclass
class _Share:
    """This rank's share of one micro-batch of a minibatch (the whole minibatch without a token budget)."""

    batch: TrainBatch
    input_ids: torch.Tensor  # the share's ids and attention mask on the host: the scorer plans from them
    attention_mask: torch.Tensor
    n_local: float  # the weight of the sequences with generated tokens on this rank (their count when all weigh 1)
    n_global: float  # the same over the whole minibatch, every rank's micro-batches
    rows: list[int]  # the batch rows of `batch` (none when this rank holds a stand-in row)
    minibatch: int  # m: the optimizer steps of the update before this one's
    first: bool  # the minibatch's first micro-batch: the gradients are zeroed before it
    last: bool  # its last: the optimizer steps after it
    tokens: float  # the micro-batch's share of the minibatch's real tokens (all ranks'): its router loss's weight


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
        self.device = train_device()
        # refuses a policy it cannot replay; the update hands it host ids and masks, and it runs on the device
        self.scorer = Scorer(policy, replay=cfg.algo.routing_replay != "none", device=self.device)
        if cfg.algo.kl_coef and not self.lora and reference is None:
            raise ValueError(
                "algo.kl_coef with full fine-tuning needs a reference policy (a frozen copy of the "
                "starting weights); with LoRA the base model is the reference"
            )
        self.reference = None
        if cfg.algo.kl_coef and not self.lora:
            self.reference = Scorer(reference.requires_grad_(False).eval(), device=self.device)
        prepare(policy, cfg.model, self.device, root=self.scorer)
        if self.world == 1:  # nothing is sharded: a step gathers the weights once, `update` reshards before it
            gather_once_a_step(self.scorer)
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
        shards (`agentrl.train.policy.meta_policy`); in one plain process, `from_pretrained` in float32."""
        kl_reference = bool(cfg.algo.kl_coef) and cfg.model.lora is None
        if dist.is_initialized():
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

        adapter = gather_state(trainable_state(self.policy), dtype)
        return get_peft_model_state_dict(self.policy, state_dict=adapter) if self.rank == 0 else None

    # -- data split --------------------------------------------------------------------

    def _minibatches(self, batch: TrainBatch) -> list[_Share]:
        """This rank's shares of every micro-batch of every minibatch, in order, with what the update needs on the
        host read back once, here."""
        # once for the whole batch (a batch without a generated token refused): each minibatch's loss reads nothing back
        check_values(batch.advantages, batch.loss_mask, mode=self.cfg.algo.loss, sequence_weights=batch.row_weights)
        ids, mask = batch.input_ids.cpu(), batch.attention_mask.cpu()
        lengths = mask.sum(-1)
        weight = batch.row_weight(torch.arange(len(batch))) * batch.loss_mask.any(-1).cpu()  # 0: nothing generated
        # only rows with a term in J are split: a minibatch of none would still step, AdamW moving the weights on
        # zero gradients (its momentum, its weight decay)
        live = weight.nonzero()[:, 0]
        M = min(self.cfg.optim.minibatches, len(live))
        order = live[torch.randperm(len(live), generator=torch.Generator().manual_seed(self.cfg.seed))]
        shares = []
        for m in range(M):
            rows = order[m::M]
            n_global, real = float(weight[rows].sum()), float(lengths[rows].sum())
            micro = self._micro_batches(rows, lengths)
            for j, part in enumerate(micro):
                mine = part[self.rank :: self.world]
                # every rank runs forward and backward (FSDP's collectives): with no row, one that counts nothing
                held = mine if len(mine) else part[:1]
                mb = batch.select(held)
                if not len(mine):
                    mb.loss_mask = torch.zeros_like(mb.loss_mask)
                T = mb.input_ids.shape[1]
                shares.append(
                    _Share(
                        mb,
                        ids[held, :T],
                        mask[held, :T],
                        float(weight[mine].sum()),
                        n_global,
                        mine.tolist(),
                        m,
                        first=j == 0,
                        last=j == len(micro) - 1,
                        tokens=float(lengths[part].sum()) / max(real, 1),
                    )
                )
        return shares

    def _micro_batches(self, rows: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """A minibatch's rows in micro-batches whose share on each rank holds at most `optim.microbatch_tokens`
        padded positions (its rows × the longest), longest rows first; a row longer than that alone. 0: one."""
        budget = self.cfg.optim.microbatch_tokens
        if not budget:
            return [rows]
        rows = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
        parts, start = [], 0
        while start < len(rows):
            longest, n = int(lengths[rows[start]]), 1
            while start + n < len(rows) and -(-(n + 1) // self.world) * longest <= budget:
                n += 1
            parts.append(rows[start : start + n])
            start += n
        return parts

    # -- the update --------------------------------------------------------------------

    def update(
        self, batch: TrainBatch, *observers: UpdateObserver, policy_version: int | None = None
    ) -> dict[str, float]:
        """M optimizer steps over the batch; returns its metrics, each a mean over the update's units (sequences or
        tokens, every minibatch, micro-batch and rank) or quantiles over all its values: the same however it is split,
        but the router's loss (a micro-batch's, weighted by its tokens) and the expert flip rate (a sample of rows).
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
        routing = self._recorded_routing(shares)  # (B, L, layers, k) per share, position-indexed, or None
        proximal: list[torch.Tensor | None] = [None] * len(shares)
        if decoupled or r2:  # the weights before any step: lp_prox, R2's routing; minibatch 0's is its own forward's
            with torch.no_grad():
                for i, s in enumerate(shares):
                    if not s.minibatch:
                        continue
                    b = s.batch
                    lp, _, router = self.scorer(
                        s.input_ids, s.attention_mask, b.sampling, router=r2, routing=routing[i]
                    )
                    if decoupled:
                        proximal[i] = lp
                    if r2:
                        routing[i] = own_routing(router, b.attention_mask, self.top_k)
        self.scorer.train()
        for i, s in enumerate(shares):
            mb = s.batch
            lp, entropy, router = self.scorer(
                s.input_ids, s.attention_mask, mb.sampling, entropy=True, router=self.moe, routing=routing[i]
            )
            old, extra = mb.old_logprobs, {}
            if decoupled:
                old = lp.detach() if s.minibatch == 0 else proximal[i]
                extra = {
                    "behaviour_logprobs": mb.old_logprobs,
                    "behaviour_weight": algo.behaviour_weight,
                    "behaviour_cap": algo.behaviour_cap,
                    "behaviour_level": algo.behaviour_level,
                }
            if algo.kl_coef:
                lp_ref = self._reference_logprobs(s.input_ids, s.attention_mask, mb.sampling)
                extra |= {"ref_logprobs": lp_ref, "kl_coef": algo.kl_coef}
            if s.n_local:
                loss, loss_metrics = policy_objective(
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
                        metrics.add(k, v)  # pooled exactly over micro-batches and ranks
                metrics.add("entropy", Mean.of(entropy, mb.loss_mask.bool()))
                metrics.log("loss", loss, s.n_local)
                if algo.routing_replay != "none":  # the share of real positions routed to a given set
                    real = int(s.attention_mask.sum())
                    replayed = torch.as_tensor(replayed_positions(routing[i], mb.attention_mask), dtype=torch.float64)
                    metrics.log("routing_replayed", replayed / real, real)
                # this share's J weighs n_local / n_global of the minibatch's (× the world size FSDP averages away)
                loss = loss * (self.world * s.n_local / s.n_global)  # n_local > 0, so n_global > 0
            else:
                loss = lp.sum() * 0.0  # keeps this rank in the collectives
            if router is not None and self.aux_coef:
                # a stand-in row (this rank holds none of the micro-batch) counts no token in the all-reduced counts
                real = mb.attention_mask if s.rows else torch.zeros_like(mb.attention_mask)
                aux = router_aux_loss(router, self.top_k, real)
                loss = loss + self.aux_coef * s.tokens * aux
                metrics.log("router_aux_loss", aux, s.tokens)
            scored = ScoredMinibatch(s.minibatch, mb, s.rows, s.n_local, lp, old, router, policy_version)
            for o in watching:
                o.minibatch(scored, metrics)
            if s.first:
                self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if s.last:
                if self.world == 1:
                    reshard(self.scorer)  # before the step changes the weights (gather_once_a_step)
                trainable = [p for p in self.scorer.parameters() if p.requires_grad]
                metrics.log("grad_norm", clip_grad_norm(trainable, self.cfg.optim.max_grad_norm))
                self.optimizer.step()
                self.scheduler.step()
        self.scorer.eval()  # an engine sharing this module samples in eval mode
        for o in watching:
            o.finished(self.scorer, metrics)
        return metrics.reduce(self.world)

    def _recorded_routing(self, shares: list[_Share]) -> list[torch.Tensor | None]:
        """Per share, R3's replayed routing: the position view of the engine's record; None otherwise."""
        if self.cfg.algo.routing_replay != "R3":
            return [None] * len(shares)
        if shares[0].batch.routed_experts is None:
            raise ValueError(
                "algo.routing_replay R3 replays the engine's recorded routing, and this batch has none: "
                "the engine must record it (engine.record_routing: true, an hf engine)"
            )
        return [position_routing(s.batch.routed_experts) for s in shares]

    def _reference_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingParams
    ) -> torch.Tensor:
        """lp_ref of the KL penalty: the frozen reference (full fine-tuning) or the base model, adapters off."""
        with torch.no_grad():
            if self.reference is not None:
                lp = self.reference(input_ids, attention_mask, sampling)[0]
                # over one rank a layer keeps its gathered copy after a forward, and only a backward would drop it:
                # without this the reference would be held twice for the run (3.1 GB more for "1b" in bf16)
                reshard(self.reference)
                return lp
            with self.policy.disable_adapter():
                return self.scorer(input_ids, attention_mask, sampling)[0]
