"""policy_loss against a direct, unvectorised transcription of docs/design.md §4 (float64)."""

import math

import pytest
import torch

from agentrl.algo import OBJECTIVES, policy_loss

B, T = 7, 12


def batch(seed: int, noise: float):
    """Random logprobs with ragged masks: a prompt prefix, generated tokens, padding; one empty row."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp_b = lp + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i in range(B - 1):
        start = int(torch.randint(0, 4, (1,), generator=g))
        end = int(torch.randint(start + 1, T + 1, (1,), generator=g))
        mask[i, start:end] = 1
    lp = torch.where(mask.bool(), lp, torch.tensor(-math.inf))  # padding may hold anything
    A_tok = torch.randn(B, T, generator=g, dtype=torch.float64)
    A_seq = torch.randn(B, generator=g, dtype=torch.float64)
    return lp, lp_b, mask, A_tok, A_seq


def own_level(mode, level="auto"):
    """The behaviour weight's unit: `level`, or under "auto" the objective's own (sequence for the GSPO modes)."""
    return ("token" if mode == "grpo" else "sequence") if level == "auto" else level


def reference(lp, lp_prox, A, mask, mode, eps_low, eps_high, lp_b=None, kind=None, cap=None, level="auto"):
    """docs/design.md §4, one sequence and one token at a time; A is (B, T). With the engine's lp_b, each unit's
    term is weighted by the behaviour weight: ŵ = exp(lp_prox − lp_b) per sequence (of its mean log-ratio, w_i
    on every token term of the sequence) or per token (`level`), truncated at cap (kind "truncate"), 0 above it
    ("mask") or 0 outside [1/cap, cap] ("band")."""
    level = own_level(mode, level)

    def clip(x):
        return x.clamp(1 - eps_low, 1 + eps_high)

    def w(log_w):
        raw = math.exp(float(log_w))
        if kind == "truncate":
            return min(raw, cap)
        if kind == "mask":
            return 0.0 if raw > cap else raw
        assert kind == "band"
        return raw if 1 / cap <= raw <= cap else 0.0

    J, n = 0.0, 0
    for i in range(lp.shape[0]):
        T_i = [t for t in range(lp.shape[1]) if mask[i, t]]
        if not T_i:
            continue
        n += 1
        s_i = torch.exp(sum(lp[i, t] - lp_prox[i, t] for t in T_i) / len(T_i))
        weighted = lp_b is not None
        w_i = w(sum(lp_prox[i, t] - lp_b[i, t] for t in T_i) / len(T_i)) if weighted and level == "sequence" else 1.0
        w_t = {t: w(lp_prox[i, t] - lp_b[i, t]) if weighted and level == "token" else 1.0 for t in T_i}
        if mode == "gspo":
            assert not weighted or level == "sequence"
            A_i = A[i, T_i[0]]
            J = J + w_i * torch.minimum(s_i * A_i, clip(s_i) * A_i)
        elif mode == "gspo_token":
            terms = []
            for t in T_i:
                s_it = s_i.detach() * torch.exp(lp[i, t] - lp[i, t].detach())
                terms.append(w_i * w_t[t] * torch.minimum(s_it * A[i, t], clip(s_it) * A[i, t]))
            J = J + sum(terms) / len(T_i)
        else:
            terms = []
            for t in T_i:
                r = torch.exp(lp[i, t] - lp_prox[i, t])
                terms.append(w_i * w_t[t] * torch.minimum(r * A[i, t], clip(r) * A[i, t]))
            J = J + sum(terms) / len(T_i)
    return -J / n


def reference_weights(lp_prox, lp_b, mask, level):
    """ŵ per unit, before the cap: exp of the mean log-ratio per sequence ("sequence"), or per token ("token")."""
    rows = [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    if level == "token":
        return [math.exp(lp_prox[i, t] - lp_b[i, t]) for i, T_i in enumerate(rows) for t in T_i]
    return [math.exp(sum(lp_prox[i, t] - lp_b[i, t] for t in T_i) / len(T_i)) for i, T_i in enumerate(rows) if T_i]


def reference_ratios(lp, lp_b, mask, mode):
    """The ratios the metrics' quantiles are over: s_i per sequence, or r_{i,t} per token for GRPO."""
    rows = [[t for t in range(lp.shape[1]) if mask[i, t]] for i in range(lp.shape[0])]
    if mode == "grpo":
        return [math.exp(lp[i, t] - lp_b[i, t]) for i, T_i in enumerate(rows) for t in T_i]
    return [math.exp(sum(lp[i, t] - lp_b[i, t] for t in T_i) / len(T_i)) for i, T_i in enumerate(rows) if T_i]


