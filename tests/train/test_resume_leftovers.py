"""What a run cut short after a checkpoint had logged past it, a resume from that checkpoint leaves behind neither in
TensorBoard nor in trajectories/: the resume does what `agentrl.train.build` and the loop do (`RunDir.truncate_logs`,
then a new `Tracker`, told of the resume), with real event files read back as TensorBoard reads them, and the folder
read as `agentrl view` reads it. tests/train/test_loop.py resumes a real run so."""

import time

from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

from agentrl.engine.base import SamplingParams
from agentrl.rollout import Group, Trajectory
from agentrl.runs import RunDir, read_jsonl, read_trajectory
from agentrl.train.run_config import LogConfig
from agentrl.train.tracking import Tracker
from agentrl.view import Filters, Folder


def tensorboard_scalars(run: RunDir) -> dict[str, list[tuple[int, float]]]:
    """The points of each tag as TensorBoard's loader (`--load_fast=false`) holds them, purges done (tags left with
    none aside)."""
    acc = EventAccumulator(str(run.path / "tensorboard"))
    acc.Reload()
    points = {t: [(e.step, make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(t)] for t in acc.Tags()["tensors"]}
    return {t: p for t, p in points.items() if p}


def jsonl_scalars(run: RunDir) -> dict[str, list[tuple[int, float]]]:
    """The same tags, from metrics.jsonl and eval.jsonl (their numbers: what the tracker mirrors)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path, prefix in ((run.metrics, ""), (run.eval, "eval/")):
        for row in read_jsonl(path) if path.exists() else []:
            for k, v in row.items():
                if k != "iteration" and isinstance(v, int | float):
                    out.setdefault(prefix + k, []).append((row["iteration"], v))
    return out


def test_a_resume_drops_from_tensorboard_what_the_run_cut_short_logged_past_its_checkpoint(tmp_path):
    """Cut short after iterations 0-4 (and the evaluation before 4), its checkpoint at 3; resumed there, stopped
    again after iteration 3: TensorBoard shows what the JSONL holds, each step once, the resume's values."""
    run = RunDir(tmp_path / "run")
    run.create({})
    cfg = LogConfig(tensorboard=True, wandb="off")
    tracker = Tracker(run, cfg, {})
    for it in range(5):
        if it == 4:
            tracker.log_eval({"iteration": it, "success": 0.5})
        tracker.log({"iteration": it, "rollout/reward": float(it)})
    tracker.close()
    # TensorBoard reads a run's event files in the order of their names, which begin with the second each was opened
    time.sleep(1.05 - time.time() % 1)

    run.truncate_logs(3)
    tracker = Tracker(run, cfg, {})
    tracker.resume(3)
    tracker.log({"iteration": 3, "rollout/reward": 13.0})
    tracker.close()
    assert (
        tensorboard_scalars(run) == jsonl_scalars(run) == {"rollout/reward": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0)]}
    )


def groups(iteration: int) -> list[Group]:
    """One group of two trajectories, each the same size."""
    trajectories = [
        Trajectory(
            episode_id=f"e{iteration}-{i}",
            group_id=f"g{iteration}",
            task_id="t",
            sampling=SamplingParams(),
            token_ids=[1] * 200,
            versions=[iteration] * 200,
        )
        for i in range(2)
    ]
    return [Group(group_id=f"g{iteration}", task_id="t", trajectories=trajectories)]


def save(run: RunDir, cfg: LogConfig, iterations: range) -> None:
    tracker = Tracker(run, cfg, {})
    for it in iterations:
        tracker.save_trajectories(it, tracker.to_save(groups(it)), {})


def saved(run: RunDir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run.trajectories.iterdir())}


def test_a_resume_leaves_no_trajectory_file_of_the_iterations_it_redoes(tmp_path):
    """Cut short after saving iterations 0-4, its checkpoint at 3: the resume removes the files of 3 and 4 with their
    index lines, so it saves what the run saves uninterrupted (log.max_trajectory_mb counts the files on disk: left,
    those two would have used up the budget of 4.5 iterations' files, and stayed, out of the index)."""
    probe = RunDir(tmp_path / "probe")
    save(probe, LogConfig(tensorboard=False, wandb="off"), range(1))
    iteration_bytes = sum(len(b) for b in saved(probe).values())
    cfg = LogConfig(tensorboard=False, wandb="off", max_trajectory_mb=4.5 * iteration_bytes / 2**20)
    whole, cut = RunDir(tmp_path / "whole"), RunDir(tmp_path / "cut")
    for run in whole, cut:
        run.create({})
    save(whole, cfg, range(7))
    save(cut, cfg, range(5))

    cut.truncate_logs(3)
    assert sorted(saved(cut)) == ["index.jsonl", "iter-00000.jsonl", "iter-00001.jsonl", "iter-00002.jsonl"]
    page = Folder(cut.path).trajectories(Filters())
    assert page["total"] == 6 and not page["warnings"]
    index = read_jsonl(cut.trajectories / "index.jsonl")
    assert [read_trajectory(cut.trajectories, e)["episode_id"] for e in index] == [e["episode_id"] for e in index]

    save(cut, cfg, range(3, 7))
    assert saved(cut) == saved(whole)
    assert {e["iteration"] for e in read_jsonl(whole.trajectories / "index.jsonl")} == {0, 1, 2, 3, 4}
