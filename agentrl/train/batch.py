"""From rollout groups to the tensors of one update: ids, loss mask, lp_b, advantages, token versions and
turns, and the engine's routing when it recorded it.

Shapes: B rows, T tokens (right-padded), K turns. A row is one token sequence of a trajectory: one row per
trajectory, or K rows for an episode of K sequences (`Trajectory.sequences`), each weighing 1/K in the
objective (`row_weights`), so that an episode weighs the same however many sequences it took. Advantages are the
episode's, computed over its whole record, then cut into its rows: a generated token is in the loss mask of the
one row it was generated in. Every per-token tensor is aligned with `input_ids`: position t holds token t's loss
mask, its engine logprob lp_b, its advantage, its policy version, its turn and (MoE) the experts that sampled it;
the trainer scores token t from the hidden state at t − 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from agentrl.algo import gigpo_advantages, outcome_advantages, per_token, turn_advantages
from agentrl.engine.base import SamplingParams
from agentrl.rollout import Group, Segment, Trajectory
from agentrl.train.config import AlgoConfig


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, T) long, 0 on padding
    attention_mask: torch.Tensor  # (B, T) 1 on real tokens
    loss_mask: torch.Tensor  # (B, T) 1 on generated tokens
    old_logprobs: torch.Tensor  # (B, T) lp_b: the engine's logprob of each generated token
    advantages: torch.Tensor  # (B, T) A_{i,t} (constant per sequence for "outcome")
    sampling: SamplingParams  # the distribution the tokens were drawn from (lp_θ is scored under it)
    episode_ids: list[str] = field(default_factory=list)  # row i's trajectory, for the run's records
    row_offsets: list[int] = field(default_factory=list)  # where row i starts in its trajectory's token_ids
    row_weights: torch.Tensor | None = None
    """(B,) float: row i's weight in the objective, 1/K for each of an episode's K sequences; None: every row
    weighs 1 (every episode is one sequence)"""
    token_versions: torch.Tensor | None = None  # (B, T) long: Trajectory.token_versions, -1 on padding; None: unknown
    token_turns: torch.Tensor | None = None  # (B, T) long: Trajectory.turn_index, -1 on padding; None: unknown
    routed_experts: torch.Tensor | None = None
    """(B, T, layers, k) int16, MoE: at token t, the experts per layer the engine sent position t − 1 to, the
    forward that predicted token t (`Trajectory.routed_experts`, in the order the engine chose them), for prompt,
    observation and generated tokens; -1 where nothing was recorded (token 0, padding, a trajectory without a
    record; an old-format record has generated tokens only). None: no trajectory of the batch has one"""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: v for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}

    def to(self, device: torch.device | str) -> TrainBatch:
        return replace(self, **{k: v.to(device) for k, v in self._tensors().items()})

    def select(self, rows: torch.Tensor | list[int]) -> TrainBatch:
        """The given rows, trimmed to their longest."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        T = max(int(self.attention_mask[rows].sum(-1).max()), 1) if len(rows) else 1
        listed = rows.tolist()
        return replace(
            self,
            **{k: v[rows, :T] if v.dim() > 1 else v[rows] for k, v in self._tensors().items()},
            episode_ids=[self.episode_ids[r] for r in listed] if self.episode_ids else [],
            row_offsets=[self.row_offsets[r] for r in listed] if self.row_offsets else [],
        )

    def row_weight(self, rows: torch.Tensor) -> torch.Tensor:
        """(len(rows),) the rows' weights (1 without `row_weights`)."""
        return torch.ones(len(rows)) if self.row_weights is None else self.row_weights[rows].cpu()


@dataclass
class BatchInfo:
    groups: int
    trajectories: int
    sequences: int
    """rows: the trajectories' token sequences"""
    degenerate_groups: int
    """groups whose members all had the same return (zero advantage)"""
    filtered_groups: int
    """degenerate groups left out (filter_degenerate_groups)"""
    shared_steps: float | None = None
    """gigpo: the share of turns in a step group of more than one (none: GiGPO is its episode term alone)"""


def routed_experts(rows: list[tuple[Trajectory, int, int]], T: int) -> torch.Tensor | None:
    """(B, T, layers, k) int16: each row's (a trajectory's tokens [a, b)) recorded experts, -1 where it has none;
    None when no trajectory has a record. A record aligned with the tokens fills every token it holds; an
    old-format one (one entry per generated token, one-sequence trajectories only) fills the generated tokens;
    any other length cannot be aligned: -1."""
    trajs = {id(t): t for t, _, _ in rows}.values()
    shape = next((torch.tensor(e).shape for t in trajs for e in t.routed_experts or () if e is not None), None)
    if shape is None:
        return None
    out = torch.full((len(rows), T, *shape), -1, dtype=torch.int16)
    for i, (t, a, b) in enumerate(rows):
        record = t.routed_experts or []
        if len(record) == len(t.token_ids):
            at = [p - a for p in range(a, b) if record[p] is not None]
            record = [record[p + a] for p in at]
        else:
            at = [p for p, s in enumerate(t.segments) if s == Segment.GENERATED]
        if record and len(record) == len(at):
            out[i, at] = torch.tensor(record, dtype=torch.int16)
    return out