def loss_and_grad(fn, lp):
    lp = lp.clone().requires_grad_(True)
    out = fn(lp)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), lp.grad, out[1] if isinstance(out, tuple) else None


# the paper's bounds, and decoupled ones (clip_low ≠ clip_high, either way round)
BOUNDS = {"gspo": [None, (5e-4, 1e-4)], "gspo_token": [None, (5e-4, 1e-4)], "grpo": [None, (0.1, 0.35)]}


@pytest.mark.parametrize("mode,bounds", [(m, b) for m, bs in BOUNDS.items() for b in bs])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_gradient_and_metrics_match_the_equations(mode, bounds, seed):
    eps_low, eps_high = bounds or OBJECTIVES[mode].default_clip
    clip = {} if bounds is None else {"clip_low": eps_low, "clip_high": eps_high}
    # noise sized so that some sequences (tokens, for GRPO) are clipped and some are not
    lp, lp_b, mask, A_tok, A_seq = batch(seed, noise=2e-3 if mode != "grpo" else 0.4)
    A = A_seq[:, None].expand(B, T) if mode == "gspo" else A_tok
    ours, g_ours, metrics = loss_and_grad(lambda x: policy_loss(x, lp_b, A, mask, mode=mode, **clip), lp)
    ref, g_ref, _ = loss_and_grad(lambda x: reference(x, lp_b, A, mask, mode, eps_low, eps_high), lp)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(g_ours * mask, g_ref * mask, atol=1e-6, rtol=0)
    assert (g_ours[mask == 0] == 0).all(), "gradient leaked into prompt or padding positions"
    assert 0 < metrics["clip_fraction"] < 1, "the batch should exercise both branches"
    assert metrics["sequences"] == B - 1  # the empty row takes no part
    ratios = torch.tensor(reference_ratios(lp, lp_b, mask, mode), dtype=torch.float64)
    for name, q in (("ratio_p05", 0.05), ("ratio_p50", 0.5), ("ratio_p95", 0.95)):
        assert metrics[name] == pytest.approx(float(torch.quantile(ratios, q)), abs=1e-12)
    on = [(i, t) for i in range(B) for t in range(T) if mask[i, t]]
    assert metrics["abs_logprob_diff"] == pytest.approx(sum(abs(lp[i, t] - lp_b[i, t]) for i, t in on) / len(on))


def test_gspo_token_with_constant_advantages_is_gspo():
    lp, lp_b, mask, _, A_seq = batch(3, noise=2e-3)
    A = A_seq[:, None].expand(B, T)
    gspo, g_gspo, m1 = loss_and_grad(lambda x: policy_loss(x, lp_b, A_seq, mask, mode="gspo"), lp)
    tok, g_tok, m2 = loss_and_grad(lambda x: policy_loss(x, lp_b, A, mask, mode="gspo_token"), lp)
    torch.testing.assert_close(gspo, tok, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_gspo, g_tok, atol=1e-12, rtol=0)
    assert m1["clip_fraction"] == m2["clip_fraction"]


