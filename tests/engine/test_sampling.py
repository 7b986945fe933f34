"""The batched sampler: each row's distribution is `sampling_logprobs`' for its own settings, and its draw
follows that distribution and depends on its seed, its token index and its logits alone."""

import math

import pytest
import torch

from agentrl.engine.base import MIN_TEMPERATURE, SamplingParams
from agentrl.engine.sampling import RowSampling, exponential_noise, sampling_logprobs, seed_key

CPU = torch.device("cpu")

SETTINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.95),
    SamplingParams(temperature=0.9, top_k=1),
    SamplingParams(temperature=1.0, top_k=10_000),  # wider than the vocabulary: off
    SamplingParams(temperature=0.5, top_p=0.3),
    SamplingParams(temperature=2.0, top_k=7),
]


def rows(params: list[SamplingParams], V: int, seeds=None) -> RowSampling:
    seeds = range(len(params)) if seeds is None else seeds
    return RowSampling.of(params, [seed_key(s) for s in seeds], V, CPU)


def test_each_row_gets_the_distribution_of_its_own_settings():
    """Any mix of settings in one pass, and the subsets that skip the sort or the top-k, give each row exactly
    what `sampling_logprobs` (the trainer's) gives it alone."""
    V = 300
    logits = torch.randn(len(SETTINGS), V, generator=torch.Generator().manual_seed(0)) * 3
    for subset in (range(8), [1, 3, 4, 7], [2, 6], [0, 1], [0], [4, 7]):
        params = [SETTINGS[i] for i in subset]
        got = rows(params, V).logprobs(logits[list(subset)])
        for row, i in enumerate(subset):
            p = SETTINGS[i]
            assert torch.equal(got[row], sampling_logprobs(logits[i], p.temperature, p.top_k, p.top_p)), (subset, p)
    untempered = [SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams()]
    before = logits[:3].clone()
    got = rows(untempered, V).logprobs(logits[:3])
    assert torch.equal(logits[:3], before), "filtering wrote into the caller's logits"
    assert torch.equal(got[0], sampling_logprobs(logits[0], 1.0, 5)) and torch.isinf(got[0]).sum() == V - 5


def test_noise_is_exponential_and_distinct_across_rows_steps_and_counters():
    keys = torch.tensor([seed_key(s) for s in range(64)])
    e = torch.cat([exponential_noise(keys, torch.full((64,), t), 40) for t in range(8)])  # (512, 40 + 256)
    assert e.dtype == torch.float64 and bool((e > 0).all()) and bool(e.isfinite().all())
    u = torch.sort(torch.exp(-e).flatten()).values  # uniform on (0, 1) if E ~ Exp(1)
    n = u.numel()
    ks = (u - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max().item()
    assert ks < 1.63 / math.sqrt(n), ks  # Kolmogorov-Smirnov at 1 %
    assert abs(e.mean().item() - 1) < 0.01 and abs(e.var().item() - 1) < 0.02
    assert torch.unique(e).numel() == n, "two rows, steps or counters share their noise"
    # neighbouring counters, steps and seeds are uncorrelated
    for a, b in ((e[:, :-1], e[:, 1:]), (e[:-64], e[64:]), (e[:-1], e[1:])):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.01


def test_draws_follow_the_distribution_across_blocks():
    """Two stages (a block by its mass, then a token in it) draw exactly from q: 30,000 draws over a vocabulary
    of three blocks, the last one partial, with filtered tokens."""
    V, n = 600, 30_000
    z = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 2
    z[250:262] += 4  # mass on both sides of the first block boundary
    p = SamplingParams(temperature=1.0, top_k=300)
    logq = sampling_logprobs(z, p.temperature, p.top_k, p.top_p)
    draws = []
    for start in range(0, n, 5000):  # 5000 requests, each at a token index of its own
        seeds = range(start, start + 5000)
        r = rows([p] * 5000, V, seeds)
        draws.append(r.sample(logq.expand(5000, V), torch.tensor(seeds) % 13))
    counts = torch.bincount(torch.cat(draws), minlength=V).double()
    q = logq.exp().double()
    assert counts[q == 0].sum() == 0, "drew a filtered token"
    expected = q * n
    keep = expected >= 5
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 4 * math.sqrt(2 * dof), (chi2, dof)  # 4 standard deviations of chi-square


def test_a_draw_depends_on_its_seed_index_and_logits_alone():
    V = 700
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(len(SETTINGS), V, generator=g)
    index = torch.arange(len(SETTINGS)) * 5
    batch = rows(SETTINGS, V)
    together = batch.sample(batch.logprobs(logits), index)
    for i, p in enumerate(SETTINGS):
        alone = rows([p], V, [i])
        assert alone.sample(alone.logprobs(logits[i : i + 1]), index[i : i + 1]).item() == together[i].item()
    assert together[0].item() == logits[0].argmax().item(), "greedy is argmax"
    # the same logits: another seed or token index is another draw
    flat = torch.zeros(64, V)
    r = rows([SamplingParams()] * 64, V)
    by_seed = r.sample(flat, torch.zeros(64, dtype=torch.long))
    by_index = rows([SamplingParams()] * 64, V, [0] * 64).sample(flat, torch.arange(64))
    assert len(set(by_seed.tolist())) > 55 and len(set(by_index.tolist())) > 55
    assert torch.equal(by_seed, r.sample(flat, torch.zeros(64, dtype=torch.long))), "not reproducible"


def test_seed_keys_are_two_32_bit_words_of_any_integer():
    keys = {seed_key(s) for s in (0, 1, -1, 2**64, 2**64 + 1, 10**30, 7)}
    assert len(keys) == 5 and seed_key(2**64 + 1) == seed_key(1), "seeds count modulo 2^64"
    assert all(0 <= w < 2**32 for key in keys for w in key)


def test_a_temperature_too_small_to_sample_with_is_refused_and_the_smallest_gives_finite_logprobs():
    """At 1e-39 (a float32 subnormal) logits / temperature overflow: every logprob is NaN, which would poison the
    loss; 0 (greedy) and MIN_TEMPERATURE are finite."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.isnan(sampling_logprobs(logits, 1e-39)).all()  # what such a request sampled from
    for t in (1e-39, 1e-6):
        with pytest.raises(ValueError, match=f"temperature={t:g} is neither 0 .greedy. nor at least 1e-05"):
            SamplingParams(temperature=t)
    for t in (0.0, MIN_TEMPERATURE):
        p = SamplingParams(temperature=t)
        got = rows([p] * 4, 300).logprobs(logits)
        assert torch.isfinite(got.max(-1).values).all() and not torch.isnan(got).any(), t
