"""One loop, three learners: `agentrl.train.loop.train` driven through the trainer in this process
(`LocalLearner`), two learner ranks as Ray actors (`RayLearner`), and torchrun's two ranks
(`torchrun --nproc-per-node 2 -m agentrl train`: the driver is rank 0 and rank 1 only follows its calls).

From the same start, with rollouts made deterministic (one request decoded at a time, no prefix cache, no partial
rollouts), the three sample the same episodes and end at the same weights to 1e-5 (fp32: two ranks reduce in
another order than one process sums), two iterations in, so the weight sync between them is covered too. The Ray
run is resumed after its first iteration: its ranks load their checkpoint and its engine, a copy loaded from the
start, samples with the checkpoint's weights. The Ray ranks wait in no collective between calls, and are gone once
closed."""

import asyncio

import pytest
import ray
import torch
from cli import agentrl, sets
from safetensors.torch import load_file

from agentrl.cli.train import resolve_config
from agentrl.cluster import LearnerPlacement
from agentrl.models.default import resolve_path
from agentrl.runs import RunDir, read_jsonl
from agentrl.train.loop import train
from agentrl.train.ray_learner import RayLearner

pytestmark = [pytest.mark.docker, pytest.mark.slow]  # the fast tier drives the loop in process: test_loop.py

ATOL = 1e-5
# the Ray ranks' collective timeout: far above how far apart two ranks may reach one collective on a loaded machine
# (3 s was not, once, in CI), and shorter than the wait the test makes between two calls
TIMEOUT_S = 10.0
RUN = [
    "iterations=2",
    "rollout.group_size=2",
    "rollout.groups_per_iteration=2",
    "rollout.partial=false",
    "rollout.num_workers=1",
    "rollout.sandboxes_per_worker=4",
    "rollout.sampling.max_tokens=32",
    "rollout.env_kwargs.max_turns=2",
    "engine.max_batch_size=1",  # a request decoded alone, from scratch: its numerics do not depend on the others
    "engine.prefix_cache_tokens=0",
    "eval.tasks=0",
    "threads=1",
]
SAME = ["rollout/reward", "rollout/generated_tokens", "rollout/episodes", "policy_version"]


def weights(run) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


@pytest.mark.usefixtures("sandbox_image")
@pytest.mark.timeout(900)
async def test_one_loop_through_each_learner_reproduces_one_process(tmp_path):
    runs = {name: tmp_path / name for name in ("local", "ray", "torchrun")}

    def config(name, *settings):
        cfg = resolve_config("code_sandbox", None, [*RUN, f"out={runs[name]}", *settings], None)
        RunDir(cfg.out).create(cfg.model_dump(mode="json"))
        return cfg

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # both runs in this process use it
    try:
        await train(config("local"), RunDir(runs["local"]))

        # Ray ranks, for one iteration and then resumed for the second: the ranks load the checkpoint they saved,
        # and the engine, a copy of its own loaded from the start, samples with its weights
        cfg = config("ray", "iterations=1")
        # between calls no rank waits in a collective: rollouts longer than one collective may take cost nothing
        placement = LearnerPlacement(ranks=2, collective_timeout_s=TIMEOUT_S)
        learner = await RayLearner.start(cfg.trainer(), placement, run_dir=runs["ray"], threads=1)
        try:
            await train(cfg, RunDir(runs["ray"]), learner=learner)
            await asyncio.sleep(TIMEOUT_S + 1)  # longer than a collective may take: the resume's load must not mind
            resumed = resolve_config(None, None, ["iterations=2"], runs["ray"])
            await train(resumed, RunDir(runs["ray"]), resume=True, learner=learner)
            last = read_jsonl(RunDir(runs["ray"]).metrics)[-1]  # the ranks waited, in no collective, for the rollout
            assert last["time/learner_idle_s"] >= last["time/rollout_s"] > 0
        finally:
            await learner.close()
        for rank in learner.ranks:  # released: the actors are gone
            with pytest.raises(ray.exceptions.RayActorError):
                await rank.node.remote()
    finally:
        ray.shutdown()

    agentrl(
        "train",
        "--env",
        "code_sandbox",
        *sets(*RUN, f"out={runs['torchrun']}"),
        launcher=["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        cwd=tmp_path,
        timeout=400,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    shards = sorted(p.name for p in (runs["torchrun"] / "checkpoints" / "iter-00002").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # both ranks hold their shards

    one, one_metrics = weights(runs["local"]), read_jsonl(RunDir(runs["local"]).metrics)
    assert [m["policy_version"] for m in one_metrics] == [1, 2]
    start = load_file(f"{resolve_path('default')}/model.safetensors")
    assert max((one[k] - start[k]).abs().max().item() for k in start) > 10 * ATOL  # the updates moved the weights
    for name in ("ray", "torchrun"):
        metrics = read_jsonl(RunDir(runs[name]).metrics)
        assert [{k: m[k] for k in SAME} for m in metrics] == [{k: m[k] for k in SAME} for m in one_metrics], name
        for m, m1 in zip(metrics, one_metrics, strict=True):
            assert m["train/loss"] == pytest.approx(m1["train/loss"], rel=1e-4, abs=1e-7), name
            # the engine, a copy of its own here, samples with the synced weights (the checkpoint's, after the
            # resume): its lp_b are the trainer's, where the starting weights are 0.3 off the final ones (mean
            # |logprob difference| on random tokens)
            assert m["train/mismatch_abs_logprob_diff"] < 1e-4, name
        state = weights(runs[name])
        assert state.keys() == one.keys()
        for key, value in one.items():
            torch.testing.assert_close(state[key], value, atol=ATOL, rtol=0, msg=f"{name}: {key}")
