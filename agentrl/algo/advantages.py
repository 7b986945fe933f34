"""Advantage estimators: group-normalised, per sequence ("outcome"), per turn ("turn"), or both
levels at once ("gigpo": an episode term plus a term per anchor state).

Shapes: N trajectories, K turns (padded), T tokens. `groups` (N,) holds each trajectory's
group index (the G samples of one task share it). Only trainable trajectories go in:
failed or dropped ones are left out before, so they neither get an advantage nor move
their group's baseline. Rewards must be finite on real entries (padding turns may hold anything):
one NaN or inf would make every advantage of its group NaN, and the update's weights with them,
so it is refused.

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


def _check_finite(name: str, x: torch.Tensor, real: torch.Tensor) -> None:
    """Refuse a NaN or inf among the real entries of x, naming the first one's index."""
    bad = real.bool() & ~torch.isfinite(x)
    if bad.any():
        at = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name} must be finite, got {x[at].item()} at {at}: it would make its group's advantages NaN")


def _normalise_by_id(
    xs: torch.Tensor, ids: torch.Tensor, n_ids: int, scale: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x − mean_j) / (std_j + eps) over the entries of xs sharing id j, std the population one
    (scale=False: x − mean_j only). xs, ids: (M,), ids in [0, n_ids). Returns it (M,) (0 where the
    id's values are all equal, a lone entry included), (n_ids,) degenerate: the id's values are all
    equal (or it has none), and (n_ids,) the number of entries with each id."""
    zeros = torch.zeros(n_ids, dtype=xs.dtype, device=xs.device)
    count = zeros.index_add(0, ids, torch.ones_like(xs))
    mean = zeros.index_add(0, ids, xs) / count.clamp(min=1)
    std = (zeros.index_add(0, ids, (xs - mean[ids]) ** 2) / count.clamp(min=1)).sqrt()
    hi = zeros.scatter_reduce(0, ids, xs, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, ids, xs, "amin", include_self=False)
    flat = (xs - mean[ids]) / (std[ids] + eps) if scale else xs - mean[ids]
    flat = torch.where(hi[ids] == lo[ids], torch.zeros_like(flat), flat)
    return flat, hi == lo, count.long()


def _group_normalise(
    x: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, scale: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x − mean_g) / (std_g + eps) over the valid entries of each group g, std the population one
    (scale=False: x − mean_g only, as Dr. GRPO). x, valid: (N,) or (N, K). Returns it (0 where
    invalid) and (N,) degenerate: the group's valid values are all equal."""
    g = groups.reshape((-1,) + (1,) * (x.dim() - 1)).expand_as(x)[valid]  # each valid entry's group
    flat, degenerate, _ = _normalise_by_id(x[valid], g, int(groups.max()) + 1, scale, eps)
    out = torch.zeros_like(x)
    out[valid] = flat
    return out, degenerate[groups]


def outcome_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, *, scale: bool = True, eps: float = 1e-6
) -> Advantages:
    """A_i = (R_i − mean_g R) / (std_g R + eps): one value per trajectory, given to all its tokens.

    rewards (N,): each trajectory's outcome reward R_i.
    """
    real = torch.ones_like(rewards, dtype=torch.bool)
    _check_finite("rewards", rewards, real)
    values, degenerate = _group_normalise(rewards, groups, real, scale, eps)
    return Advantages(values, degenerate)


