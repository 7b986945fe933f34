"""Learner ranks as Ray actors (a real local Ray; 2 gloo ranks over 2 CPUs) against one plain process."""

import asyncio

import pytest
import ray
import torch
from fsdp_worker import fixed_batch, second_batch

from agentrl.cluster import LearnerPlacement
from agentrl.models.tiny import save_tiny
from agentrl.train.config import ModelConfig, OptimConfig, TrainerConfig
from agentrl.train.ray_learner import RayLearner
from agentrl.train.trainer import Trainer

pytestmark = pytest.mark.slow  # two Ray actors loading a model: ~20 s (the fast tier is near its budget)

ATOL = 1e-5  # as tests/train/test_fsdp.py: fp32, the ranks reduce in another order than one process sums


@pytest.fixture(scope="module")
def ray_two_cpus():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


async def test_actor_ranks_reproduce_one_process_and_idle_past_the_collective_timeout(tmp_path, ray_two_cpus):
    """Two ranks in a placement group update like one process; between calls they wait in no collective, so an
    idle spell (a rollout) longer than collective_timeout_s costs nothing; a checkpoint saved by the ranks
    resumes into them."""
    path = save_tiny(tmp_path / "model", "qwen3_moe", seed=0)
    cfg = TrainerConfig(model=ModelConfig(path=str(path)), optim=OptimConfig(lr=1e-3, minibatches=2))
    torch.manual_seed(0)
    one = Trainer.build(cfg)
    expected = one.update(fixed_batch())
    expected_state = one.engine_weights()
    timeout = 2.0
    placement = LearnerPlacement(ranks=2, cpus_per_rank=1, collective_timeout_s=timeout)
    learner = await RayLearner.start(cfg, placement, run_dir=tmp_path)
    try:
        assert len(learner.placement()) == 2
        metrics = await learner.update(fixed_batch())
        state = await learner.engine_weights()
        assert state.keys() == expected_state.keys()
        for name, value in expected_state.items():
            torch.testing.assert_close(state[name], value, atol=ATOL, rtol=0, msg=name)
        for key in ("loss", "clip_fraction", "entropy", "grad_norm", "router_aux_loss"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key

        await learner.save(tmp_path / "ckpt", {"iteration": 1})
        await asyncio.sleep(2 * timeout)  # longer than one collective may take: no rank is in one
        after = await learner.update(second_batch())
        assert await learner.load(tmp_path / "ckpt") == {"iteration": 1}
        again = await learner.update(second_batch())  # from the checkpoint: the same step as before
        assert again["loss"] == pytest.approx(after["loss"], rel=1e-6)
    finally:
        await learner.close()
    for rank in learner.ranks:  # released: the actors are gone
        with pytest.raises(ray.exceptions.RayActorError):
            await rank.node.remote()
