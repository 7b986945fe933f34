"""Policy losses: GSPO, GSPO-token and GRPO, written from docs/design.md §4.

Notation (shapes: B sequences, T tokens). For sequence i, T_i are its generated tokens
(`mask` = 1), lp_θ(t) = `logprobs` (the trainer's, carrying the gradient), lp_b(t) =
`old_logprobs` (by default the inference engine's, the probability the token was really
sampled with), A_{i,t} = `advantages` (per token, or one A_i per sequence).

- GSPO:       s_i = exp((1/|T_i|) Σ_{t∈T_i} (lp_θ(t) − lp_b(t)))
              J_i = min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i)
- GSPO-token: s_{i,t} = sg[s_i]·exp(lp_θ(t) − sg[lp_θ(t)])   (value s_i; gradient through lp_θ(t))
              J_i = (1/|T_i|) Σ_{t∈T_i} min(s_{i,t}·A_{i,t}, clip(s_{i,t}, 1−ε_low, 1+ε_high)·A_{i,t})
- GRPO:       w_{i,t} = exp(lp_θ(t) − lp_b(t)), clipped per token, J_i as for GSPO-token.

J = (1/B') Σ_i J_i over the B' sequences with at least one generated token: every sequence
weighs the same whatever its length. A token sum across the batch (which weights long
sequences more) is deliberately not offered. The loss to minimise is −J.

Each objective is one object owning its ratio, its clipping and what "clipped" means;
`policy_loss` only aggregates, adds the optional extras and reduces the metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

Mode = Literal["gspo", "gspo_token", "grpo"]


@dataclass
class _Terms:
    J_i: torch.Tensor  # (B,) each sequence's objective
    clipped: torch.Tensor  # (B,) share of the sequence's tokens whose clipped branch is taken (no gradient)
    ratio: torch.Tensor  # the ratios the clip acts on: (B,) at sequence level, (N,) the generated tokens at token level


class Objective(ABC):
    """One surrogate objective. Set `name`, `default_clip` and `level` in ALL subclasses.

    `level` is where its importance ratio lives ("sequence" or "token"); optional
    importance-sampling corrections are applied at the same level.
    """

    name: ClassVar[str]
    default_clip: ClassVar[tuple[float, float]]  # (ε_low, ε_high), the GSPO paper's values
    level: ClassVar[Literal["sequence", "token"]]
    sequence_advantage: ClassVar[bool] = False  # needs one A_i per sequence

    @abstractmethod
    def terms(self, lp: torch.Tensor, lp_b: torch.Tensor, A: torch.Tensor, mask: torch.Tensor,
              eps_low: float, eps_high: float, weight: torch.Tensor | None) -> _Terms:  # fmt: skip
        """lp, lp_b, A, mask: (B, T), float, masked positions zeroed; weight: optional IS weight
        at this objective's level, (B,) or (B, T), without gradient."""


