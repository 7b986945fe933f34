"""An update reads values back from the device once, not in every minibatch step.

On a GPU every read (`.item()`, `float(t)`, `if t:`, boolean-mask indexing, `nonzero`, `unique`) waits for all the
work queued before it, so a step that reads stalls its launches. These tests count the aten ops that read a value
back, with a `TorchDispatchMode`, on the CPU: the loss, the metrics and the router loss read nothing; an update's
reads outside the scorer do not grow with its minibatches (the scorer plans from host copies of the ids and mask,
which the CPU cannot tell apart from device data: its reads are counted apart and left out).
"""

import sys
from pathlib import Path

import pytest
import torch
from fsdp_worker import fixed_batch  # this directory is on sys.path

from agentrl.algo import policy_objective
from agentrl.algo.loss import metric_values
from agentrl.models.tiny import tiny_model
from agentrl.train.config import AlgoConfig, OptimConfig, TrainerConfig
from agentrl.train.diagnostics import Metrics
from agentrl.train.trainer import Trainer, router_aux_loss

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from profiling import HostReads  # benchmarks/host_reads.py counts with it too


def loss_inputs(mode: str = "gspo_token"):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 20
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[4] = 0  # a sequence with nothing generated
    lp = (torch.randn(B, T, generator=g) * 0.1 - 1).requires_grad_()
    old = lp.detach() + torch.randn(B, T, generator=g) * 0.01
    A = torch.randn(B, generator=g)
    return lp, old, A, mask


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "gspo_token"},
        {"mode": "gspo"},
        {"mode": "grpo", "sequence_weights": torch.tensor([1, 0.5, 0.5, 1, 1, 1])},
        {"mode": "gspo_token", "behaviour_weight": "band", "behaviour_cap": 2.0, "behaviour_level": "token"},
        {"mode": "gspo_token", "kl_coef": 0.1},
    ],
    ids=["gspo_token", "gspo", "grpo_weighted", "band", "kl"],
)
def test_the_objective_and_its_metrics_read_nothing_back(options):
    lp, old, A, mask = loss_inputs()
    extra = dict(options)
    if "behaviour_weight" in extra:
        extra["behaviour_logprobs"] = old - 0.2
    if "kl_coef" in extra:
        extra["ref_logprobs"] = old + 0.1
    with HostReads() as host:
        loss, metrics = policy_objective(lp, old, A, mask, **extra)
        loss.backward()
        log = Metrics()
        for k, v in metrics.items():
            log.add(k, v)
        reduced = log.reduce(1)  # the one transfer, then host floats
    assert host.reads == []
    assert reduced == pytest.approx({k: float(v) for k, v in metric_values(metrics).items()}, rel=1e-12)


def test_masked_quantiles_are_torch_quantile_of_the_kept_values():
    """The metrics' quantiles over the generated tokens equal torch.quantile of those tokens' ratios."""
    lp, old, A, mask = loss_inputs()
    _, metrics = policy_objective(lp, old, A, mask, mode="grpo")
    ratios = (lp.detach() - old).exp()[mask.bool()].double()
    expected = torch.quantile(ratios, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
    values = metric_values(metrics)
    got = torch.stack([values["ratio_p05"], values["ratio_p50"], values["ratio_p95"]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_metrics_read_the_device_back_once_and_keep_host_floats():
    log = Metrics()
    log.log("loss", torch.tensor(2.0), 1.0)
    log.log("loss", torch.tensor(4.0), 3.0)
    log.log("grad_norm", 0.5)
    log.log("grad_norm", torch.tensor(1.5))
    with HostReads() as host:
        out = log.reduce(1)
    assert out == {"loss": pytest.approx(3.5), "grad_norm": pytest.approx(1.0)}
    assert host.reads == []  # .cpu().tolist() of one stacked tensor: a copy, no scalar reads


def test_the_router_loss_reads_nothing_back():
    g = torch.Generator().manual_seed(1)
    logits = tuple(torch.randn(2 * 9, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 9)
    mask[1, 6:] = 0
    with HostReads() as host:
        aux = router_aux_loss(logits, 2, mask)
    assert host.reads == []
    keep = mask.reshape(-1).bool()
    probs = torch.cat([x[keep] for x in logits]).softmax(-1)  # the real tokens alone, as transformers counts them
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(2, -1).indices, 1.0)
    N = len(probs)
    torch.testing.assert_close(aux, 8 * ((chosen.sum(0) / N) * (probs.sum(0) / N)).sum())


def update_reads(minibatches: int) -> tuple[list[str], int]:
    """The reads of one update of `minibatches` steps from its first forward on (the split before it reads the
    host copies it makes) outside the scorer's forwards, and the forwards."""
    cfg = TrainerConfig(optim=OptimConfig(lr=1e-3, minibatches=minibatches), algo=AlgoConfig())
    trainer = Trainer(cfg, tiny_model("qwen3_moe", seed=0))
    batch = fixed_batch()
    trainer.update(batch)  # a first update: whatever is set up once
    host, forwards = HostReads(), []

    def enter(module, args, kwargs):
        if not forwards:
            host.reads.clear()
        host.depth += 1
        forwards.append(1)

    def leave(module, args, kwargs, out):
        host.depth -= 1

    trainer.scorer.register_forward_pre_hook(enter, with_kwargs=True)
    trainer.scorer.register_forward_hook(leave, with_kwargs=True)
    with host:
        trainer.update(batch)
    return host.reads, len(forwards)


def test_an_update_s_reads_outside_the_scorer_do_not_grow_with_its_minibatches():
    """Those left are the observers' of minibatch 0 and after the last step (the expert flip rate): three more
    minibatches add forwards but no read."""
    one, forwards_one = update_reads(1)
    four, forwards_four = update_reads(4)
    assert forwards_four > forwards_one  # the hooks saw the minibatches' forwards
    assert len(four) == len(one), (one, four)
