"""One GSPO(-token) update of the policy from a rollout batch, on one or many ranks.

The batch is split into M minibatches, one optimizer step each (gradients clipped to a
global norm). With several ranks each takes a disjoint share of every minibatch and FSDP2
averages gradients; each rank's loss is rescaled so that the update is that of the whole
minibatch: J is a mean over sequences, so rank r's mean over its n_r sequences weighs
n_r / n (× the world size, which FSDP's average divides away).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn

from agentrl.algo import policy_loss, sequence_stats
from agentrl.engine.base import SamplingParams
from agentrl.train.batch import TrainBatch
from agentrl.train.config import AlgoConfig, TrainerConfig, lr_factor
from agentrl.train.logprobs import target_logprobs
from agentrl.train.policy import causal_lm, prepare, train_device


class Scorer(nn.Module):
    """lp_θ of every token given its prefix, without the (B, T, V) logits; the FSDP2 root.

    Position t of the output scores token t from the hidden state at t − 1 (position 0: 0).

    Length buckets: rows are scored in chunks of similar length (sorted, at most
    `chunk_tokens` padded positions each) and put back in order, so one long episode does
    not pad the whole batch to its length (attention and masks grow with B·L²). Every row is
    scored on its own, so the results and, through one backward over all chunks, the
    gradients are those of the unchunked batch.

    Shared prefix: the rows of a rollout batch start with the same tokens (the system prompt
    and tool schemas, for a group also the task), often most of each row. When all rows of a
    chunk share their first P ≥ `min_shared_prefix` tokens, those P are run once (one row, its
    KV cache broadcast to the rows) and only the suffixes run per row: the same lp_θ, entropy
    and router logits, and, since the broadcast sums the rows' gradients into the one prefix,
    the same gradients, for about P·(B − 1) fewer token forwards and backwards. Off under
    activation checkpointing (its recomputation would replay the cache update).
    """

    def __init__(self, policy: nn.Module, *, min_shared_prefix: int = 32, chunk_tokens: int = 16384) -> None:
        super().__init__()
        self.policy = policy
        self.min_shared_prefix = min_shared_prefix
        self.chunk_tokens = chunk_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, *,
                entropy: bool = False, router: bool = False):  # fmt: skip
        """(lp (B, L), entropy (B, L) or None, router logits per layer (B·L, E) or None)."""
        B, L = input_ids.shape
        lengths = attention_mask.sum(-1)
        order = torch.argsort(lengths, descending=True, stable=True)
        parts, start = [], 0
        while start < B:
            Lc = max(int(lengths[order[start]]), 1)  # the chunk's longest row: the first, sorted
            rows = order[start : start + max(1, self.chunk_tokens // Lc)]
            parts.append(self._score(input_ids[rows, :Lc], attention_mask[rows, :Lc], params, entropy, router))
            start += len(rows)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(B, device=order.device)

        def merge(chunks: list[torch.Tensor]) -> torch.Tensor:  # (n, Lc, ...) each -> (B, L, ...) in row order
            return torch.cat([F.pad(c, (0, 0) * (c.dim() - 2) + (0, L - c.shape[1])) for c in chunks])[inverse]

        lp = merge([p[0] for p in parts])
        ent = merge([p[1] for p in parts]) if entropy else None
        routed = None
        if router:
            routed = tuple(merge([p[2][k] for p in parts]).reshape(B * L, -1) for k in range(len(parts[0][2])))
        return lp, ent, routed

    def _score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, entropy: bool,
               router: bool) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:  # fmt: skip
        """One chunk: lp and entropy (B, L), router logits per layer (B, L, E)."""
        lm = causal_lm(self.policy)
        decoder, head = lm.get_decoder(), lm.get_output_embeddings().weight
        kwargs = {"output_router_logits": True} if router else {}
        B, L = input_ids.shape
        P = self._shared_prefix(input_ids, attention_mask)
        if P == 0:
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            lp, ent = target_logprobs(out.last_hidden_state[:, :-1], head, input_ids[:, 1:], params, entropy=entropy)
            routed = tuple(r.view(B, L, -1) for r in out.router_logits) if router else None
        else:
            pre = decoder(input_ids=input_ids[:1, :P], use_cache=True, **kwargs)
            for layer in pre.past_key_values.layers:  # one row's KV, seen by all B rows (gradients sum back)
                layer.keys, layer.values = layer.keys.expand(B, -1, -1, -1), layer.values.expand(B, -1, -1, -1)
            suf = decoder(input_ids=input_ids[:, P:], attention_mask=attention_mask,
                          past_key_values=pre.past_key_values, use_cache=True, **kwargs)  # fmt: skip
            # tokens 1..P-1 from the shared row; tokens P..L-1 from h at P-1 (shared) and the suffixes
            lp0, ent0 = target_logprobs(pre.last_hidden_state[:, :-1], head, input_ids[:1, 1:P], params,
                                        entropy=entropy)  # fmt: skip
            h = torch.cat([pre.last_hidden_state[:, -1:].expand(B, 1, -1), suf.last_hidden_state[:, :-1]], 1)
            lp1, ent1 = target_logprobs(h, head, input_ids[:, P:], params, entropy=entropy)
            lp = torch.cat([lp0.expand(B, -1), lp1], 1)
            ent = torch.cat([ent0.expand(B, -1), ent1], 1) if entropy else None
            routed = None
            if router:
                routed = tuple(torch.cat([a.view(1, P, -1).expand(B, P, -1), b.view(B, L - P, -1)], 1)
                               for a, b in zip(pre.router_logits, suf.router_logits, strict=True))  # fmt: skip
        pad = lp.new_zeros(B, 1)
        return torch.cat([pad, lp], 1), torch.cat([pad, ent], 1) if entropy else None, routed

    def _shared_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
        """P: the tokens every row starts with, kept below every row's length; 0 when not worth sharing."""
        lm = causal_lm(self.policy)
        # transformers 5 renamed the flag (the old name warns)
        checkpointing = getattr(lm, "is_activation_checkpointing", None)
        if checkpointing is None:
            checkpointing = lm.is_gradient_checkpointing
        if input_ids.shape[0] < 2 or checkpointing:
            return 0
        same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)  # (L,)
        shared = min(int(same.long().cumprod(0).sum()), int(attention_mask.sum(-1).min()) - 1)
        return shared if shared >= self.min_shared_prefix else 0


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
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2


