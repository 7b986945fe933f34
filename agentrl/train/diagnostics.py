"""What an update is watched with, without changing it: observers the step calls.

`Trainer.update` calls each observer's `minibatch` after scoring a minibatch (before its optimizer
step) and `finished` after the last step, on every rank (an observer may take part in collectives).
An observer only reads what the step computed, plus what it computes itself without gradients,
and logs into the update's `Metrics`. The trainer runs `Mismatch` and, for MoE policies,
`ExpertFlips` and `RouterDisagreement` on every update, and logs the batch's `staleness` when it knows its own
policy version; the training loop adds a `RowRecorder` for the trajectories it saves.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from agentrl.algo import sequence_stats
from agentrl.algo.loss import QUANTILES, Mean, Sample, quantile_keys
from agentrl.runs import TrainedView
from agentrl.train.batch import TrainBatch
from agentrl.train.config import AlgoConfig
from agentrl.train.scoring import Scorer


class Metrics:
    """An update's metrics: weighted means over minibatches, reduced over ranks once, at the end.

    A value (and a weight) may be a 0-dim tensor on the device: its sums stay there, and `reduce` reads them all
    back in one transfer, so logging never waits for the device. `policy_objective`'s metrics pool exactly
    (`add`): a `Mean` as its sum and count, a `Sample` as its values, whose quantiles are taken once over every
    micro-batch, minibatch and rank of the update."""

    def __init__(self) -> None:
        self._sums: dict[str, list] = {}  # key -> [Σ value·weight, Σ weight], each a float or a 0-dim tensor
        self._samples: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # key -> [(values, keep)]

    def log(self, key: str, value: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> None:
        s = self._sums.setdefault(key, [0.0, 0.0])
        if isinstance(value, torch.Tensor):
            value = value.detach().double()
        s[0] = s[0] + value * weight
        s[1] = s[1] + weight

    def add(self, key: str, metric: Mean | Sample | torch.Tensor, weight: float = 1.0) -> None:
        """A metric of `policy_objective`: a Mean pools by its count, a Sample by its values; a plain value is
        `log`ged with `weight`."""
        if isinstance(metric, Mean):
            s = self._sums.setdefault(key, [0.0, 0.0])
            s[0], s[1] = s[0] + metric.total.detach(), s[1] + metric.count.detach().double()
        elif isinstance(metric, Sample):
            self._samples.setdefault(key, []).append((metric.values.detach(), metric.keep))
        else:
            self.log(key, metric, weight)

    def reduce(self, world: int) -> dict[str, float]:
        keys, sampled = sorted(self._sums), sorted(self._samples)
        if world > 1:  # a rank without data lacks some keys: every rank reduces the union
            all_keys: list[tuple[list[str], list[str]]] = [([], []) for _ in range(world)]
            dist.all_gather_object(all_keys, (keys, sampled))
            keys = sorted({k for ks, _ in all_keys for k in ks})
            sampled = sorted({k for _, ks in all_keys for k in ks})
        rows = [self._sums.get(k, [0.0, 0.0]) for k in keys]
        parts = [pair for k in sampled for pair in self._samples.get(k, [])]
        on_device = [x.reshape(1) for row in rows for x in row if isinstance(x, torch.Tensor)]
        on_device += [t.flatten() for pair in parts for t in pair]
        # the one transfer: what was on the device comes back in the order it went, as floats
        values = torch.cat([x.double() for x in on_device]).cpu().tolist() if on_device else []
        at = itertools.accumulate((x.numel() for x in on_device), initial=0)
        read = (values[a:b] for a, b in itertools.pairwise(at))
        sums = torch.tensor(
            [[next(read)[0] if isinstance(x, torch.Tensor) else x for x in row] for row in rows], dtype=torch.float64
        ).reshape(len(rows), 2)
        if world > 1:
            dist.all_reduce(sums)
        out = {k: float(v / w) for k, (v, w) in zip(keys, sums.tolist(), strict=True) if w}
        kept: dict[str, list[float]] = {k: [] for k in sampled}
        for k in sampled:
            for _ in self._samples.get(k, []):
                kept[k] += itertools.compress(next(read), next(read))
        if world > 1:  # every rank's values, to take the quantiles over all of them
            gathered: list[dict[str, list[float]]] = [{} for _ in range(world)]
            dist.all_gather_object(gathered, kept)
            kept = {k: [v for g in gathered for v in g.get(k, [])] for k in sampled}
        q = torch.tensor(QUANTILES, dtype=torch.float64)
        for k in sampled:
            if kept[k]:
                taken = torch.tensor(kept[k], dtype=torch.float64).quantile(q)
                out |= dict(zip(quantile_keys(k), taken.tolist(), strict=True))
        return out


@dataclass
class ScoredMinibatch:
    """One minibatch as the step scored it, before its optimizer step."""

    index: int
    """m: how many optimizer steps of this update came before it"""
    batch: TrainBatch
    """this rank's share of the minibatch, or of one of its micro-batches (a stand-in row that counts nothing when
    it has none)"""
    rows: list[int]
    """the update's batch rows the share holds ([] for a stand-in)"""
    n_local: int
    """its sequences with generated tokens"""
    logprobs: torch.Tensor
    """lp_θ (B, L), with its graph: detach what you keep"""
    old_logprobs: torch.Tensor
    """lp_prox (B, L), the loss's ratio's reference: the engine's lp_b, or the learner's own before its first step
    on the batch under a behaviour weight"""
    router_logits: tuple[torch.Tensor, ...] | None
    """per layer (B·L, E), MoE policies"""
    policy_version: int | None = None
    """the learner's policy version before the update's first step, when the trainer was told it"""