@pytest.mark.parametrize("mode", ["gspo", "gspo_token", "grpo"])
def test_equal_logprobs_give_ratio_one_and_no_clipping(mode):
    lp, _, mask, A_tok, A_seq = batch(4, noise=0.0)
    A = A_seq if mode == "gspo" else A_tok
    loss, metrics = policy_loss(lp, lp, A, mask, mode=mode)
    assert metrics["clip_fraction"] == 0 and metrics["abs_logprob_diff"] == 0 and metrics["seq_kl"] == 0
    assert metrics["ratio_p05"] == metrics["ratio_p50"] == metrics["ratio_p95"] == 1
    A_tok_full = A[:, None].expand(B, T) if A.dim() == 1 else A
    has = mask.any(-1)
    expected = -((A_tok_full * mask).sum(-1)[has] / mask.sum(-1)[has]).mean()  # −(1/B') Σ_i mean_t A_{i,t}
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", ["gspo", "gspo_token"])
def test_gspo_clips_whole_sequences_only(mode):
    lp, lp_b, mask, _, A_seq = batch(5, noise=2e-3)
    A = A_seq if mode == "gspo" else A_seq[:, None].expand(B, T)
    _, grad, metrics = loss_and_grad(lambda x: policy_loss(x, lp_b, A, mask, mode=mode), lp)
    rows = [(grad[i][mask[i].bool()] != 0) for i in range(B) if mask[i].any()]
    assert all(r.all() or not r.any() for r in rows), "a sequence was clipped token by token"
    assert any(not r.any() for r in rows) and any(r.all() for r in rows)
    assert metrics["clip_fraction"] == pytest.approx(sum(not r.any() for r in rows) / len(rows))


def test_bad_calls_are_refused_with_the_fix():
    lp, lp_b, mask, A_tok, _ = batch(6, noise=0.1)
    with pytest.raises(ValueError, match="gspo_token"):
        policy_loss(lp, lp_b, A_tok, mask, mode="gspo")  # per-token advantages with sequence-level GSPO
    with pytest.raises(ValueError, match="valid modes: gspo, gspo_token, grpo"):
        policy_loss(lp, lp_b, A_tok, mask, mode="ppo")
    with pytest.raises(ValueError, match="kl_coef"):
        policy_loss(lp, lp_b, A_tok, mask, mode="grpo", ref_logprobs=lp_b)
    with pytest.raises(ValueError, match="needs both behaviour_logprobs and behaviour_cap"):
        policy_loss(lp, lp_b, A_tok, mask, mode="grpo", behaviour_logprobs=lp_b)
    with pytest.raises(ValueError, match="valid: none, truncate, mask, band"):
        policy_loss(lp, lp_b, A_tok, mask, mode="grpo", **behaviour("clip", lp_b))
    with pytest.raises(ValueError, match="valid: auto, token, sequence"):
        policy_loss(lp, lp_b, A_tok, mask, mode="grpo", **behaviour("mask", lp_b), behaviour_level="turn")
    with pytest.raises(ValueError, match="needs a behaviour_weight other than 'none'"):
        policy_loss(lp, lp_b, A_tok, mask, mode="grpo", behaviour_level="sequence")
    with pytest.raises(ValueError, match=r"> 1 for 'band'"):
        policy_loss(lp, lp_b, A_tok, mask, mode="grpo", **behaviour("band", lp_b, cap=1.0))
    with pytest.raises(ValueError, match=r"one term per sequence.*mode 'gspo_token'"):
        policy_loss(
            lp,
            lp_b,
            A_tok[:, :1].expand(B, T),
            mask,
            mode="gspo",
            **behaviour("truncate", lp_b),
            behaviour_level="token",
        )
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(lp, lp_b, A_tok, mask, mode="grpo", clip_low=1.0)
    with pytest.raises(ValueError, match="all zero"):
        policy_loss(lp, lp_b, A_tok, torch.zeros_like(mask), mode="grpo")
    assert OBJECTIVES["gspo"].default_clip == OBJECTIVES["gspo_token"].default_clip == (3e-4, 4e-4)
    assert OBJECTIVES["grpo"].default_clip == (0.2, 0.27)


