"""`agentrl train` end to end: the embedded default policy, real Docker sandboxes, real Ray, GSPO-token."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import docker
import pytest
from cli import agentrl, sets, start_agentrl
from ownership import our_containers, our_pids, still_running
from short_run import SMALL
from test_loop import _tiny

from agentrl.runs import read_jsonl
from agentrl.sandbox import reaper
from agentrl.train.loop import train

pytestmark = pytest.mark.docker


def _logged(run: Path) -> list[dict]:
    """The iterations a running run has logged so far (read_jsonl skips a line being written)."""
    path = run / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def _wait_for(
    proc: subprocess.Popen, run: Path, what: str, done: Callable[[list[dict]], bool], timeout: float = 180
) -> None:
    """Poll the running run's metrics until `done(them)`; kill it and fail with its output if it exits first or
    `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not done(_logged(run)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} after {timeout} s (exit {proc.poll()}):\n{proc.communicate()[0][-4000:]}")
        time.sleep(0.2)


def _started_small_run(run: Path, iterations: int, cwd: Path) -> subprocess.Popen:
    """The SMALL run without held-out evaluation in the background, returned once its first iteration is logged
    (killed if it never is)."""
    settings = sets(f"iterations={iterations}", f"out={run}", *SMALL, "eval.tasks=0")
    proc = start_agentrl("train", "--env", "code_sandbox", *settings, cwd=cwd, stderr=subprocess.STDOUT)
    _wait_for(proc, run, "first iteration", bool)
    return proc


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # the fast tier trains with `agentrl train` in tests/runs/test_compat.py, in process in test_loop.py
def test_two_iterations(short_run):
    """Metrics written, policy version 2, a partial rollout carried across an iteration and trained, held-out
    evals, checkpoints, TensorBoard, saved trajectories and plots, and no library's warning. The 2-iteration run is
    the session's shared one (the viewer tests read it too): read here, never written."""
    run = short_run.folder
    metrics = rows(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1]
    assert metrics[-1]["policy_version"] == 2
    assert metrics[0]["rollout/parked"] > 0, "the first iteration ended with episodes parked"
    assert sum(m["rollout/partial_trained"] for m in metrics) >= 1, "a trajectory spanning two versions was trained"
    for key in (
        "train/loss",
        "train/clip_fraction",
        "train/mismatch_abs_logprob_diff",
        "train/expert_flip_rate",
        "rollout/reward",
        "rollout/tokens_per_s",
    ):
        assert all(key in m for m in metrics), key
    assert metrics[0]["train/mismatch_abs_logprob_diff"] < 1e-3  # the engine's lp_b are the trainer's (same weights)
    evals = rows(run / "eval.jsonl")
    assert [e["iteration"] for e in evals] == [0, 2] and all(e["scored"] == 4 for e in evals)
    assert (run / "config.yaml").exists() and (run / "final" / "config.json").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-00001", "iter-00002"]
    assert list((run / "tensorboard").iterdir()) and list((run / "trajectories").glob("iter-*.jsonl"))
    assert (run / "plots" / "heldout.png").exists() and "plots:" in short_run.stdout
    # run as a user's shell runs it (RAY_AUTH_MODE unset): no library says a word (Ray's token notice included)
    warned = [line for line in short_run.stderr.splitlines() if "warn" in line.lower()]
    assert not warned, short_run.stderr


@pytest.mark.slow  # the fast tier resumes a run too: tests/runs/test_compat.py
def test_a_resume_continues_with_the_parked_episodes(short_run, tmp_path):
    """The checkpoint is resumable: the resumed run continues at iteration 2 with the parked episodes.
    It resumes a copy of the session's shared run."""
    run = tmp_path / "run"
    shutil.copytree(short_run.folder, run)
    state = json.loads((run / "checkpoints" / "iter-00002" / "state.json").read_text())
    parked = [
        p for eps in state["controller"]["groups"].values() for p in eps if p["trajectory"]["status"] == "running"
    ]
    out = agentrl("train", "--resume", run, *sets("iterations=3", "eval.benchmarks=[]"), cwd=tmp_path, timeout=240)
    assert "resumed from" in out.stdout
    metrics = rows(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2] and metrics[-1]["policy_version"] == 3
    assert parked, "the checkpoint held parked episodes"
    assert metrics[-1]["rollout/restore_dropped"] == 0, "every parked episode's env replayed as recorded"
    assert metrics[-1]["rollout/partial_trained"] >= 1, "episodes parked before the restart were finished and trained"


# The fast tier kills containers and an env worker more cheaply (tests/rollout/test_controller.py) and interrupts
# `agentrl sandbox exec` (tests/sandbox/test_cli_and_reaper.py).
@pytest.mark.slow
def test_killed_sandboxes_and_env_worker_do_not_stop_a_run_and_ctrl_c_stops_it_after_a_checkpoint(tmp_path):
    """Mid-iteration, every sandbox container is killed and an env worker process too: the run goes on, and the
    failures are counted in its metrics (retried, never scored). Then one SIGINT: the rollouts in flight are
    parked, a checkpoint is saved, sandboxes and env workers are released, and the command says how to resume
    (exit 130: interrupted, not finished)."""
    run = tmp_path / "run"
    proc = _started_small_run(run, iterations=20, cwd=tmp_path)
    try:
        time.sleep(1.0)  # iteration 1's rollouts are running
        killed = our_containers(docker.from_env())  # this run's: another job's on the engine are not ours to kill
        for c in killed:
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                c.kill()  # one may have ended (or been recycled) since the listing
        os.kill(our_pids("ray::EnvWorker")[0], signal.SIGKILL)

        def went_on(logged: list[dict]) -> bool:  # two iterations past the kills, their failures counted
            return len(logged) >= 3 and sum(m["rollout/retried"] + m["rollout/failed"] for m in logged) >= 2

        _wait_for(proc, run, "two iterations past the kills with their retries", went_on)
        workers = our_pids("ray::EnvWorker")  # the restarted one among them
        sandboxes = {c.name for c in our_containers(docker.from_env())}
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed and proc.returncode == 130, output[-3000:]
    assert f"resume with: agentrl train --resume {run}" in output.replace("\n", "")
    done = len(rows(run / "metrics.jsonl"))
    state = json.loads((run / "checkpoints" / f"iter-{done:05d}" / "state.json").read_text())
    assert state["iteration"] == done < 20
    assert workers and not still_running(workers, "ray::EnvWorker")
    owned = {str(p) for p in workers}  # the env workers made the sandboxes; the ones listed before and any since
    left = [
        c.name
        for c in docker.from_env().containers.list(all=True, filters={"label": reaper.LABEL}, ignore_removed=True)
        if c.name in sandboxes or c.labels.get(reaper.PID_LABEL) in owned
    ]
    assert not left


@pytest.mark.slow  # 12 s: a run and its resume in process (bwrap sandboxes, env workers of the run)
async def test_a_resumed_run_estimates_the_time_left_at_its_own_pace(tmp_path, bwrap_runtime):
    """`time/left_s` (the progress line's "left") is this process's time per iteration times the iterations
    left: the time before a resume was spent on the iterations before it, not on this process's few."""
    cfg, run = _tiny(tmp_path / "run", "iterations=2", "eval.tasks=0")
    await train(cfg, run)
    cfg, run = _tiny(tmp_path / "run", "iterations=4", "eval.tasks=0")
    await train(cfg, run, resume=True)
    m = read_jsonl(run.metrics)
    assert [r["iteration"] for r in m] == [0, 1, 2, 3]
    # after iteration 2, one iteration is left, at the resumed process's pace so far (the checkpoint's elapsed
    # time is iteration 1's, as logged)
    assert m[2]["time/left_s"] == pytest.approx(m[2]["time/elapsed_s"] - m[1]["time/elapsed_s"])