FLIP_RATE_ROWS = 8
"""the expert flip rate is measured on this many sequences: one more forward of them after the update
(in a code_sandbox batch, 8 sequences hold ~2k generated tokens, an expert set per token and layer; 16 took 13% of
the default recipe's update)"""


def _expert_sets(router_logits: tuple[torch.Tensor, ...], top_k: int, mask: torch.Tensor) -> torch.Tensor:
    """(layers, N) top-k expert sets of the masked tokens, as sorted index tuples packed in one int."""
    keep = mask.reshape(-1).bool()
    sets = [layer[keep].topk(top_k, -1).indices.sort(-1).values for layer in router_logits]  # (N, k) each
    E = router_logits[0].shape[-1]
    weights = E ** torch.arange(top_k, device=mask.device)
    return torch.stack([(s * weights).sum(-1) for s in sets])


@dataclass
class _Share:
    batch: TrainBatch
    n_local: int  # sequences with generated tokens on this rank
    n_global: int
    rows: list[int]  # the batch rows of `batch` (none when this rank holds a stand-in row)


@dataclass
class RowStats:
    """One trajectory as the update saw it, for the run's records (`agentrl view`)."""

    logprobs: list[float]
    """lp_θ per position of the row (0 on the first), scored when its minibatch was trained: before any
    step for minibatch 0, after `minibatch` steps of this update otherwise"""
    ratio: float
    """s_i, the sequence ratio against lp_b at that moment"""
    clipped: float
    """the share of its generated tokens whose clipped branch was taken (GSPO: 0 or 1)"""
    minibatch: int