def test_kl_penalty_to_a_reference_policy():
    lp, lp_b, mask, A_tok, _ = batch(7, noise=0.05)
    ref = lp_b - 0.1
    beta = 0.5
    base, g_base, _ = loss_and_grad(lambda x: policy_loss(x, lp_b, A_tok, mask, mode="gspo_token"), lp)
    kl, g_kl, metrics = loss_and_grad(
        lambda x: policy_loss(x, lp_b, A_tok, mask, mode="gspo_token", ref_logprobs=ref, kl_coef=beta), lp
    )

    def k3_mean(x):  # (1/B') Σ_i (1/|T_i|) Σ_t [exp(ref − lp) − (ref − lp) − 1]
        per = [
            sum(math.exp(ref[i, t] - x[i, t]) - (ref[i, t] - x[i, t]) - 1 for t in range(T) if mask[i, t])
            / int(mask[i].sum())
            for i in range(B)
            if mask[i].any()
        ]
        return float(sum(per) / len(per))

    assert float(kl - base) == pytest.approx(beta * k3_mean(lp), abs=1e-9)
    assert metrics["kl_ref"] == pytest.approx(k3_mean(lp), abs=1e-9)
    i, t = 0, int(mask[0].nonzero()[0])  # d/dlp of β·k3/|T_i|/B' = β(1 − exp(ref − lp))/|T_i|/B'
    expected = beta * (1 - math.exp(ref[i, t] - lp[i, t])) / int(mask[i].sum()) / (B - 1)
    assert float(g_kl[i, t] - g_base[i, t]) == pytest.approx(expected, abs=1e-9)


def behaviour(kind, lp_b, cap=2.0):
    return {"behaviour_logprobs": lp_b, "behaviour_weight": kind, "behaviour_cap": cap}


KINDS = ["truncate", "mask", "band"]
CAPPED = {
    "truncate": "behaviour_truncated_fraction",
    "mask": "behaviour_masked_fraction",
    "band": "behaviour_band_masked_fraction",
}
# every objective × level allowed: gspo has one term per sequence, so no token-level weight
LEVELS = [
    ("gspo", "auto"),
    ("gspo", "sequence"),
    ("gspo_token", "auto"),
    ("gspo_token", "sequence"),
    ("gspo_token", "token"),
    ("grpo", "auto"),
    ("grpo", "token"),
    ("grpo", "sequence"),
]


def capped_by_reference(raw, kind, cap):
    """Where the cap acts on ŵ: above it, or for "band" outside [1/cap, cap]."""
    return (raw > cap) | (raw < 1 / cap) if kind == "band" else raw > cap


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode,level", LEVELS)
def test_behaviour_weight_matches_the_equations(mode, level, kind):
    """The decoupled objective against the transcription: ratio against lp_prox, each unit (a sequence, or a
    token) weighted by w, in loss, gradient and metrics."""
    lp, lp_prox, mask, A_tok, A_seq = batch(8, noise=2e-3 if mode != "grpo" else 0.4)
    A = A_seq[:, None].expand(B, T) if mode == "gspo" else A_tok
    # the engine's lp_b: a per-sequence shift (older or newer policies) and per-token noise, so that some
    # units' ŵ fall above the cap, some below 1/cap and most between
    g = torch.Generator().manual_seed(9)
    lp_b = lp_prox - torch.linspace(-1, 1, B, dtype=torch.float64)[:, None] + 0.3 * torch.randn(B, T, generator=g)
    cap = 1.5
    ours, g_ours, metrics = loss_and_grad(
        lambda x: policy_loss(x, lp_prox, A, mask, mode=mode, **behaviour(kind, lp_b, cap), behaviour_level=level), lp
    )
    eps_low, eps_high = OBJECTIVES[mode].default_clip
    ref, g_ref, _ = loss_and_grad(
        lambda x: reference(x, lp_prox, A, mask, mode, eps_low, eps_high, lp_b, kind, cap, level), lp
    )
    torch.testing.assert_close(ours, ref, atol=1e-9, rtol=0)
    torch.testing.assert_close(g_ours * mask, g_ref * mask, atol=1e-9, rtol=0)
    plain, _ = policy_loss(lp, lp_prox, A, mask, mode=mode)
    assert not torch.isclose(ours, plain), "the weights should change the loss"
    raw = torch.tensor(reference_weights(lp_prox, lp_b, mask, own_level(mode, level)), dtype=torch.float64)
    for name, q in (("behaviour_weight_p05", 0.05), ("behaviour_weight_p50", 0.5), ("behaviour_weight_p95", 0.95)):
        assert metrics[name] == pytest.approx(float(torch.quantile(raw, q)), abs=1e-12)
    share = float(capped_by_reference(raw, kind, cap).double().mean())
    assert metrics[CAPPED[kind]] == pytest.approx(share) and 0 < share < 1
    assert not {*CAPPED.values()} - {CAPPED[kind]} & metrics.keys()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode,level", LEVELS)
