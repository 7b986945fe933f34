"""Policy losses: GSPO, GSPO-token and GRPO, and the decoupled behaviour weight, written from docs/design.md §4.

Notation (shapes: B sequences, T tokens). For sequence i, T_i are its generated tokens
(`mask` = 1), lp_θ(t) = `logprobs` (the learner's, carrying the gradient), lp_prox(t) =
`old_logprobs` (the proximal policy the ratio is taken against: the engine's lp_b by default,
the learner's own before its first step on the batch when the objective is decoupled),
A_{i,t} = `advantages` (per token, or one A_i per sequence), w the behaviour weight (below).

- GSPO:       s_i = exp((1/|T_i|) Σ_{t∈T_i} (lp_θ(t) − lp_prox(t)))
              J_i = w_i · min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i)
- GSPO-token: s_{i,t} = sg[s_i]·exp(lp_θ(t) − sg[lp_θ(t)])   (value s_i; gradient through lp_θ(t))
              J_i = (1/|T_i|) Σ_{t∈T_i} w_{i,t} · min(s_{i,t}·A_{i,t}, clip(s_{i,t}, 1−ε_low, 1+ε_high)·A_{i,t})
- GRPO:       r_{i,t} = exp(lp_θ(t) − lp_prox(t)), clipped per token,
              J_i = (1/|T_i|) Σ_{t∈T_i} w_{i,t} · min(r_{i,t}·A_{i,t}, clip(r_{i,t}, 1−ε_low, 1+ε_high)·A_{i,t})

Behaviour weight (the decoupled objective, AReaL): with lp_b = `behaviour_logprobs`, the engine's
logprobs of tokens it sampled (under an older policy version, or with other numerics), ŵ is taken
per unit, at `behaviour_level`:
- "sequence": ŵ_i = exp((1/|T_i|) Σ_{t∈T_i} (lp_prox(t) − lp_b(t))), and every token term of
  sequence i takes its w: w_{i,t} = w_i;
- "token": ŵ_{i,t} = exp(lp_prox(t) − lp_b(t)), for GSPO-token and GRPO (GSPO's one term per
  sequence has no token to weigh: refused);
- "auto": the objective's own level, sequence for the GSPO modes, token for GRPO.
Then w = sg[min(ŵ, C)] ("truncate"), w = sg[ŵ·1(ŵ ≤ C)] ("mask") or w = sg[ŵ·1(1/C ≤ ŵ ≤ C)]
("band", IcePop's two-sided mask, C > 1). Without behaviour logprobs lp_prox is lp_b and w = 1:
the coupled objective, the same numbers exactly.

A token the sampling filter (top-k, top-p) drops has lp = −inf (`agentrl.engine.sampling`): one the engine
sampled at the filter's edge may lie outside the learner's. Its log-ratio lp_θ(t) − lp_prox(t) is taken as 0
where lp_prox(t) = −inf (decoupled: its behaviour weight exp(lp_prox − lp_b) is then 0, so is its term), and where
only lp_θ(t) = −inf it is −inf: s_i = 0 or r_{i,t} = 0, the limit, with no gradient. GSPO-token's
exp(lp_θ(t) − sg[lp_θ(t)]) is 1 there, and the KL term k3 of such a token 0 (π_θ never samples it): never
∞ − ∞ or 0·∞, whose NaN would reach every weight through the step.

J = (1/B') Σ_i J_i over the B' sequences with at least one generated token: every sequence
weighs the same whatever its length. A token sum across the batch (which weights long
sequences more) is deliberately not offered. With sequence weights ρ_i (an episode of K sequences gives each
1/K, so that it weighs as one sequence): J = Σ_i ρ_i J_i / Σ_i ρ_i over the same sequences. The loss to
minimise is −J.

Each objective is one object owning its ratio, its clipping and what "clipped" means;
`policy_objective` only aggregates, weighs, adds the optional extras and reduces the metrics, on the device (a
trainer reads them once per update); `policy_loss` is the same with its inputs' values checked and floats out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import torch

Mode = Literal["gspo", "gspo_token", "grpo"]
BehaviourWeight = Literal["none", "truncate", "mask", "band"]
BehaviourLevel = Literal["auto", "token", "sequence"]


@dataclass
class _Terms:
    J_i: torch.Tensor  # (B,) each sequence's objective
    clipped: torch.Tensor  # (B,) share of the sequence's tokens whose clipped branch is taken (no gradient)
    ratio: torch.Tensor  # the ratios the clip acts on: (B,) at sequence level, (B, T) at token level (no gradient)


class Objective(ABC):
    """One surrogate objective. Set `name`, `default_clip` and `level` in ALL subclasses.

    `level` is where its importance ratio lives ("sequence" or "token"); the behaviour weight
    is taken at the same level unless asked for at another.
    """

    name: ClassVar[str]
    default_clip: ClassVar[tuple[float, float]]  # (ε_low, ε_high), the GSPO paper's values
    level: ClassVar[Literal["sequence", "token"]]
    sequence_advantage: ClassVar[bool] = False  # needs one A_i per sequence
    token_weight: ClassVar[bool] = True  # has a term per token that a per-token behaviour weight can weigh

    @abstractmethod
    def terms(
        self,
        lp: torch.Tensor,
        lp_prox: torch.Tensor,
        A: torch.Tensor,
        mask: torch.Tensor,
        eps_low: float,
        eps_high: float,
        weight: torch.Tensor | None,
    ) -> _Terms:
        """lp, lp_prox, A, mask: (B, T), float, masked positions zeroed; weight: the behaviour weight w
        without gradient, (B,) per sequence or (B, T) per token (only if `token_weight`); None: w = 1."""


def _per_token(weight: torch.Tensor) -> torch.Tensor:
    """A behaviour weight as a factor of (B, T) token terms: w_{i,t}, or w_i on every token of sequence i."""
    return weight[:, None] if weight.dim() == 1 else weight


def _clipped_branch(ratio: torch.Tensor, A: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """1 where min(r·A, clip(r)·A) takes the clipped term strictly: no gradient flows there."""
    return ((A > 0) & (ratio > 1 + eps_high)) | ((A < 0) & (ratio < 1 - eps_low))


def _surrogate(ratio: torch.Tensor, A: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    return torch.minimum(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B,): (1/|T_i|) Σ_{t∈T_i} x; 0 for a sequence without tokens."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _log_ratio(lp: torch.Tensor, lp_prox: torch.Tensor) -> torch.Tensor:
    """lp_θ(t) − lp_prox(t), 0 where lp_prox(t) = −inf (module docstring: filtered tokens)."""
    return torch.where(lp_prox == -torch.inf, 0.0, lp - lp_prox)


def _sequence_log_ratio(lp: torch.Tensor, lp_prox: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = (1/|T_i|) Σ_{t∈T_i} (lp_θ(t) − lp_prox(t)), (B,)."""
    return _token_mean(_log_ratio(lp, lp_prox), mask)


