"""Advantage estimators: group-normalised, per sequence ("outcome") or per turn ("turn").

Shapes: N trajectories, K turns (padded), T tokens. `groups` (N,) holds each trajectory's
group index (the G samples of one task share it). Only trainable trajectories go in:
failed or dropped ones are left out before, so they neither get an advantage nor move
their group's baseline.

A group whose values are all equal carries no signal: every member gets A = 0 and the group
is reported in `degenerate`, so the trainer can count it or drop it (dynamic sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Advantages:
    values: torch.Tensor
    """(N,) per trajectory ("outcome") or (N, K) per turn ("turn", 0 on padding turns)"""
    degenerate: torch.Tensor
    """(N,) bool: the trajectory's group had all-equal values, so its advantages are 0"""


def _group_normalise(
    x: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, scale: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x − mean_g) / (std_g + eps) over the valid entries of each group g, std the population one
    (scale=False: x − mean_g only, as Dr. GRPO). x, valid: (N,) or (N, K). Returns it (0 where
    invalid) and (N,) degenerate: the group's valid values are all equal."""
    g = groups.reshape((-1,) + (1,) * (x.dim() - 1)).expand_as(x)[valid]  # each valid entry's group
    xs = x[valid]
    G = int(groups.max()) + 1
    zeros = torch.zeros(G, dtype=x.dtype, device=x.device)
    count = zeros.index_add(0, g, torch.ones_like(xs)).clamp(min=1)
    mean = zeros.index_add(0, g, xs) / count
    std = (zeros.index_add(0, g, (xs - mean[g]) ** 2) / count).sqrt()
    hi = zeros.scatter_reduce(0, g, xs, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, g, xs, "amin", include_self=False)
    flat = (xs - mean[g]) / (std[g] + eps) if scale else xs - mean[g]
    flat = torch.where(hi[g] == lo[g], torch.zeros_like(flat), flat)
    out = torch.zeros_like(x)
    out[valid] = flat
    return out, (hi == lo)[groups]


def outcome_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, *, scale: bool = True, eps: float = 1e-6
) -> Advantages:
    """A_i = (R_i − mean_g R) / (std_g R + eps): one value per trajectory, given to all its tokens.

    rewards (N,): each trajectory's outcome reward R_i.
    """
    values, degenerate = _group_normalise(rewards, groups, torch.ones_like(rewards, dtype=torch.bool), scale, eps)
    return Advantages(values, degenerate)


def returns_to_go(turn_rewards: torch.Tensor, turn_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_{i,k} = Σ_{k' ≥ k} γ^{k'−k} r_{i,k'} over the trajectory's real turns; (N, K) -> (N, K)."""
    r = turn_rewards * turn_mask
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for k in reversed(range(r.shape[1])):
        running = r[:, k] + gamma * running
        out[:, k] = running
    return out * turn_mask


def turn_advantages(
    turn_rewards: torch.Tensor,
    turn_mask: torch.Tensor,
    groups: torch.Tensor,
    *,
    gamma: float = 1.0,
    scale: bool = True,
    eps: float = 1e-6,
) -> Advantages:
    """Per-turn advantages: A_{i,k} = (G_{i,k} − μ_g) / (σ_g + eps), every token of turn k gets A_{i,k}.

    turn_rewards (N, K): r_{i,k}, the env's reward for turn k (the outcome is part of the last
    turn's reward: the env pays it on the step that ends the episode); turn_mask (N, K): 1 on
    real turns. G_{i,k} is the discounted return-to-go from turn k (`returns_to_go`).

    Groups whose members took different numbers of turns: μ_g and σ_g are the mean and
    (population) standard deviation over every real turn of every member of group g, each
    turn counted once. No padding turns are invented, and no turn index is compared only
    with the same index of the others (late indices would have one member, hence no
    signal); a member with more turns weighs more in its group's baseline. With one turn
    per trajectory this is exactly `outcome_advantages`.
    """
    mask = turn_mask.bool()
    values, degenerate = _group_normalise(
        returns_to_go(turn_rewards, turn_mask.to(turn_rewards.dtype), gamma), groups, mask, scale, eps
    )
    return Advantages(values, degenerate)


def per_token(turn_values: torch.Tensor, token_turn: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-turn values (N, K) to tokens (N, T) by each token's turn index; 0 off the loss mask."""
    idx = token_turn.clamp(min=0, max=turn_values.shape[1] - 1).long()
    return turn_values.gather(1, idx) * loss_mask.to(turn_values.dtype)