def build_batch(groups: list[Group], algo: AlgoConfig) -> tuple[TrainBatch, BatchInfo]:
    """Advantages per group (trainable members only: failed and dropped ones are left out), then tensors."""
    trajs, group_of = [], []
    for k, g in enumerate(groups):
        members = g.trainable
        trajs += members
        group_of += [k] * len(members)
    if not trajs:
        raise ValueError("no trainable trajectory in the batch (every episode failed or was dropped)")
    if not any(t.num_generated for t in trajs):  # no turn to index per-turn advantages by, nothing to train
        raise ValueError("no trainable trajectory generated a token (every episode ended before its first turn)")
    settings = {(t.sampling.temperature, t.sampling.top_k, t.sampling.top_p) for t in trajs}
    if len(settings) > 1:
        raise ValueError(f"one batch must share one sampling distribution; found {sorted(settings)}")
    index = {gi: k for k, gi in enumerate(dict.fromkeys(group_of))}
    gids = torch.tensor([index[gi] for gi in group_of])  # (N,) dense group index
    N = len(trajs)

    def padded(values: list[list], dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
        out = torch.full((len(values), max(map(len, values))), fill, dtype=dtype)
        for i, v in enumerate(values):
            out[i, : len(v)] = torch.tensor(v, dtype=dtype)
        return out

    # advantages over each trajectory's whole record (N, T), then cut into its rows
    loss_mask = padded([t.loss_mask for t in trajs], torch.long)
    if algo.advantage == "outcome":
        adv = outcome_advantages(
            torch.tensor([t.outcome_reward for t in trajs], dtype=torch.float64), gids, scale=algo.scale_advantages
        )
        advantages = adv.values[:, None] * loss_mask
    else:
        K = max(len(t.turns) for t in trajs)
        rewards = torch.zeros(N, K, dtype=torch.float64)
        turn_mask = torch.zeros(N, K)
        # (N, K) each turn's state as a dense id (gigpo's step groups); a turn without one is a state of its own
        keys = torch.zeros(N, K, dtype=torch.long)
        ids: dict[str | tuple[int, int], int] = {}
        for i, t in enumerate(trajs):
            for turn in t.turns:
                rewards[i, turn.index], turn_mask[i, turn.index] = turn.reward, 1
                keys[i, turn.index] = ids.setdefault(turn.state_key or (i, turn.index), len(ids))
        if algo.advantage == "gigpo":
            adv = gigpo_advantages(
                rewards, turn_mask, keys, gids, gamma=algo.gamma, omega=algo.gigpo_omega, scale=algo.scale_advantages
            )
        else:
            adv = turn_advantages(rewards, turn_mask, gids, gamma=algo.gamma, scale=algo.scale_advantages)
        advantages = per_token(adv.values, padded([t.turn_index for t in trajs], torch.long), loss_mask)
    rows = [(i, a, b) for i, t in enumerate(trajs) for a, b in t.sequence_spans()]  # (trajectory, span) per row
    of = [i for i, _, _ in rows]  # (B,) each row's trajectory

    def cut(values: list[list], dtype: torch.dtype, fill: int = 0) -> torch.Tensor:  # per trajectory -> per row
        return padded([list(values[i][a:b]) for i, a, b in rows], dtype, fill)

    sequences = [len(t.sequences) + 1 for t in trajs]
    batch = TrainBatch(
        input_ids=cut([t.token_ids for t in trajs], torch.long),
        attention_mask=padded([[1] * (b - a) for _, a, b in rows], torch.long),
        loss_mask=cut(loss_mask.tolist(), torch.long),
        old_logprobs=cut([t.logprobs for t in trajs], torch.float32),
        advantages=cut(advantages.float().tolist(), torch.float32),
        sampling=trajs[0].sampling,
        episode_ids=[trajs[i].episode_id for i in of],
        row_offsets=[a for _, a, _ in rows],
        row_weights=torch.tensor([1 / sequences[i] for i in of]) if max(sequences) > 1 else None,
        token_versions=cut([t.token_versions for t in trajs], torch.long, fill=-1),
        token_turns=cut([t.turn_index for t in trajs], torch.long, fill=-1),
        routed_experts=routed_experts([(trajs[i], a, b) for i, a, b in rows], max(b - a for _, a, b in rows)),
    )
    degenerate = int(torch.unique(gids[adv.degenerate]).numel())
    info = BatchInfo(
        groups=len(index),
        trajectories=N,
        sequences=len(rows),
        degenerate_groups=degenerate,
        filtered_groups=0,
        shared_steps=getattr(adv, "shared_steps", None),
    )
    if algo.filter_degenerate_groups and degenerate:
        keep = (~adv.degenerate[of]).nonzero()[:, 0]
        if not len(keep):
            raise ValueError("every group had equal rewards: nothing to learn from this batch")
        batch, info.filtered_groups = batch.select(keep), degenerate
    return batch, info