class GSPO(Objective):
    name = "gspo"
    default_clip = (3e-4, 4e-4)
    level = "sequence"
    sequence_advantage = True
    token_weight = False  # one term per sequence: no token term to weigh

    def terms(self, lp, lp_prox, A, mask, eps_low, eps_high, weight):
        A_i = _token_mean(A, mask)  # A is constant along each sequence (checked by policy_loss)
        s_i = _sequence_log_ratio(lp, lp_prox, mask).exp()  # (B,)
        J_i = _surrogate(s_i, A_i, eps_low, eps_high)
        if weight is not None:
            J_i = weight * J_i
        return _Terms(J_i, _clipped_branch(s_i, A_i, eps_low, eps_high).to(lp.dtype), s_i.detach())


class GSPOToken(Objective):
    name = "gspo_token"
    default_clip = (3e-4, 4e-4)
    level = "sequence"

    def terms(self, lp, lp_prox, A, mask, eps_low, eps_high, weight):
        s_i = _sequence_log_ratio(lp, lp_prox, mask).exp()  # (B,)
        own = torch.where(lp == -torch.inf, 0.0, lp - lp.detach())  # −inf − (−inf) would be NaN
        s_it = s_i.detach()[:, None] * own.exp()  # (B, T): value s_i, gradient of lp_θ(t)
        J_it = _surrogate(s_it, A, eps_low, eps_high)
        if weight is not None:
            J_it = _per_token(weight) * J_it
        clipped = _clipped_branch(s_it.detach(), A, eps_low, eps_high).to(lp.dtype)
        return _Terms(_token_mean(J_it, mask), _token_mean(clipped, mask), s_i.detach())