class UpdateObserver:
    """Override either hook; both do nothing by default."""

    def minibatch(self, s: ScoredMinibatch, metrics: Metrics) -> None: ...

    def finished(self, scorer: Scorer, metrics: Metrics) -> None: ...


class Mismatch(UpdateObserver):
    """Engine against trainer on the same tokens, before any step (minibatch 0, the same weights that sampled
    it when the run is on-policy): mean |lp_θ − lp_b| and the k3 estimate of the sequence KL, per sequence."""

    def minibatch(self, s: ScoredMinibatch, metrics: Metrics) -> None:
        if s.index or not s.n_local:
            return
        on = s.batch.loss_mask.bool()
        d = torch.where(on, s.logprobs.detach() - s.batch.old_logprobs, 0.0)
        k3 = torch.where(on, d.exp() - d - 1, 0.0)
        per_sequence = k3.sum(-1) / on.sum(-1).clamp(min=1)
        metrics.add("mismatch_abs_logprob_diff", Mean.of(d.abs(), on))  # per token
        metrics.add("mismatch_seq_kl", Mean.of(per_sequence, on.any(-1)))  # per sequence


def staleness(token_versions: torch.Tensor, loss_mask: torch.Tensor, policy_version: int) -> dict[str, float]:
    """Of the trained tokens (loss mask 1), how many policy versions each is behind `policy_version`, the
    learner's before its first step on them: staleness_k, the count of tokens k behind for k = 0 to the
    largest seen, and staleness_mean and staleness_max."""
    versions = token_versions[loss_mask.bool()]
    if not len(versions):
        return {}
    behind = policy_version - versions
    if versions.min() < 0 or behind.min() < 0:
        raise ValueError(
            f"trained tokens of versions {versions.min()} to {versions.max()} cannot be trained by the "
            f"learner at version {policy_version}"
        )
    counts = torch.bincount(behind).tolist()
    hist = {f"staleness_{k}": float(c) for k, c in enumerate(counts)}
    return hist | {"staleness_mean": float(behind.double().mean()), "staleness_max": float(len(counts) - 1)}


FLIP_RATE_ROWS = 8
"""the expert flip rate is measured on this many sequences: one more forward of them after the update
(in a code_sandbox batch, 8 sequences hold ~2k generated tokens, an expert set per token and layer; 16 took 13% of
the default recipe's update)"""


def expert_sets(router_logits: tuple[torch.Tensor, ...], top_k: int, mask: torch.Tensor) -> torch.Tensor:
    """(layers, N) top-k expert sets of the masked tokens, as sorted index tuples packed in one int."""
    keep = mask.reshape(-1).bool()
    sets = [layer[keep].topk(top_k, -1).indices.sort(-1).values for layer in router_logits]  # (N, k) each
    E = router_logits[0].shape[-1]
    weights = E ** torch.arange(top_k, device=mask.device)
    return torch.stack([(s * weights).sum(-1) for s in sets])


