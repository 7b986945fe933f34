"""The training loop in this process (`agentrl.train.loop.train`, what `agentrl train` runs after its checks):
one iteration of the small run on the default policy, real sandboxes and a Ray the run starts and stops, then
the run's report. The command itself runs as a subprocess in tests/train/test_pipeline.py, where coverage
does not see it; here it does. Then stops and resumes of a tiny run as a machine without Docker runs it (bwrap
sandboxes, env workers that are processes of the run)."""

import asyncio
from pathlib import Path

import pytest
import ray
import torch
from ownership import bwrap_trees
from short_run import SMALL
from test_resume_leftovers import jsonl_scalars, tensorboard_scalars

from agentrl.cli.train import resolve_config
from agentrl.runs import RunDir, read_jsonl
from agentrl.train.driver import Display
from agentrl.train.loop import train
from agentrl.train.report import report
from agentrl.train.run_config import RunConfig

pytestmark = pytest.mark.docker

MODEL = Path(__file__).parents[1] / "data" / "run_v0" / "model"  # a tiny Qwen3-MoE with the project tokenizer
TINY = [
    f"model.path={MODEL}",
    "rollout.group_size=2",
    "rollout.groups_per_iteration=1",
    "rollout.max_groups_in_flight=2",
    "rollout.num_workers=1",
    "rollout.sandboxes_per_worker=2",
    "rollout.sampling.max_tokens=16",
    "rollout.env_workers=local",
    "sandbox.backend=bwrap",
    "eval.tasks=1",
    "eval.every=1",
    "eval.sandboxes_per_worker=1",
    "checkpoint.export_final=false",
    "log.tensorboard=false",
    "threads=1",
]


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


def _tiny(out: Path, *settings: str) -> tuple[RunConfig, RunDir]:
    cfg = resolve_config("code_sandbox", None, [f"out={out}", *TINY, *settings], None)
    run = RunDir(cfg.out)
    run.create(cfg.model_dump(mode="json"))
    return cfg, run


class StopOnceLogged(Display):
    """Ctrl-C as an iteration is logged: after its update, before its checkpoint."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop

    def iteration(self, metrics: dict) -> None:
        self.stop.set()


async def test_a_stop_as_an_iteration_is_logged_ends_the_run_at_its_checkpoint_and_a_resume_finishes_it(
    tmp_path, bwrap_runtime
):
    """Ctrl-C after an iteration's update, as it is logged: the run ends at that iteration's checkpoint, with no
    iteration run past it; resumed with `iterations` at what it has done, it ends with its final evaluation."""
    cfg, run = _tiny(tmp_path / "run", "iterations=3", "eval.tasks=0")
    stop = asyncio.Event()
    state = await train(cfg, run, display=StopOnceLogged(stop), stop=stop)
    assert (state.iteration, state.policy_version) == (1, 1)
    assert [p.name for p in run.checkpoints.iterdir()] == ["iter-00001"]
    assert [m["iteration"] for m in read_jsonl(run.metrics)] == [0]

    cfg, run = _tiny(tmp_path / "run", "iterations=1")  # held-out evaluation on, for the final one
    assert (await train(cfg, run, resume=True)).iteration == 1
    assert [e["iteration"] for e in read_jsonl(run.eval)] == [1]
    assert [m["iteration"] for m in read_jsonl(run.metrics)] == [0]


@pytest.mark.slow  # three runs and resumes, a start-up each; the fast tier stops and resumes in the test above
async def test_a_stop_while_evaluating_ends_before_the_iteration_and_resumes_log_every_evaluation_once(
    tmp_path, bwrap_runtime
):
    """Ctrl-C during the held-out evaluation before iteration 0: it is cut short and not logged, and the run ends
    with a checkpoint of iteration 0; the resumes from it log each evaluation once, a finished run's final one too."""
    cfg, run = _tiny(tmp_path / "run", "iterations=2")
    stop = asyncio.Event()
    task = asyncio.ensure_future(train(cfg, run, stop=stop))
    while not _running("HeldOutEval.run"):
        assert not task.done(), task
        await asyncio.sleep(0.01)
    stop.set()
    state = await task
    assert state.iteration == state.policy_version == 0 and not run.metrics.exists() and not run.eval.exists()
    assert [p.name for p in run.checkpoints.iterdir()] == ["iter-00000"]

    state = await train(cfg, run, resume=True)
    assert (state.iteration, state.policy_version) == (2, 2)
    assert [e["iteration"] for e in read_jsonl(run.eval)] == [0, 1, 2]
    await train(cfg, run, resume=True)  # a finished run resumed (its export cut short, say)
    assert [e["iteration"] for e in read_jsonl(run.eval)] == [0, 1, 2]
    assert [m["iteration"] for m in read_jsonl(run.metrics)] == [0, 1]