class GRPO(Objective):
    name = "grpo"
    default_clip = (0.2, 0.27)
    level = "token"

    def terms(self, lp, lp_prox, A, mask, eps_low, eps_high, weight):
        r_it = _log_ratio(lp, lp_prox).exp()  # (B, T)
        J_it = _surrogate(r_it, A, eps_low, eps_high)
        if weight is not None:
            J_it = _per_token(weight) * J_it
        clipped = _clipped_branch(r_it.detach(), A, eps_low, eps_high).to(lp.dtype)
        return _Terms(_token_mean(J_it, mask), _token_mean(clipped, mask), r_it.detach())


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (GSPO(), GSPOToken(), GRPO())}


# per kind, the metric of the share of units the cap acted on (truncated, or set to 0)
_CAPPED_METRIC = {
    "truncate": "behaviour_truncated_fraction",
    "mask": "behaviour_masked_fraction",
    "band": "behaviour_band_masked_fraction",
}


def _behaviour_weights(
    lp_prox: torch.Tensor,
    lp_b: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: Literal["sequence", "token"],
    kind: Literal["truncate", "mask", "band"],
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ŵ, w, capped) without gradient, (B,) at sequence level or (B, T) at token level (ŵ = 1 off the
    mask): ŵ = exp(lp_prox − lp_b), of the sequence's mean log-ratio at sequence level, per token at
    token level; w = min(ŵ, C) ("truncate"), ŵ·1(ŵ ≤ C) ("mask") or ŵ·1(1/C ≤ ŵ ≤ C) ("band"); capped:
    where the cap acted (ŵ > C, or ŵ outside [1/C, C] for "band"). lp_prox, lp_b, mask: (B, T), masked
    positions zeroed."""
    log_w = (lp_prox - lp_b).detach()
    raw = (_token_mean(log_w, mask) if level == "sequence" else log_w).exp()
    capped = raw > cap
    if kind == "truncate":
        return raw, raw.clamp(max=cap), capped
    if kind == "band":
        capped = capped | (raw < 1 / cap)
    return raw, torch.where(capped, torch.zeros_like(raw), raw), capped


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    """exp(log_r) − log_r − 1 ≥ 0: with log_r = log p − log q on samples of q, an unbiased,
    low-variance estimate of KL(q ‖ p) (Schulman's k3)."""
    return log_r.exp() - log_r - 1


@dataclass(frozen=True)
class Mean:
    """A metric's mean as its parts, Σ x over `count` units (0-dim tensors): the means of several parts of a batch
    (micro-batches, ranks) then pool exactly, Σ total / Σ count, whatever the split."""

    total: torch.Tensor
    count: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, keep: torch.Tensor, weight: torch.Tensor | None = None) -> Mean:
        """The mean of x where `keep` (the same shape), each value weighing `weight` (default 1), in float64."""
        w = keep.double() if weight is None else torch.where(keep, weight.double(), 0.0)
        return cls((w * torch.where(keep, x.double(), 0.0)).sum(), w.sum())

    @property
    def value(self) -> torch.Tensor:
        return self.total / self.count


@dataclass(frozen=True)
class Sample:
    """A metric's values, x where `keep` (the same shape): reported as quantiles (`quantiles`), taken once over
    every part's values (a mean of the parts' quantiles is not the whole's)."""

    values: torch.Tensor
    keep: torch.Tensor


QUANTILES = (0.05, 0.5, 0.95)


def quantile_keys(name: str) -> list[str]:
    """The keys a Sample's metric `name` is reported under: name_p05, name_p50 and name_p95 (QUANTILES)."""
    return [f"{name}_p{round(100 * q):02d}" for q in QUANTILES]


def quantiles(name: str, sample: Sample) -> dict[str, torch.Tensor]:
    """{name_p05, name_p50, name_p95} of the kept values, as torch.quantile's linear interpolation computes them,
    without reading anything back to the host: the kept values sorted first (the others set to +inf), the
    q-quantile at position q·(n − 1) of them, n = Σ keep ≥ 1."""
    x, keep = sample.values, sample.keep
    v = torch.where(keep, x.double(), torch.inf).flatten().sort().values
    q = torch.tensor(QUANTILES, dtype=torch.float64, device=x.device)
    position = q * (keep.sum() - 1)
    below, above = position.floor().long(), position.ceil().long()
    value = torch.lerp(v[below], v[above], position - below)
    return dict(zip(quantile_keys(name), value, strict=True))


