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


def test_no_positions_give_an_empty_lp_on_the_graph():
    """Nothing to score (a length bucket of one-token rows): lp and entropy (B, 0), and a backward that reaches the
    head with a zero gradient, as a rank with such a share must still run it."""
    head = torch.randn(500, 16, requires_grad=True)
    lp, entropy = target_logprobs(
        torch.randn(3, 0, 16), head, torch.zeros(3, 0, dtype=torch.long), PARAMS[1], entropy=True
    )
    assert lp.shape == entropy.shape == (3, 0)
    lp.sum().backward()
    assert torch.equal(head.grad, torch.zeros_like(head))


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


TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


@pytest.mark.parametrize(
    ("model_type", "settings", "named"),
    [
        ("gemma2", {"head_dim": 16, "final_logit_softcapping": 2.0}, "final_logit_softcapping=2.0"),  # default 30
        ("granite", {"logits_scaling": 8.0}, "logits_scaling=8.0"),
        ("cohere", {}, "logit_scale=0.0625"),
        (
            "recurrent_gemma",
            {"head_dim": 16, "lru_width": 32, "attention_window_size": 8, "logits_soft_cap": 2.0},
            "logits_soft_cap=2.0",
        ),
    ],
)
def test_a_model_that_changes_its_logits_after_the_head_is_refused(model_type, settings, named):
    """The scorer's lp is h · Wᵀ: for these models the engine's (the model's own logits) differs, so the learner
    refuses them at once, naming the setting, rather than train on biased ratios."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentrl.engine.sampling import token_logprobs
    from agentrl.train.scoring import Scorer

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **settings)).eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # what it guards against: the head's product alone is not the model's distribution
        own = token_logprobs(model(ids, use_cache=False).logits[:, :-1], ids[:, 1:], PARAMS[0])
        hidden = model.get_decoder()(ids, use_cache=False).last_hidden_state[:, :-1]
        plain, _ = target_logprobs(hidden, model.get_output_embeddings().weight, ids[:, 1:])
    assert (own - plain).abs().max() > 1e-4  # float32 rounding is ~1e-6
    with pytest.raises(ValueError, match=f"{model_type} changes its logits after the output head \\({named}\\)"):
        Scorer(model)