def _clipped_branch(ratio: torch.Tensor, A: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """1 where min(r·A, clip(r)·A) takes the clipped term strictly: no gradient flows there."""
    return ((A > 0) & (ratio > 1 + eps_high)) | ((A < 0) & (ratio < 1 - eps_low))


def _surrogate(ratio: torch.Tensor, A: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    return torch.minimum(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B,): (1/|T_i|) Σ_{t∈T_i} x; 0 for a sequence without tokens."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _sequence_log_ratio(lp: torch.Tensor, lp_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = (1/|T_i|) Σ_{t∈T_i} (lp_θ(t) − lp_b(t)), (B,)."""
    return _token_mean(lp - lp_b, mask)


class GSPO(Objective):
    name = "gspo"
    default_clip = (3e-4, 4e-4)
    level = "sequence"
    sequence_advantage = True

    def terms(self, lp, lp_b, A, mask, eps_low, eps_high, weight):
        A_i = _token_mean(A, mask)  # A is constant along each sequence (checked by policy_loss)
        s_i = _sequence_log_ratio(lp, lp_b, mask).exp()  # (B,)
        J_i = _surrogate(s_i, A_i, eps_low, eps_high)
        if weight is not None:
            J_i = weight * J_i
        return _Terms(J_i, _clipped_branch(s_i, A_i, eps_low, eps_high).to(lp.dtype), s_i.detach())


class GSPOToken(Objective):
    name = "gspo_token"
    default_clip = (3e-4, 4e-4)
    level = "sequence"

    def terms(self, lp, lp_b, A, mask, eps_low, eps_high, weight):
        s_i = _sequence_log_ratio(lp, lp_b, mask).exp()  # (B,)
        s_it = s_i.detach()[:, None] * (lp - lp.detach()).exp()  # (B, T): value s_i, gradient of lp_θ(t)
        J_it = _surrogate(s_it, A, eps_low, eps_high)
        if weight is not None:
            J_it = weight[:, None] * J_it
        clipped = _clipped_branch(s_it.detach(), A, eps_low, eps_high).to(lp.dtype)
        return _Terms(_token_mean(J_it, mask), _token_mean(clipped, mask), s_i.detach())


class GRPO(Objective):
    name = "grpo"
    default_clip = (0.2, 0.27)
    level = "token"

    def terms(self, lp, lp_b, A, mask, eps_low, eps_high, weight):
        w_it = (lp - lp_b).exp()  # (B, T)
        J_it = _surrogate(w_it, A, eps_low, eps_high)
        if weight is not None:
            J_it = weight * J_it
        clipped = _clipped_branch(w_it.detach(), A, eps_low, eps_high).to(lp.dtype)
        return _Terms(_token_mean(J_it, mask), _token_mean(clipped, mask), w_it.detach()[mask.bool()])


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (GSPO(), GSPOToken(), GRPO())}


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    """exp(log_r) − log_r − 1 ≥ 0: with log_r = log p − log q on samples of q, an unbiased,
    low-variance estimate of KL(q ‖ p) (Schulman's k3)."""
    return log_r.exp() - log_r - 1


@dataclass
class _Inputs:
    """policy_loss's inputs checked and aligned: float (B, T) tensors, padding zeroed, A per token."""

    objective: Objective
    eps_low: float
    eps_high: float
    m: torch.Tensor  # the mask as floats
    on: torch.Tensor  # the mask as booleans
    lp: torch.Tensor
    lp_b: torch.Tensor
    A: torch.Tensor

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """Padding may hold anything (-inf): keep it out of exp and gradients."""
        return torch.where(self.on, x.to(self.m.dtype), torch.zeros((), dtype=self.m.dtype, device=x.device))

    @classmethod
    def of(cls, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
           mode: str, clip_low: float | None, clip_high: float | None) -> _Inputs:  # fmt: skip
        if mode not in OBJECTIVES:
            raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(OBJECTIVES)}")
        objective = OBJECTIVES[mode]
        eps_low = objective.default_clip[0] if clip_low is None else clip_low
        eps_high = objective.default_clip[1] if clip_high is None else clip_high
        if not (0 <= eps_low < 1 and eps_high >= 0):
            raise ValueError(f"clip bounds need 0 <= clip_low < 1 and clip_high >= 0, got {eps_low}, {eps_high}")
        if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
            raise ValueError(f"logprobs, old_logprobs and mask must all be (B, T); got {logprobs.shape}, "
                             f"{old_logprobs.shape}, {mask.shape}")  # fmt: skip
        # bf16 cannot resolve a ratio of 1 ± 4e-4 (its spacing above 1 is 2^-7): compute in fp32 at least
        m = mask.to(torch.promote_types(logprobs.dtype, torch.float32))
        x = cls(objective, eps_low, eps_high, m, m.bool(), logprobs, old_logprobs, advantages)
        x.lp, x.lp_b = x.masked(logprobs), x.masked(old_logprobs)
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(logprobs)
        if advantages.shape != logprobs.shape:
            raise ValueError(f"advantages must be (B,) or (B, T) = {tuple(logprobs.shape)}, "
                             f"got {tuple(advantages.shape)}")  # fmt: skip
        x.A = x.masked(advantages)
        if objective.sequence_advantage:
            first = x.A.gather(1, x.on.long().argmax(1, keepdim=True))  # each sequence's first generated token's A
            if (x.on & (first != x.A)).any():
                raise ValueError(
                    f"mode {mode!r} needs one advantage per sequence, but advantages vary within a sequence; "
                    "use mode 'gspo_token' for per-token (per-turn) advantages"
                )
        return x


