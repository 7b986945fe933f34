"""The training loop in this process (`agentrl.train.loop.train`, what `agentrl train` runs after its checks):
one iteration of the small run on the default policy, real sandboxes and a Ray the run starts and stops, then
the run's report. The command itself runs as a subprocess in tests/train/test_pipeline.py, where coverage
does not see it; here it does."""

import pytest
import ray
import torch
from short_run import SMALL

from agentrl.cli.train import resolve_config
from agentrl.runs import RunDir, read_jsonl
from agentrl.train.loop import train
from agentrl.train.report import report

pytestmark = pytest.mark.docker


@pytest.mark.usefixtures("sandbox_image")
async def test_one_iteration_in_process_then_its_report(tmp_path):
    tiny = [
        "rollout.group_size=2",
        "rollout.groups_per_iteration=1",
        "rollout.max_groups_in_flight=2",
        "rollout.num_workers=1",
        "rollout.sandboxes_per_worker=2",
        "eval.tasks=1",
        "eval.sandboxes_per_worker=1",
        # an engine in another dtype than the learner's gets its own copy in it, never the learner's module
        "engine.dtype=bfloat16",
        # FSDP2's CPU offload: the learner is a process group of one, which the run joins and leaves
        "model.cpu_offload=true",
    ]
    cfg = resolve_config("code_sandbox", None, ["iterations=1", f"out={tmp_path / 'run'}", *SMALL, *tiny], None)
    run = RunDir(cfg.out)
    run.create(cfg.model_dump(mode="json"))
    assert not ray.is_initialized()
    state = await train(cfg, run)
    assert (state.iteration, state.policy_version) == (1, 1)
    assert not ray.is_initialized(), "the run stops the Ray it started"
    assert not torch.distributed.is_initialized(), "the learner leaves the process group it joined"
    metrics = read_jsonl(run.metrics)
    assert [m["iteration"] for m in metrics] == [0] and metrics[0]["policy_version"] == 1
    # the bf16 engine's lp_b differ from the float32 learner's: a shared module would log exactly 0
    assert "train/loss" in metrics[0] and 0 < metrics[0]["train/mismatch_abs_logprob_diff"] < 0.2
    assert [e["iteration"] for e in read_jsonl(run.eval)] == [0, 1]
    assert [p.name for p in run.checkpoints.iterdir()] == ["iter-00001"] and (run.final / "config.json").exists()
    assert list((run.path / "tensorboard").iterdir()) and list(run.trajectories.glob("iter-*.jsonl"))
    plots, summary = report(run.path)
    assert plots == run.plots and (plots / "heldout.png").exists() and (plots / "summary.md").read_text() == summary
