"""The decoupled objective in the trainer (docs/design.md §4): lp_prox is the learner before its first step on
the batch."""

import pytest
import torch
from fsdp_worker import fixed_batch  # this directory is on sys.path

from agentrl.models.tiny import tiny_model
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
