"""Chunked target logprobs against the whole-logits computation; their peak memory, measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.engine.base import SamplingParams
from agentrl.train.logprobs import naive_target_logprobs, target_logprobs

PARAMS = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.2, top_k=20)]


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "t0.7-p0.9", "t1.2-k20"])
def test_chunked_equals_naive_in_value_and_gradient(params):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(500, 16, generator=g, dtype=torch.float64, requires_grad=True)
    logits = hidden @ head.T
    targets = logits.detach().argmax(-1)  # inside every top-k / top-p set
    targets[:, ::3] = (
        torch.randint(0, 500, targets[:, ::3].shape, generator=g) if params.top_k == 0 else targets[:, ::3]
    )
    weights = torch.randn(3, 37, generator=g, dtype=torch.float64)

    naive = naive_target_logprobs(logits, targets, params)
    (naive * weights).sum().backward()
    g_naive = hidden.grad.clone(), head.grad.clone()
    hidden.grad = head.grad = None
    chunked, entropy = target_logprobs(hidden, head, targets, params, chunk_size=16, entropy=True)
    (chunked * weights).sum().backward()
    torch.testing.assert_close(chunked, naive.float() if chunked.dtype != naive.dtype else naive)
    torch.testing.assert_close((hidden.grad, head.grad), g_naive)
    from agentrl.engine.sampling import sampling_logprobs

    logq = sampling_logprobs(logits.detach(), params.temperature, params.top_k, params.top_p)
    q = logq.exp()
    expected = -(q * torch.where(q > 0, logq, 0.0)).sum(-1)
    torch.testing.assert_close(entropy, expected)
    assert not entropy.requires_grad


BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "logprob_bench.py"


@pytest.mark.slow  # a 150k vocabulary; the fast tier checks the chunked values above
def test_chunked_peak_memory_is_under_a_quarter_of_naive():
    """vocab 152k, 2048 positions: the naive path holds fp32 (T, V) logits, log-softmax and grads.
    Measured by the benchmark itself, each path in its own process."""
    out = subprocess.run(
        [sys.executable, str(BENCH), "--tokens", "2048", "--hidden", "64", "--vocab", "151936"],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)["vocab_151936"]
    assert result["same_result"]
    assert result["memory_ratio"] <= 1 / 4, result
