"""From rollout groups to the tensors of one update: ids, loss mask, lp_b, advantages, token versions and
turns, and the engine's routing when it recorded it.

Shapes: B trajectories, T tokens (right-padded), K turns. Every per-token tensor is aligned
with `input_ids`: position t holds token t's loss mask, its engine logprob lp_b, its
advantage, its policy version, its turn and (MoE) the experts that sampled it; the trainer scores
token t from the hidden state at t − 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from agentrl.algo import outcome_advantages, per_token, turn_advantages
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
        """The given trajectories, trimmed to their longest."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        T = max(int(self.attention_mask[rows].sum(-1).max()), 1) if len(rows) else 1
        ids = [self.episode_ids[r] for r in rows.tolist()] if self.episode_ids else []
        return replace(self, **{k: v[rows, :T] for k, v in self._tensors().items()}, episode_ids=ids)


@dataclass
class BatchInfo:
    groups: int
    trajectories: int
    degenerate_groups: int
    """groups whose members all had the same return (zero advantage)"""
    filtered_groups: int
    """degenerate groups left out (filter_degenerate_groups)"""


def routed_experts(trajs: list[Trajectory], T: int) -> torch.Tensor | None:
    """(B, T, layers, k) int16: each trajectory's recorded experts at its tokens, -1 where it has none; None when
    no trajectory has a record. A record aligned with the tokens fills every token it holds; an old-format one
    (one entry per generated token) fills the generated tokens; any other length cannot be aligned: -1."""
    shape = next((torch.tensor(e).shape for t in trajs for e in t.routed_experts or () if e is not None), None)
    if shape is None:
        return None
    out = torch.full((len(trajs), T, *shape), -1, dtype=torch.int16)
    for i, t in enumerate(trajs):
        record = t.routed_experts or []
        if len(record) == len(t.token_ids):
            at = [p for p, e in enumerate(record) if e is not None]
            record = [record[p] for p in at]
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
    settings = {(t.sampling.temperature, t.sampling.top_k, t.sampling.top_p) for t in trajs}
    if len(settings) > 1:
        raise ValueError(f"one batch must share one sampling distribution; found {sorted(settings)}")
    index = {gi: k for k, gi in enumerate(dict.fromkeys(group_of))}
    gids = torch.tensor([index[gi] for gi in group_of])  # (B,) dense group index
    B, T = len(trajs), max(len(t.token_ids) for t in trajs)

    def padded(values: list[list], dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
        out = torch.full((B, T), fill, dtype=dtype)
        for i, v in enumerate(values):
            out[i, : len(v)] = torch.tensor(v, dtype=dtype)
        return out

    loss_mask = padded([t.loss_mask for t in trajs], torch.long)
    if algo.advantage == "outcome":
        adv = outcome_advantages(
            torch.tensor([t.outcome_reward for t in trajs], dtype=torch.float64), gids, scale=algo.scale_advantages
        )
        advantages = adv.values[:, None] * loss_mask
    else:
        K = max(len(t.turns) for t in trajs)
        rewards = torch.zeros(B, K, dtype=torch.float64)
        turn_mask = torch.zeros(B, K)
        for i, t in enumerate(trajs):
            for turn in t.turns:
                rewards[i, turn.index], turn_mask[i, turn.index] = turn.reward, 1
        adv = turn_advantages(rewards, turn_mask, gids, gamma=algo.gamma, scale=algo.scale_advantages)
        advantages = per_token(adv.values, padded([t.turn_index for t in trajs], torch.long), loss_mask)
    batch = TrainBatch(
        input_ids=padded([t.token_ids for t in trajs], torch.long),
        attention_mask=padded([[1] * len(t.token_ids) for t in trajs], torch.long),
        loss_mask=loss_mask,
        old_logprobs=padded([t.logprobs for t in trajs], torch.float32),
        advantages=advantages.float(),
        sampling=trajs[0].sampling,
        episode_ids=[t.episode_id for t in trajs],
        token_versions=padded([t.token_versions for t in trajs], torch.long, fill=-1),
        token_turns=padded([t.turn_index for t in trajs], torch.long, fill=-1),
        routed_experts=routed_experts(trajs, T),
    )
    degenerate = int(torch.unique(gids[adv.degenerate]).numel())
    info = BatchInfo(groups=len(index), trajectories=B, degenerate_groups=degenerate, filtered_groups=0)
    if algo.filter_degenerate_groups and degenerate:
        keep = (~adv.degenerate).nonzero()[:, 0]
        if not len(keep):
            raise ValueError("every group had equal rewards: nothing to learn from this batch")
        batch, info.filtered_groups = batch.select(keep), degenerate
    return batch, info