def returns_to_go(turn_rewards: torch.Tensor, turn_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_{i,k} = Σ_{k' ≥ k} γ^{k'−k} r_{i,k'} over the trajectory's real turns; (N, K) -> (N, K)."""
    r = torch.where(turn_mask.bool(), turn_rewards, 0)  # not r · mask: inf · 0 on a padding turn is NaN
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
    _check_finite("turn_rewards", turn_rewards, mask)
    values, degenerate = _group_normalise(
        returns_to_go(turn_rewards, turn_mask.to(turn_rewards.dtype), gamma), groups, mask, scale, eps
    )
    return Advantages(values, degenerate)


@dataclass
class GiGPOAdvantages(Advantages):
    """`values` (N, K): A_{i,k} = A^E_i + ω · A^S_{i,k} on real turns, 0 on padding turns;
    `degenerate` (N,): every real turn of the trajectory's group has A = 0 (no signal)."""

    episode: torch.Tensor
    """(N,) A^E_i, the episode-level term (`outcome_advantages` of the episode returns)"""
    step: torch.Tensor
    """(N, K) A^S_{i,k}, the step-level term before ω (0 on padding turns and lone step groups)"""
    step_groups: torch.Tensor
    """(N, K) long: the size of each real turn's step group (1: a state no other turn of its group
    acted in), 0 on padding turns"""
    shared_steps: float
    """the share of real turns in a step group of more than one turn (0: GiGPO is GRPO's episode term)"""


def _is_integer(x: torch.Tensor) -> bool:
    return not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)


def gigpo_advantages(
    turn_rewards: torch.Tensor,
    turn_mask: torch.Tensor,
    step_keys: torch.Tensor,
    groups: torch.Tensor,
    *,
    gamma: float = 1.0,
    omega: float = 1.0,
    scale: bool = True,
    eps: float = 1e-6,
) -> GiGPOAdvantages:
    """GiGPO (Feng et al. 2025, arXiv 2505.10978): A_{i,k} = A^E_i + ω · A^S_{i,k}, every token of
    turn k gets A_{i,k}.

    turn_rewards (N, K): r_{i,k}; turn_mask (N, K): 1 on real turns; step_keys (N, K) integer: the
    anchor state turn k acted in, as a dense id (equal ids = the same environment state; anything
    on padding turns); groups (N,): each trajectory's episode group g (the G rollouts of one task).

    Episode level, as GRPO on the episode return R_i = Σ_k r_{i,k} (exactly `outcome_advantages`):

        A^E_i = (R_i − mean_{j∈g} R_j) / F_norm,    F_norm = std_{j∈g} R_j + eps  (scale=False: 1)

    Step level: the discounted return from turn k, R^γ_{i,k} = Σ_{k'≥k} γ^{k'−k} r_{i,k'}
    (`returns_to_go`), is compared within its step group S_{i,k} = {(i', k') real : g(i') = g(i),
    key_{i',k'} = key_{i,k}}: every real turn of the same episode group that acted in the same
    anchor state, across the group's trajectories and repeated visits within one:

        A^S_{i,k} = (R^γ_{i,k} − mean_{S_{i,k}} R^γ) / F_norm,    F_norm = std_{S_{i,k}} R^γ + eps  (or 1)

    Standard deviations are the population ones. A group (episode or step) whose values are all
    equal, a lone member included, gets 0. With all keys distinct (or ω = 0) this is the episode
    term alone. A trajectory with no real turn has R_i = 0 and still counts in its group's baseline.
    """
    if turn_rewards.dim() != 2:
        raise ValueError(f"turn_rewards must be (N, K), got shape {tuple(turn_rewards.shape)}")
    N, K = turn_rewards.shape
    if N == 0 or K == 0:
        raise ValueError(f"turn_rewards must have at least one trajectory and one turn, got shape {(N, K)}")
    for name, t in (("turn_mask", turn_mask), ("step_keys", step_keys)):
        if t.shape != turn_rewards.shape:
            raise ValueError(f"{name} must have turn_rewards' shape {(N, K)}, got {tuple(t.shape)}")
    if groups.shape != (N,):
        raise ValueError(f"groups must be (N,) = {(N,)}, one group index per trajectory, got {tuple(groups.shape)}")
    for name, t in (("step_keys", step_keys), ("groups", groups)):
        if not _is_integer(t):
            raise ValueError(f"{name} must hold integer ids, got dtype {t.dtype}")

    mask = turn_mask.bool()
    _check_finite("turn_rewards", turn_rewards, mask)
    m = mask.to(turn_rewards.dtype)
    groups = groups.long()

    # episode level: one value per trajectory, broadcast to its real turns
    episode, _ = _group_normalise(
        torch.where(mask, turn_rewards, 0).sum(1),
        groups,
        torch.ones(N, dtype=torch.bool, device=groups.device),
        scale,
        eps,
    )

    # step level: a dense id per (episode group, anchor state) pair of the real turns
    pairs = torch.stack([groups[:, None].expand(N, K)[mask], step_keys.long()[mask]])
    uniq, sid = torch.unique(pairs, dim=1, return_inverse=True)
    flat, _, size = _normalise_by_id(returns_to_go(turn_rewards, m, gamma)[mask], sid, uniq.shape[1], scale, eps)
    step = torch.zeros_like(turn_rewards)
    step[mask] = flat
    step_groups = torch.zeros_like(step_keys, dtype=torch.long)
    step_groups[mask] = size[sid]

    values = (episode[:, None] + omega * step) * m
    signal = torch.zeros(int(groups.max()) + 1, dtype=torch.long, device=groups.device)
    signal = signal.index_add(0, groups, (values != 0).any(1).long())
    shared = float((size[sid] > 1).float().mean()) if sid.numel() else 0.0
    return GiGPOAdvantages(values, (signal == 0)[groups], episode, step, step_groups, shared)


def per_token(turn_values: torch.Tensor, token_turn: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-turn values (N, K) to tokens (N, T) by each token's turn index; 0 off the loss mask."""
    idx = token_turn.clamp(min=0, max=turn_values.shape[1] - 1).long()
    return turn_values.gather(1, idx) * loss_mask.to(turn_values.dtype)