@dataclass
class Record:
    """Which batch rows `Trainer.update` records (every rank passes the same), and their stats (rank 0)."""

    rows: set[int]
    stats: dict[int, RowStats] = field(default_factory=dict)


class Trainer:
    def __init__(self, cfg: TrainerConfig, policy: nn.Module, reference: nn.Module | None = None) -> None:
        """`reference`: the KL penalty's frozen policy for full fine-tuning (a copy of the starting
        weights, loaded from the model path: a resume rebuilds it from there, never from a checkpoint).
        A LoRA policy needs none: its reference is the base model, adapters off."""
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.policy = policy
        self.scorer = Scorer(policy)
        self.device = train_device()
        lora = hasattr(policy, "disable_adapter")
        if cfg.algo.kl_coef and not lora and reference is None:
            raise ValueError("algo.kl_coef with full fine-tuning needs a reference policy (a frozen copy of the "
                             "starting weights); with LoRA the base model is the reference")  # fmt: skip
        self.reference = Scorer(reference.requires_grad_(False).eval()) if cfg.algo.kl_coef and not lora else None
        prepare(policy, cfg.model, self.device, root=self.scorer)
        if self.reference is not None:  # sharded like the policy; no backward, so no checkpointing
            prepare(reference, cfg.model.model_copy(update={"activation_checkpointing": False}), self.device,
                    root=self.reference)  # fmt: skip
        config = causal_lm(policy).config
        self.top_k = getattr(config, "num_experts_per_tok", 0)
        self.moe = bool(self.top_k) and bool(getattr(config, "num_experts", getattr(config, "num_local_experts", 0)))
        self.aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0)) if cfg.model.router_aux_loss else 0.0
        trainable = [p for p in self.scorer.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(trainable, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, o.warmup_steps, o.decay_steps, o.min_lr_ratio)
        )

    # -- data split --------------------------------------------------------------------

    def _minibatches(self, batch: TrainBatch) -> list[_Share]:
        M = min(self.cfg.optim.minibatches, len(batch))
        order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(self.cfg.seed))
        shares = []
        for m in range(M):
            rows = order[m::M]
            n_global = int(batch.loss_mask[rows].any(-1).sum())
            mine = rows[self.rank :: self.world]
            if len(mine) == 0:  # every rank runs forward and backward (FSDP's collectives): a row that counts nothing
                mb = batch.select(rows[:1])
                mb.loss_mask = torch.zeros_like(mb.loss_mask)
                shares.append(_Share(mb, 0, n_global, []))
            else:
                mb = batch.select(mine)
                shares.append(_Share(mb, int(mb.loss_mask.any(-1).sum()), n_global, mine.tolist()))
        return shares

    # -- the update --------------------------------------------------------------------

    def update(self, batch: TrainBatch, record: Record | None = None) -> dict[str, float]:
        """M optimizer steps over the batch; returns metrics averaged over minibatches (and ranks).

        `record` (every rank passes one or none): its rows' `RowStats` land in `record.stats` on rank 0."""
        algo = self.cfg.algo
        rows: dict[int, RowStats] = {}
        shares = self._minibatches(batch)
        metrics: dict[str, list[float]] = {}

        def log(key: str, value: float, weight: float = 1.0) -> None:
            metrics.setdefault(key, []).extend([value * weight, weight])

        recomputed = []
        if algo.old_logprobs == "recompute":  # lp_b from the trainer, before any step
            with torch.no_grad():
                for s in shares:
                    lp, _, _ = self.scorer(s.batch.input_ids, s.batch.attention_mask, s.batch.sampling)
                    recomputed.append(lp)
        routing_before = None
        self.scorer.train()
        for m, s in enumerate(shares):
            mb = s.batch
            lp, entropy, router = self.scorer(mb.input_ids, mb.attention_mask, mb.sampling, entropy=True,
                                              router=self.moe)  # fmt: skip
            extra = {}
            old = mb.old_logprobs
            if recomputed:
                old = recomputed[m]
                if algo.tis_cap is not None:
                    extra = {"behaviour_logprobs": mb.old_logprobs, "tis_cap": algo.tis_cap}
            if algo.kl_coef:
                extra |= {"ref_logprobs": self._reference_logprobs(mb), "kl_coef": algo.kl_coef}
            if s.n_local:
                loss, mm = policy_loss(lp, old, mb.advantages, mb.loss_mask, mode=algo.loss, clip_low=algo.clip_low,
                                       clip_high=algo.clip_high, **extra)  # fmt: skip
                for k, v in mm.items():
                    if k != "sequences":
                        log(k, v, s.n_local)
                if m == 0:  # before any step: lp_θ is the trainer's view of the behaviour policy
                    log("mismatch_abs_logprob_diff", _mismatch(lp, mb, recomputed, "abs"), s.n_local)
                    log("mismatch_seq_kl", _mismatch(lp, mb, recomputed, "kl"), s.n_local)
                log("entropy", float((entropy * mb.loss_mask).sum() / mb.loss_mask.sum()), s.n_local)
                if record is not None:
                    rows |= _row_stats(lp, old, mb, s.rows, record.rows, m, algo)
                log("loss", float(loss.detach()), s.n_local)
                loss = loss * (self.world * s.n_local / max(s.n_global, 1))
            else:
                loss = lp.sum() * 0.0  # keeps this rank in the collectives
            if router is not None and self.aux_coef:
                aux = router_aux_loss(router, self.top_k, mb.attention_mask)
                loss = loss + self.aux_coef * aux
                log("router_aux_loss", float(aux.detach()))
            if router is not None and m == 0:  # the flip rate's sample: the first rows of the first minibatch
                k = min(FLIP_RATE_ROWS, len(mb))
                first = tuple(r.view(len(mb), -1, r.shape[-1])[:k].reshape(-1, r.shape[-1]) for r in router)
                routing_before = (_expert_sets(first, self.top_k, mb.loss_mask[:k]), mb.select(list(range(k))))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            trainable = [p for p in self.scorer.parameters() if p.requires_grad]
            log("grad_norm", clip_grad_norm(trainable, self.cfg.optim.max_grad_norm))
            self.optimizer.step()
            self.scheduler.step()
        self.scorer.eval()  # an engine sharing this module samples in eval mode
        if routing_before is not None:  # the same data after every step: how many expert choices changed
            sets, mb = routing_before
            with torch.no_grad():
                _, _, router = self.scorer(mb.input_ids, mb.attention_mask, mb.sampling, router=True)
            after = _expert_sets(router, self.top_k, mb.loss_mask)
            if sets.numel():
                log("expert_flip_rate", float((after != sets).float().mean()), sets.numel())
        if record is not None:
            record.stats |= self._gather(rows)
        return self._reduce(metrics)

    def _gather(self, rows: dict[int, RowStats]) -> dict[int, RowStats]:
        """Every rank's rows, on rank 0."""
        if self.world == 1:
            return rows
        parts: list[dict[int, RowStats]] | None = [{} for _ in range(self.world)] if self.rank == 0 else None
        dist.gather_object(rows, parts, dst=0)
        return {k: v for p in parts for k, v in p.items()} if parts is not None else {}

    def _reference_logprobs(self, mb: TrainBatch) -> torch.Tensor:
        """lp_ref of the KL penalty: the frozen reference (full fine-tuning) or the base model, adapters off."""
        with torch.no_grad():
            if self.reference is not None:
                return self.reference(mb.input_ids, mb.attention_mask, mb.sampling)[0]
            with self.policy.disable_adapter():
                return self.scorer(mb.input_ids, mb.attention_mask, mb.sampling)[0]

    def _reduce(self, metrics: dict[str, list[float]]) -> dict[str, float]:
        """Weighted means over minibatches and ranks."""
        keys = sorted(metrics)
        if self.world > 1:  # a rank without data lacks some keys: every rank reduces the union
            all_keys: list[list[str]] = [[] for _ in range(self.world)]
            dist.all_gather_object(all_keys, keys)
            keys = sorted({k for ks in all_keys for k in ks})
        sums = torch.tensor([[sum(metrics.get(k, [])[0::2]), sum(metrics.get(k, [])[1::2])] for k in keys],
                            dtype=torch.float64)  # fmt: skip
        if self.world > 1:
            dist.all_reduce(sums)
        return {k: float(v / w) for k, (v, w) in zip(keys, sums.tolist(), strict=True) if w}