def test_weight_one_is_the_coupled_loss_exactly(mode, level, kind):
    """lp_b = lp_prox gives w = 1 on every unit: the decoupled loss is the coupled one, bit for bit."""
    lp, lp_prox, mask, A_tok, A_seq = batch(12, noise=2e-3 if mode != "grpo" else 0.4)
    A = A_seq if mode == "gspo" else A_tok
    plain, g_plain, m_plain = loss_and_grad(lambda x: policy_loss(x, lp_prox, A, mask, mode=mode), lp)
    same, g_same, m_same = loss_and_grad(
        lambda x: policy_loss(x, lp_prox, A, mask, mode=mode, **behaviour(kind, lp_prox), behaviour_level=level), lp
    )
    assert torch.equal(same, plain) and torch.equal(g_same, g_plain)
    assert m_same.items() >= m_plain.items()
    assert m_same["behaviour_weight_p05"] == m_same["behaviour_weight_p95"] == 1
    assert m_same[CAPPED[kind]] == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["gspo", "gspo_token", "grpo"])
def test_auto_is_the_objective_s_own_level_bit_for_bit(mode, kind):
    """behaviour_level 'auto' (the default) is the weight the objectives took before there was a choice: per
    sequence for the GSPO modes, per token for GRPO, the same numbers exactly; the other level differs."""
    lp, lp_prox, mask, A_tok, A_seq = batch(8, noise=2e-3 if mode != "grpo" else 0.4)
    A = A_seq if mode == "gspo" else A_tok
    g = torch.Generator().manual_seed(9)
    lp_b = lp_prox - torch.linspace(-1, 1, B, dtype=torch.float64)[:, None] + 0.3 * torch.randn(B, T, generator=g)

    def run(**level):
        return loss_and_grad(
            lambda x: policy_loss(x, lp_prox, A, mask, mode=mode, **behaviour(kind, lp_b, 1.5), **level), lp
        )

    auto, own = run(), run(behaviour_level=own_level(mode))
    assert torch.equal(auto[0], own[0]) and torch.equal(auto[1], own[1]) and auto[2] == own[2]
    if mode != "gspo":
        other = run(behaviour_level="token" if own_level(mode) == "sequence" else "sequence")
        assert not torch.isclose(other[0], auto[0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode,level", LEVELS)
def test_stale_tokens_are_weighted_not_clipped(mode, level, kind):
    """Tokens an older policy sampled (lp_b far from the learner's): against lp_b many fall outside the clip
    and teach nothing; decoupled, at the first step (lp_θ = lp_prox) none is clipped, and each unit's gradient
    (a sequence's tokens, or a token's) is the on-policy one times its w: min(ŵ, 2), or ŵ where the mask or
    the band [1/2, 2] keeps it and exactly 0 where it does not."""
    lp, _, mask, A_tok, A_seq = batch(13, noise=0.0)
    A = A_seq if mode == "gspo" else A_tok
    g = torch.Generator().manual_seed(14)
    lp_prox = lp.detach()
    lp_b = torch.where(mask.bool(), lp_prox, 0.0) + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    _, _, coupled = loss_and_grad(lambda x: policy_loss(x, lp_b, A, mask, mode=mode), lp)
    _, g_on, _ = loss_and_grad(lambda x: policy_loss(x, lp_prox, A, mask, mode=mode), lp)
    _, g_dec, decoupled = loss_and_grad(
        lambda x: policy_loss(x, lp_prox, A, mask, mode=mode, **behaviour(kind, lp_b), behaviour_level=level), lp
    )
    assert coupled["clip_fraction"] > 0.2 and decoupled["clip_fraction"] == 0
    on = mask.bool()
    log_w = torch.where(on, lp_prox - lp_b, 0.0)
    if own_level(mode, level) == "sequence":
        log_w = (log_w.sum(-1) / mask.sum(-1).clamp(min=1))[:, None].expand(B, T)
    raw = log_w.exp()
    w = raw.clamp(max=2.0) if kind == "truncate" else torch.where(capped_by_reference(raw, kind, 2.0), 0.0, raw)
    torch.testing.assert_close(g_dec[on], (w * g_on)[on], atol=1e-12, rtol=0)
    assert (g_dec[on] != 0).equal(w[on] != 0), "only a unit the cap zeroes loses its gradient"


@pytest.mark.parametrize("mode", ["gspo", "gspo_token", "grpo"])
def test_bf16_inputs_are_computed_in_fp32(mode):
    """bf16 logprobs (as a bf16 model gives) must be clipped like fp32 ones, at 1 − 3e-4 and 1 + 4e-4."""
    lp, lp_b, mask, A_tok, A_seq = batch(10, noise=2e-3 if mode != "grpo" else 0.4)
    A = A_seq if mode == "gspo" else A_tok
    lp16 = torch.where(mask.bool(), lp, lp_b).to(torch.bfloat16)
    old = lp_b.to(torch.bfloat16)
    want, want_m = policy_loss(lp16.double(), old.double(), A, mask, mode=mode)
    got, got_m = policy_loss(lp16.clone().requires_grad_(True), old, A, mask, mode=mode)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    assert got_m["clip_fraction"] == pytest.approx(want_m["clip_fraction"])
    assert 0 < want_m["clip_fraction"] < 1


@pytest.mark.parametrize(
    "mode,level,kind", [(m, "auto", None) for m in OBJECTIVES] + [(m, lv, k) for m, lv in LEVELS for k in KINDS]
)
def test_a_token_outside_the_learner_s_sampling_filter_is_the_limit_not_nan(mode, level, kind):
    """A generated token the learner's top-k / top-p drops (the engine sampled it at the filter's edge) has
    lp_θ = −inf: loss, gradient and KL are their limit as lp_θ → −∞ (its sequence's s_i → 0, GRPO's r_{i,t}),
    never NaN; decoupled, at the first step lp_prox is −inf there too (the same limit), after one lp_prox alone
    (ŵ = 0: its term drops)."""
    lp, lp_b, mask, A_tok, A_seq = batch(13, noise=2e-3 if mode != "grpo" else 0.4)
    A = A_seq if mode == "gspo" else A_tok
    i, t = 1, int(mask[1].nonzero()[1])
    kl = {"ref_logprobs": lp_b, "kl_coef": 0.1}

    def at(x, value):
        x = x.clone()
        x[i, t] = value
        return x

    def run(x, lp_prox, ref):
        decoupled = {} if kind is None else {**behaviour(kind, lp_b), "behaviour_level": level}
        prox = x.detach() if lp_prox is None else lp_prox  # None: the learner's own, before its first step
        return loss_and_grad(lambda y: policy_loss(y, prox, A, mask, mode=mode, **decoupled, **kl | ref), x)

    # −1e6 stands for −∞: exp(−1e6 / |T_i|) is 0 in float64, and k3 is 0 where lp_ref = lp_θ
    for lp_prox in (None,) if kind else (lp_b,):
        loss, grad, metrics = run(at(lp, -math.inf), lp_prox, {})
        limit, g_limit, m_limit = run(at(lp, -1e6), lp_prox, {"ref_logprobs": at(lp_b, -1e6)})
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        torch.testing.assert_close(loss, limit, atol=1e-12, rtol=0)
        torch.testing.assert_close(grad, g_limit, atol=1e-12, rtol=0)
        assert metrics["kl_ref"] == pytest.approx(m_limit["kl_ref"], abs=1e-12) and grad[i, t] == 0
    if kind is not None:  # after a step: the token back inside the filter, lp_prox = −inf
        loss, grad, _ = run(lp, at(lp, -math.inf), {"ref_logprobs": None, "kl_coef": 0.0})
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad[i, t] == 0