@dataclass
class _Inputs:
    """policy_loss's inputs checked and aligned: float (B, T) tensors, padding zeroed, A per token."""

    objective: Objective
    eps_low: float
    eps_high: float
    m: torch.Tensor  # the mask as floats
    on: torch.Tensor  # the mask as booleans
    lp: torch.Tensor
    lp_prox: torch.Tensor
    A: torch.Tensor

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """Padding may hold anything (-inf): keep it out of exp and gradients."""
        return torch.where(self.on, x.to(self.m.dtype), torch.zeros((), dtype=self.m.dtype, device=x.device))

    @classmethod
    def of(
        cls,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        mode: str,
        clip_low: float | None,
        clip_high: float | None,
    ) -> _Inputs:
        if mode not in OBJECTIVES:
            raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(OBJECTIVES)}")
        objective = OBJECTIVES[mode]
        eps_low = objective.default_clip[0] if clip_low is None else clip_low
        eps_high = objective.default_clip[1] if clip_high is None else clip_high
        if not (0 <= eps_low < 1 and eps_high >= 0):
            raise ValueError(f"clip bounds need 0 <= clip_low < 1 and clip_high >= 0, got {eps_low}, {eps_high}")
        if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
            raise ValueError(
                f"logprobs, old_logprobs and mask must all be (B, T); got {logprobs.shape}, "
                f"{old_logprobs.shape}, {mask.shape}"
            )
        # bf16 cannot resolve a ratio of 1 ± 4e-4 (its spacing above 1 is 2^-7): compute in fp32 at least
        m = mask.to(torch.promote_types(logprobs.dtype, torch.float32))
        x = cls(objective, eps_low, eps_high, m, m.bool(), logprobs, old_logprobs, advantages)
        x.lp, x.lp_prox = x.masked(logprobs), x.masked(old_logprobs)
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(logprobs)
        if advantages.shape != logprobs.shape:
            raise ValueError(
                f"advantages must be (B,) or (B, T) = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
            )
        x.A = x.masked(advantages)
        return x


def check_values(
    advantages: torch.Tensor, mask: torch.Tensor, *, mode: Mode, sequence_weights: torch.Tensor | None = None
) -> None:
    """What `policy_objective` takes as given about its inputs' values, checked (reading them back to the host):
    some generated token, one advantage per sequence for GSPO, sequence weights (B,) > 0. `policy_loss` checks
    every call; a trainer checks its batch once and calls `policy_objective` per minibatch."""
    on = mask.bool()
    if not on.any():
        raise ValueError("no generated tokens in the batch (mask is all zero)")
    if mode in OBJECTIVES and OBJECTIVES[mode].sequence_advantage:
        A = advantages[:, None].expand_as(mask) if advantages.dim() == 1 else advantages
        first = A.gather(1, on.long().argmax(1, keepdim=True))  # each sequence's first generated token's A
        if (on & (first != A)).any():
            raise ValueError(
                f"mode {mode!r} needs one advantage per sequence, but advantages vary within a sequence; "
                "use mode 'gspo_token' for per-token (per-turn) advantages"
            )
    if sequence_weights is not None and (sequence_weights.shape != mask.shape[:1] or (sequence_weights <= 0).any()):
        raise ValueError(f"sequence_weights must be (B,) = ({len(mask)},) and > 0, got {sequence_weights}")