class ExpertFlips(UpdateObserver):
    """MoE: the share of top-k expert sets (per generated token and layer) that the update changed, on the
    first `FLIP_RATE_ROWS` rows of minibatch 0, scored again after the last step."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self._before: tuple[tuple[torch.Tensor, ...], torch.Tensor, TrainBatch] | None = None

    def minibatch(self, s: ScoredMinibatch, metrics: Metrics) -> None:
        if s.index or s.router_logits is None or self._before is not None:  # minibatch 0's first micro-batch
            return
        k = min(FLIP_RATE_ROWS, len(s.batch))
        E = s.router_logits[0].shape[-1]
        # kept as logits: their sets are taken after the last step, where reading them back stalls no step
        first = tuple(r.detach().view(len(s.batch), -1, E)[:k].reshape(-1, E) for r in s.router_logits)
        self._before = (first, s.batch.loss_mask[:k], s.batch.select(list(range(k))))

    def finished(self, scorer: Scorer, metrics: Metrics) -> None:
        if self._before is None:
            return
        before, mask, mb = self._before
        self._before = None
        sets = expert_sets(before, self.top_k, mask)
        with torch.no_grad():  # every rank: the forward's collectives under FSDP2
            _, _, router = scorer(mb.input_ids, mb.attention_mask, mb.sampling, router=True)
        after = expert_sets(router, self.top_k, mb.loss_mask)
        if sets.numel():
            metrics.log("expert_flip_rate", (after != sets).double().mean(), sets.numel())


ROUTER_TURNS = 4
"""router disagreement is broken down per turn for turns 0 to ROUTER_TURNS − 1; later ones are pooled"""


def routing_differs(
    routed: torch.Tensor, router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which masked tokens with a record (`here`, (B, L), token 0 never) and, for each of them in row order, which
    MoE layers (`differ`, (n, layers) bool) route its predicting position t − 1 to another top-k set in the
    learner's forward than the engine's record says; the learner's set chosen as its routers choose (softmax in
    float32, then top-k). `routed` (B, L, layers, k): `TrainBatch.routed_experts`; `router_logits` per layer
    (B·L, E), the learner's at every position."""
    B, L, layers, k = routed.shape
    if len(router_logits) != layers:
        raise ValueError(f"the engine recorded routing of {layers} layers, the learner routes {len(router_logits)}")
    here = (routed[..., 0, 0] >= 0) & mask.bool()
    here[:, 0] = False
    engine = routed[:, 1:][here[:, 1:]].long().sort(-1).values  # (n, layers, k)
    E = router_logits[0].shape[-1]
    learner = [
        r.detach().reshape(B, L, E)[:, :-1][here[:, 1:]].float().softmax(-1).topk(k, -1).indices for r in router_logits
    ]
    differ = (engine != torch.stack(learner, 1).sort(-1).values).any(-1) if len(engine) else engine[..., 0].bool()
    return here, differ


def router_disagreement(
    routed: torch.Tensor,
    router_logits: tuple[torch.Tensor, ...],
    loss_mask: torch.Tensor,
    token_turns: torch.Tensor | None = None,
    token_versions: torch.Tensor | None = None,
    policy_version: int | None = None,
) -> dict[str, tuple[int, int]]:
    """The engine's recorded top-k expert sets against the learner's, per metric (sets that differ, sets compared).

    `routed` (B, L, layers, k): `TrainBatch.routed_experts`, token t's record being the routing of position
    t − 1 (the forward that sampled it); `router_logits` per layer (B·L, E): the learner's at every position.
    Compared: every (token, layer) of the generated tokens (loss mask 1) with a record, the learner's set
    chosen as its routers choose (softmax in float32, then top-k). `router_disagreement` counts (token, layer)
    pairs, `router_disagreement_tokens` tokens with any layer differing; the pairs again per turn of the token
    (`_turn{j}`, `_turn_later` from turn `ROUTER_TURNS` on) and per version lag, `policy_version` minus the
    token's version (`_lag{d}`, given both)."""
    layers = routed.shape[2]
    here, differ = routing_differs(routed, router_logits, loss_mask)
    n = int(here.sum())
    if not n:
        return {}
    here = here[:, 1:]
    counts = {
        "router_disagreement": (int(differ.sum()), differ.numel()),
        "router_disagreement_tokens": (int(differ.any(-1).sum()), n),
    }
    per_token = differ.sum(-1)  # (n,)

    def by(key: Callable[[int], str], group: torch.Tensor) -> None:  # group (n,): the pairs again per its value
        for g in group.unique().tolist():
            on = group == g
            counts[key(g)] = (int(per_token[on].sum()), int(on.sum()) * layers)

    if token_turns is not None:
        by(
            lambda j: f"router_disagreement_turn{j}" if j < ROUTER_TURNS else "router_disagreement_turn_later",
            token_turns[:, 1:][here].clamp(max=ROUTER_TURNS),
        )
    if token_versions is not None and policy_version is not None:
        by(lambda d: f"router_disagreement_lag{d}", policy_version - token_versions[:, 1:][here])
    return counts