@pytest.mark.slow  # 11 s, a run and its resume; the fast tier stops and resumes a run above
async def test_a_cancelled_run_ends_its_rollout_with_it_and_a_resume_starts_over(tmp_path, bwrap_runtime):
    """The second Ctrl-C cancels the run mid-rollout: the controller's iteration is cancelled with it (not left
    driving episodes on the closed env workers and engine) and no task of the run outlives it. With no checkpoint
    saved yet, a resume starts over, its logs too."""
    cfg, run = _tiny(tmp_path / "run", "iterations=5", "eval.tasks=0", "checkpoint.every=0")
    before = asyncio.all_tasks()
    task = asyncio.ensure_future(train(cfg, run))
    while not (rollouts := _running("RolloutController.run_iteration")) or not run.metrics.exists():
        assert not task.done(), task
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(r.cancelled() for r in rollouts), rollouts
    assert not asyncio.all_tasks() - before - {asyncio.current_task()}
    assert not bwrap_trees(bwrap_runtime)

    assert run.latest_checkpoint() is None and [m["iteration"] for m in read_jsonl(run.metrics)] == [0]
    cfg, run = _tiny(tmp_path / "run", "iterations=1", "eval.tasks=0")
    await train(cfg, run, resume=True)
    assert [m["iteration"] for m in read_jsonl(run.metrics)] == [0]


@pytest.mark.slow  # 30 s, a run and two resumes; tests/train/test_resume_leftovers.py covers the same in seconds
async def test_a_resume_leaves_nothing_of_what_the_run_cut_short_logged_past_its_checkpoint(tmp_path, bwrap_runtime):
    """Killed while saving its last checkpoint (cut short: no state.json), after logging iteration 1 and its final
    evaluation: resumed from iteration 1's checkpoint, and stopped at once, the folder holds what it held then, in
    the JSONL, TensorBoard and trajectories/ alike; resumed again to the end, each step once."""
    cfg, run = _tiny(tmp_path / "run", "iterations=2", "log.tensorboard=true")
    await train(cfg, run)
    (run.checkpoint(2) / "state.json").unlink()

    def steps() -> dict[str, list[int]]:
        tensorboard, jsonl = tensorboard_scalars(run), jsonl_scalars(run)
        assert {t: [s for s, _ in p] for t, p in tensorboard.items()} == {
            t: [s for s, _ in p] for t, p in jsonl.items()
        }
        files = sorted(p.name for p in run.trajectories.glob("iter-*.jsonl"))
        assert files == sorted({e["file"] for e in read_jsonl(run.trajectories / "index.jsonl")})
        return {"metrics": [m["iteration"] for m in read_jsonl(run.metrics)], "files": files}

    stop = asyncio.Event()
    stop.set()
    assert (await train(cfg, run, resume=True, stop=stop)).iteration == 1
    assert steps() == {"metrics": [0], "files": ["iter-00000.jsonl"]}
    assert (await train(cfg, run, resume=True)).iteration == 2
    assert steps() == {"metrics": [0, 1], "files": ["iter-00000.jsonl", "iter-00001.jsonl"]}
    assert [e["iteration"] for e in read_jsonl(run.eval)] == [0, 1, 2]


def _running(name: str) -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if not t.done() and t.get_coro().__qualname__ == name]