def policy_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: Mode,
    clip_low: float | None = None,
    clip_high: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    behaviour_logprobs: torch.Tensor | None = None,
    behaviour_weight: BehaviourWeight = "none",
    behaviour_cap: float | None = None,
    behaviour_level: BehaviourLevel = "auto",
    sequence_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to minimise, −J (+ the optional KL penalty), and its metrics, computed without reading a value back
    to the host (no synchronisation with a GPU): the inputs' values are taken as `check_values` checks them;
    `policy_loss` checks them and returns floats. A mean metric is a `Mean` (its sum and count), one reported as
    quantiles a `Sample` (its values), so that a trainer pools the parts of a minibatch exactly (`metric_values`
    gives one call's as 0-dim tensors).

    logprobs (B, T): lp_θ, with gradient. old_logprobs (B, T): lp_prox, the ratio's reference (the
    engine's lp_b unless decoupled). mask (B, T): 1 on generated tokens. advantages: (B, T) per token
    (A_{i,t}), or (B,) per sequence (A_i). clip_low / clip_high: ε_low / ε_high, the mode's paper
    defaults when None (decoupled: set either alone, DAPO's "clip-higher" is clip_high > clip_low).

    Optional extras, off by default:
    - `ref_logprobs` and `kl_coef` β > 0: adds β·(1/B') Σ_i (1/|T_i|) Σ_t k3(lp_ref(t) − lp_θ(t)),
      a penalty on KL(π_θ ‖ π_ref) estimated on the sampled tokens.
    - `behaviour_logprobs` lp_b, `behaviour_weight` "truncate", "mask" or "band" and `behaviour_cap` C > 0
      (> 1 for "band"): the decoupled objective, each unit's term weighted by the behaviour weight w
      (module docstring), for tokens sampled by a policy other than lp_prox's. `behaviour_level`: the
      unit, "auto" (the objective's own: sequences for the GSPO modes, tokens for GRPO), "sequence" or
      "token" (not for GSPO, whose one term per sequence has no token to weigh).

    Metrics: clip_fraction (share of the objective's weight whose clipped branch is taken:
    sequences for GSPO, tokens for GSPO-token and GRPO, averaged per sequence), ratio (a Sample: s_i per
    sequence, or r_{i,t} per token for GRPO; ratio_p05 / _p50 / _p95), abs_logprob_diff
    (mean |lp_θ − lp_prox| over generated tokens), seq_kl (k3 estimate of KL(π_prox ‖ π_θ) per token,
    averaged per sequence then over sequences: the engine/trainer mismatch when lp_θ is scored
    before any update against the engine's lp_b), sequences (B', a 0-dim tensor); with the KL penalty kl_ref
    (ρ-weighted over sequences); with a behaviour weight, over its units (sequences with tokens, or generated
    tokens): behaviour_weight (a Sample of ŵ, before the cap) and behaviour_truncated_fraction or
    behaviour_masked_fraction (the share whose ŵ exceeded C), or behaviour_band_masked_fraction (the share
    outside [1/C, C]).

    Computed in float32 at least whatever the inputs' dtype; the gradient reaches `logprobs` in its own.
    """
    if (ref_logprobs is None) != (kl_coef == 0):
        raise ValueError("the KL penalty needs both ref_logprobs and kl_coef > 0")
    if behaviour_weight not in (kinds := get_args(BehaviourWeight)):
        raise ValueError(f"unknown behaviour_weight {behaviour_weight!r}; valid: {', '.join(kinds)}")
    if behaviour_level not in (levels := get_args(BehaviourLevel)):
        raise ValueError(f"unknown behaviour_level {behaviour_level!r}; valid: {', '.join(levels)}")
    weighted = behaviour_weight != "none"
    if (behaviour_logprobs is not None) != weighted or (behaviour_cap is not None) != weighted:
        raise ValueError(
            "behaviour_weight 'truncate', 'mask' or 'band' needs both behaviour_logprobs and "
            "behaviour_cap; 'none' takes neither"
        )
    if not weighted and behaviour_level != "auto":
        raise ValueError(f"behaviour_level {behaviour_level!r} needs a behaviour_weight other than 'none'")
    if behaviour_cap is not None and not behaviour_cap > (1 if behaviour_weight == "band" else 0):
        raise ValueError(f"behaviour_cap must be > 0 (> 1 for 'band', whose band is [1/C, C]), got {behaviour_cap}")
    x = _Inputs.of(logprobs, old_logprobs, advantages, mask, mode, clip_low, clip_high)
    objective, m, on, lp, lp_prox, A, masked = x.objective, x.m, x.on, x.lp, x.lp_prox, x.A, x.masked
    if sequence_weights is not None and sequence_weights.shape != m.shape[:1]:
        raise ValueError(f"sequence_weights must be (B,) = ({len(m)},), got {tuple(sequence_weights.shape)}")

    has_tokens = on.any(-1)  # (B,): sequences with nothing generated take no part
    rho = has_tokens.to(m.dtype)  # ρ_i, 0 for those
    if sequence_weights is not None:
        rho = rho * sequence_weights.to(m.dtype)

    def mean(x: torch.Tensor) -> torch.Tensor:  # Σ ρ_i x_i / Σ ρ_i over the sequences with tokens
        return torch.where(has_tokens, rho * x, 0.0).sum() / rho.sum()

    weight = None
    metrics: dict[str, Mean | Sample | torch.Tensor] = {}
    if weighted:
        level = objective.level if behaviour_level == "auto" else behaviour_level
        if level == "token" and not objective.token_weight:
            raise ValueError(
                f"mode {mode!r} has one term per sequence: a per-token behaviour weight has no "
                "token term to weigh; use behaviour_level 'sequence' (or 'auto'), or mode 'gspo_token'"
            )
        raw, weight, capped = _behaviour_weights(
            lp_prox, masked(behaviour_logprobs), m, level=level, kind=behaviour_weight, cap=behaviour_cap
        )
        units = has_tokens if level == "sequence" else on
        metrics["behaviour_weight"] = Sample(raw.detach(), units)
        metrics[_CAPPED_METRIC[behaviour_weight]] = Mean.of(capped, units)

    terms = objective.terms(lp, lp_prox, A, m, x.eps_low, x.eps_high, weight)
    J = mean(terms.J_i)
    loss = -J
    if ref_logprobs is not None:
        log_r = torch.where(lp == -torch.inf, 0.0, masked(ref_logprobs) - lp)  # filtered: k3(0) = 0, not ∞ − ∞
        per_sequence = _token_mean(_k3(log_r), m)
        loss = loss + kl_coef * mean(per_sequence)
        metrics["kl_ref"] = Mean.of(per_sequence.detach(), has_tokens, rho)

    with torch.no_grad():
        diff = _log_ratio(lp, lp_prox).detach()
        metrics.update(
            clip_fraction=Mean.of(terms.clipped, has_tokens),
            ratio=Sample(terms.ratio.detach(), has_tokens if objective.level == "sequence" else on),
            abs_logprob_diff=Mean.of(diff.abs(), on),
            seq_kl=Mean.of(_token_mean(_k3(diff), m), has_tokens),
            sequences=has_tokens.sum().double(),
        )
    return loss, metrics


def metric_values(metrics: dict[str, Mean | Sample | torch.Tensor]) -> dict[str, torch.Tensor]:
    """`policy_objective`'s metrics as 0-dim tensors: a Mean's value, a Sample's `quantiles`."""
    out: dict[str, torch.Tensor] = {}
    for k, v in metrics.items():
        if isinstance(v, Sample):
            out |= quantiles(k, v)
        else:
            out[k] = v.value if isinstance(v, Mean) else v
    return out


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: Mode,
    sequence_weights: torch.Tensor | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_objective` with its inputs' values checked (`check_values`), its metrics as floats."""
    loss, metrics = policy_objective(
        logprobs, old_logprobs, advantages, mask, mode=mode, sequence_weights=sequence_weights, **options
    )  # its arguments and shapes checked first
    check_values(advantages, mask, mode=mode, sequence_weights=sequence_weights)
    return loss, {k: float(v) for k, v in metric_values(metrics).items()}


def sequence_stats(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: Mode,
    clip_low: float | None = None,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, what `policy_loss` saw (for inspecting one trajectory; no gradient):
    s_i = exp((1/|T_i|) Σ_t (lp_θ(t) − lp_prox(t))), (B,), whatever the mode (for GRPO the geometric
    mean of its token ratios), and the share of its generated tokens whose clipped branch was taken
    (B,): 0 or 1 for GSPO, whose clip acts on the whole sequence."""
    with torch.no_grad():
        x = _Inputs.of(logprobs.detach(), old_logprobs, advantages, mask, mode, clip_low, clip_high)
        terms = x.objective.terms(x.lp, x.lp_prox, x.A, x.m, x.eps_low, x.eps_high, None)
        return _sequence_log_ratio(x.lp, x.lp_prox, x.m).exp(), terms.clipped