class RouterDisagreement(UpdateObserver):
    """MoE, when the batch carries the engine's routing (`TrainBatch.routed_experts`): how often the learner's
    forward routes a generated token to other top-k experts than the engine did when it sampled it
    (`router_disagreement`), on minibatch 0, scored before any step, as `Mismatch` is: later minibatches are
    scored after the update's own steps, whose drift is the expert flip rate's, not the engine's (with M = 4 and
    the default recipe's learning rate it made the share 10% where the engine and the learner disagree on 0.6%).
    Weighted by the sets compared, so the update's value is the share over the ranks."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def minibatch(self, s: ScoredMinibatch, metrics: Metrics) -> None:
        b = s.batch
        if s.index or s.router_logits is None or b.routed_experts is None or not s.n_local:
            return
        if b.routed_experts.shape[-1] != self.top_k:
            raise ValueError(
                f"the engine recorded {b.routed_experts.shape[-1]} experts per token, the learner "
                f"routes to {self.top_k}"
            )
        counts = router_disagreement(
            b.routed_experts, s.router_logits, b.loss_mask, b.token_turns, b.token_versions, s.policy_version
        )
        for key, (differ, compared) in counts.items():
            metrics.log(key, differ / compared, compared)


@dataclass
class RowStats:
    """One trajectory as the update saw it, for the run's records (`agentrl view`)."""

    logprobs: list[float]
    """lp_θ per position of the row (0 on the first), scored when its minibatch was trained: before any
    step for minibatch 0, after `minibatch` steps of this update otherwise"""
    ratio: float
    """s_i, the sequence ratio against lp_prox at that moment"""
    clipped: float
    """the share of its generated tokens whose clipped branch was taken (GSPO: 0 or 1)"""
    minibatch: int
    router_differs: list[float] | None = None
    """MoE with the engine's routing record: per position of the row, the share of MoE layers whose top-k set the
    learner's forward (the one `logprobs` come from) chose otherwise than the engine, at generated tokens; -1
    elsewhere"""


@dataclass
class RowRecorder(UpdateObserver):
    """Records `rows` of the update's batch (every rank passes the same); their stats land in `stats` on rank 0."""

    rows: set[int]
    algo: AlgoConfig
    stats: dict[int, RowStats] = field(default_factory=dict)

    def minibatch(self, s: ScoredMinibatch, metrics: Metrics) -> None:
        local = [i for i, row in enumerate(s.rows) if row in self.rows]  # only these leave the device
        if not local or not s.n_local:
            return
        sel = s.batch.select(local)
        L, a = sel.input_ids.shape[1], self.algo
        lp = s.logprobs[local, :L].detach()
        ratio, clipped = sequence_stats(
            lp,
            s.old_logprobs[local, :L],
            sel.advantages,
            sel.loss_mask,
            mode=a.loss,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
        )
        lengths = sel.attention_mask.sum(-1).tolist()
        lp = lp.float().cpu()
        differs = None
        if s.router_logits is not None and s.batch.routed_experts is not None:
            here, differ = routing_differs(s.batch.routed_experts, s.router_logits, s.batch.loss_mask)
            share = torch.full(here.shape, -1.0, device=differ.device)
            share[here] = differ.float().mean(-1)
            differs = share[local, :L].cpu()
        for j, i in enumerate(local):
            n = lengths[j]
            self.stats[s.rows[i]] = RowStats(
                lp[j, :n].tolist(),
                float(ratio[j]),
                float(clipped[j]),
                s.index,
                None if differs is None else differs[j, :n].tolist(),
            )

    def finished(self, scorer: Scorer, metrics: Metrics) -> None:
        """Every rank's rows, on rank 0."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return
        parts: list[dict[int, RowStats]] | None = [{} for _ in range(world)] if dist.get_rank() == 0 else None
        dist.gather_object(self.stats, parts, dst=0)
        self.stats = {k: v for p in parts for k, v in p.items()} if parts is not None else {}

    def views(self, batch: TrainBatch) -> dict[str, TrainedView]:
        """By episode id, what the update saw of each recorded row, per token aligned with the trajectory's
        ids and rounded (a record); an episode of several sequences (rows) gets them laid end to end, its ratio
        and clipped share the mean of theirs."""
        rows: dict[str, list[int]] = {}
        offsets = batch.row_offsets or [0] * len(batch)
        for i in sorted(self.stats, key=offsets.__getitem__):
            rows.setdefault(batch.episode_ids[i], []).append(i)
        views = {}
        for episode, mine in rows.items():
            stats = [self.stats[i] for i in mine]
            advantages: list[float] = []
            for i, r in zip(mine, stats, strict=True):
                advantages += batch.advantages[i, : len(r.logprobs)].tolist()
            differs = [r.router_differs for r in stats]
            views[episode] = TrainedView(
                advantages=[round(a, 4) for a in advantages],
                trainer_logprobs=[round(x, 4) for r in stats for x in r.logprobs],
                ratio=sum(r.ratio for r in stats) / len(stats),
                clipped=sum(r.clipped for r in stats) / len(stats),
                minibatch=stats[0].minibatch,
                router_differs=None if None in differs else [round(x, 3) for d in differs for x in d],
                sequence_ratios=[r.ratio for r in stats] if len(stats) > 1 else None,
            )
        return views