def policy_loss(
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
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to minimise, −J (+ the optional KL penalty), and its metrics.

    logprobs (B, T): lp_θ, with gradient. old_logprobs (B, T): lp_b. mask (B, T): 1 on
    generated tokens. advantages: (B, T) per token (A_{i,t}), or (B,) per sequence (A_i).
    clip_low / clip_high: ε_low / ε_high, the mode's paper defaults when None (decoupled:
    set either alone, DAPO's "clip-higher" is clip_high > clip_low).

    Optional extras, off by default:
    - `ref_logprobs` and `kl_coef` β > 0: adds β·(1/B') Σ_i (1/|T_i|) Σ_t k3(lp_ref(t) − lp_θ(t)),
      a penalty on KL(π_θ ‖ π_ref) estimated on the sampled tokens.
    - `behaviour_logprobs` and `tis_cap` C: truncated importance sampling for engine/trainer
      mismatch, when `old_logprobs` were recomputed by the trainer and the tokens were sampled
      by an engine with log-probabilities lp_e. Each sequence's (GSPO modes) or token's (GRPO)
      objective is weighted by min(exp(lp_b − lp_e), C), taken at the objective's ratio level
      (the sequence's mean log-ratio for GSPO modes), without gradient.

    Metrics: clip_fraction (share of the objective's weight whose clipped branch is taken:
    sequences for GSPO, tokens for GSPO-token and GRPO, averaged per sequence), ratio_p05 /
    ratio_p50 / ratio_p95 (s_i per sequence, or w_{i,t} per token for GRPO), abs_logprob_diff
    (mean |lp_θ − lp_b| over generated tokens), seq_kl (k3 estimate of KL(π_b ‖ π_θ) per token,
    averaged per sequence then over sequences: the engine/trainer mismatch when lp_θ is scored
    before any update), sequences (B'); with the extras, kl_ref and tis_weight_mean.

    Computed in float32 at least whatever the inputs' dtype; the gradient reaches `logprobs` in its own.
    """
    if (ref_logprobs is None) != (kl_coef == 0):
        raise ValueError("the KL penalty needs both ref_logprobs and kl_coef > 0")
    if (behaviour_logprobs is None) != (tis_cap is None):
        raise ValueError("truncated importance sampling needs both behaviour_logprobs and tis_cap")
    x = _Inputs.of(logprobs, old_logprobs, advantages, mask, mode, clip_low, clip_high)
    objective, m, on, lp, lp_b, A, masked = x.objective, x.m, x.on, x.lp, x.lp_b, x.A, x.masked

    has_tokens = on.any(-1)  # (B,): sequences with nothing generated take no part
    n = int(has_tokens.sum())
    if n == 0:
        raise ValueError("no generated tokens in the batch (mask is all zero)")
    weight = None
    metrics: dict[str, float] = {}
    if behaviour_logprobs is not None:
        log_w = lp_b - masked(behaviour_logprobs)
        log_w = _token_mean(log_w, m) if objective.level == "sequence" else log_w
        weight = log_w.exp().clamp(max=tis_cap).detach()
        metrics["tis_weight_mean"] = float(weight[has_tokens].mean() if weight.dim() == 1 else weight[on].mean())
    terms = objective.terms(lp, lp_b, A, m, x.eps_low, x.eps_high, weight)
    J = terms.J_i[has_tokens].mean()
    loss = -J
    if ref_logprobs is not None:
        kl_ref = _token_mean(_k3(masked(ref_logprobs) - lp), m)[has_tokens].mean()
        loss = loss + kl_coef * kl_ref
        metrics["kl_ref"] = float(kl_ref.detach())

    with torch.no_grad():
        ratio = terms.ratio[has_tokens] if objective.level == "sequence" else terms.ratio
        q = torch.quantile(ratio.double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64, device=ratio.device))
        diff = (lp - lp_b).detach()
        metrics.update(
            clip_fraction=float(terms.clipped[has_tokens].mean()),
            ratio_p05=float(q[0]), ratio_p50=float(q[1]), ratio_p95=float(q[2]),
            abs_logprob_diff=float(diff.abs()[on].mean()),
            seq_kl=float(_token_mean(_k3(diff), m)[has_tokens].mean()),
            sequences=float(n),
        )  # fmt: skip
    return loss, metrics


def sequence_stats(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   *, mode: Mode, clip_low: float | None = None,
                   clip_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per sequence, what `policy_loss` saw (for inspecting one trajectory; no gradient):
    s_i = exp((1/|T_i|) Σ_t (lp_θ(t) − lp_b(t))), (B,), whatever the mode (for GRPO the geometric
    mean of its token ratios), and the share of its generated tokens whose clipped branch was taken
    (B,): 0 or 1 for GSPO, whose clip acts on the whole sequence."""
    with torch.no_grad():
        x = _Inputs.of(logprobs.detach(), old_logprobs, advantages, mask, mode, clip_low, clip_high)
        terms = x.objective.terms(x.lp, x.lp_b, x.A, x.m, x.eps_low, x.eps_high, None)
        return _sequence_log_ratio(x.lp, x.lp_b, x.m).exp(), terms.clipped
