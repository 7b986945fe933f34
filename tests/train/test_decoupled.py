"""The decoupled objective in the trainer (docs/design.md §4): lp_prox is the learner before its first step on
the batch, and the batch's token versions give the staleness of what it trains."""

import pytest
import torch
from fsdp_worker import fixed_batch  # this directory is on sys.path

from agentrl.engine.base import Generation, SamplingParams
from agentrl.models.tiny import tiny_model
from agentrl.rollout import Group, Status, Trajectory
from agentrl.train.batch import build_batch
from agentrl.train.config import AlgoConfig, OptimConfig, TrainerConfig
from agentrl.train.diagnostics import RowRecorder
from agentrl.train.trainer import Trainer


@pytest.mark.parametrize("weight", ["none", "truncate"])
def test_the_ratio_is_taken_against_the_learner_before_its_first_step(weight):
    """Two minibatches: each recorded row's s_i is against lp_prox, the weights before the first step (scored
    here beforehand), also for minibatch 1, trained after a step; minibatch 0's is exactly 1. Under 'none' it is
    against the engine's lp_b."""
    algo = AlgoConfig(behaviour_weight=weight)
    trainer = Trainer(TrainerConfig(algo=algo, optim=OptimConfig(lr=1e-2, minibatches=2)), tiny_model("qwen3", seed=0))
    batch = fixed_batch()
    with torch.no_grad():
        before = trainer.scorer(batch.input_ids, batch.attention_mask, batch.sampling)[0]
    recorder = RowRecorder(set(range(len(batch))), algo)
    trainer.update(batch, recorder)
    assert {r.minibatch for r in recorder.stats.values()} == {0, 1}
    for row, r in recorder.stats.items():
        on = batch.loss_mask[row, : len(r.logprobs)].bool()
        reference = (before if weight == "truncate" else batch.old_logprobs)[row, : len(r.logprobs)]
        expected = float((torch.tensor(r.logprobs)[on] - reference[on]).mean().exp())
        if weight == "truncate" and r.minibatch == 0:
            assert r.ratio == 1.0
        elif weight == "truncate":  # the first step moved it: not a ratio against the weights after it
            assert abs(r.ratio - 1) > 1e-3
        assert r.ratio == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_trainer_weighs_at_the_behaviour_level_asked_for(level):
    """GRPO with IcePop's band (C = 2): engine logprobs scattered around the learner's put some tokens' ŵ
    outside [1/2, 2], hardly a sequence's geometric mean. The trainer passes algo.behaviour_level to the loss:
    the weight's quantiles and out-of-band share are over the units asked for."""
    algo = AlgoConfig(loss="grpo", behaviour_weight="band", behaviour_level=level)
    trainer = Trainer(TrainerConfig(algo=algo, optim=OptimConfig(minibatches=1)), tiny_model("qwen3", seed=0))
    batch = fixed_batch()
    with torch.no_grad():
        before = trainer.scorer(batch.input_ids, batch.attention_mask, batch.sampling)[0]
    on = batch.loss_mask.bool()
    g = torch.Generator().manual_seed(1)
    batch.old_logprobs = torch.where(on, before + 0.5 * torch.randn(before.shape, generator=g), 0.0)
    log_w = torch.where(on, before - batch.old_logprobs, 0.0).double()
    raw = (log_w.sum(-1) / on.sum(-1)).exp() if level == "sequence" else log_w[on].exp()
    metrics = trainer.update(batch)
    for name, q in (("behaviour_weight_p05", 0.05), ("behaviour_weight_p50", 0.5), ("behaviour_weight_p95", 0.95)):
        assert metrics[name] == pytest.approx(float(torch.quantile(raw, q)), rel=1e-4)
    outside = float(((raw > 2) | (raw < 0.5)).double().mean())
    assert metrics["behaviour_band_masked_fraction"] == pytest.approx(outside)
    assert (outside > 0.05) if level == "token" else (outside == 0)
    assert metrics["grad_norm"] > 0


def trajectory(name: str, pieces: list[tuple[int, int, int]]) -> Trajectory:
    """A 3-token prompt, then per turn (n tokens, the version that sampled them, the oldest version in their KV)."""
    t = Trajectory(episode_id=name, group_id="g", task_id="g", sampling=SamplingParams(temperature=1.0))
    t.append_prompt([1, 2, 3])
    for k, (n, version, kv) in enumerate(pieces):
        t.append_generation(Generation([10 + k] * n, [-0.5] * n, [version] * n, "stop", kv_versions=[kv] * n))
        t.turns[-1].reward = float(k)
        t.append_observation([7, 8])
    t.status, t.outcome_reward = Status.FINISHED, float(len(pieces))
    return t


def test_staleness_of_the_trained_tokens():
    """Per token, versions behind the learner's (from the older of its sampler and its KV): a histogram of
    token counts, with mean and max; logged only when the update is told the learner's version."""
    trajs = [trajectory("a", [(2, 3, 3), (3, 2, 1)]), trajectory("b", [(4, 3, 3), (1, 0, 0)])]
    batch, _ = build_batch([Group("g", "g", trajs)], AlgoConfig())
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        assert batch.token_versions[i, :n].tolist() == t.token_versions and (batch.token_versions[i, n:] == -1).all()
    trainer = Trainer(TrainerConfig(optim=OptimConfig(minibatches=2)), tiny_model("qwen3", seed=0))
    metrics = trainer.update(batch, policy_version=3)
    # a: 2 tokens 0 behind, 3 sampled by version 2 over KV of version 1: 2 behind; b: 4 at 0, 1 at 3
    hist = {k: v for k, v in metrics.items() if k.startswith("staleness_")}
    assert hist == {
        "staleness_0": 6,
        "staleness_1": 0,
        "staleness_2": 3,
        "staleness_3": 1,
        "staleness_mean": pytest.approx((2 * 3 + 3 * 1) / 10),
        "staleness_max": 3,
    }
    assert not any(k.startswith("staleness") for k in trainer.update(batch))
    with pytest.raises(ValueError, match="version 2"):
        trainer.update(batch, policy_version=2)  # tokens of version 3 cannot be trained by version 2
    with pytest.raises(ValueError, match="token_versions"):
        trainer.update(fixed_batch(), policy_version=0)