def _row_stats(lp: torch.Tensor, old: torch.Tensor, mb: TrainBatch, rows: list[int], wanted: set[int],
               minibatch: int, algo: AlgoConfig) -> dict[int, RowStats]:  # fmt: skip
    """The `wanted` batch rows among this minibatch's `rows` (only those leave the device)."""
    local = [i for i, row in enumerate(rows) if row in wanted]
    if not local:
        return {}
    sel = mb.select(local)
    L = sel.input_ids.shape[1]
    ratio, clipped = sequence_stats(lp[local, :L], old[local, :L], sel.advantages, sel.loss_mask, mode=algo.loss,
                                    clip_low=algo.clip_low, clip_high=algo.clip_high)  # fmt: skip
    lengths = sel.attention_mask.sum(-1).tolist()
    lp = lp[local, :L].detach().float().cpu()
    return {rows[i]: RowStats(lp[j, : lengths[j]].tolist(), float(ratio[j]), float(clipped[j]), minibatch)
            for j, i in enumerate(local)}  # fmt: skip


def _mismatch(lp: torch.Tensor, mb: TrainBatch, recomputed: list[torch.Tensor], kind: str) -> float:
    """Engine against trainer on the same tokens, before any update: mean |Δ| or the k3 KL per sequence."""
    trainer = recomputed[0] if recomputed else lp.detach()
    on = mb.loss_mask.bool()
    d = torch.where(on, trainer.detach() - mb.old_logprobs, 0.0)
    if kind == "abs":
        return float(d.abs()[on].mean())
    k3 = torch.where(on, d.exp() - d - 1, 0.0)
    has = on.any(-1)
    return float((k3.sum(-1)[has] / on.sum(-1)[has]).mean())


def full_state_dict(scorer: Scorer) -> dict[str, torch.Tensor]:
    """The policy's full (unsharded) weights on the CPU, under the policy's own key names. Every rank calls it."""
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(scorer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach() for k, v in scorer.state_dict().items()}
    return {k.removeprefix("policy."): v for k, v in state.items()}


async def sync_weights(trainer: Trainer, engine) -> int | None:
    """Hand the updated weights to the engine; returns its new policy version (None on ranks > 0).

    - the `hf` engine holding this very module (one process, no sharding): nothing to copy,
      the version is bumped (run `Trainer.update` inside `engine.paused()`);
    - a LoRA policy: only the adapter is sent;
    - otherwise the full state dict, gathered from the shards.
    """
    shared = getattr(engine, "model", None) in (trainer.policy, causal_lm(trainer.policy))
    if shared and not dist.is_initialized():
        return await engine.update_weights()
    state = full_state_dict(trainer.scorer)
    if trainer.rank != 0:
        return None
    if hasattr(trainer.policy, "peft_config"):
        from peft import get_peft_model_state_dict

        return await engine.update_weights(lora=get_peft_model_state_dict(trainer.policy, state_dict=state))
    return await engine.update_weights(state)
