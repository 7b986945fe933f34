"""`algo.async_level` k = 1: the next batch is sampled while the learner trains on this one. No trained
token may be more than `rollout.max_staleness` versions behind (KV included), a checkpoint taken while a
rollout runs ahead resumes, Ctrl-C parks what is in flight, and a killed engine replica costs no episode."""

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from cli import agentrl, sets, start_agentrl
from ownership import our_pids

from agentrl.runs import read_jsonl

MODEL = Path(__file__).parents[1] / "data" / "run_v0" / "model"  # a tiny Qwen3-MoE with the project tokenizer
RUN = [
    "model.path=model",
    "out=run",
    "optim.lr=0.05",
    "algo.async_level=1",
    "rollout.max_staleness=1",
    "rollout.group_size=2",
    "rollout.groups_per_iteration=2",
    "rollout.num_workers=1",
    "rollout.sandboxes_per_worker=4",
    "rollout.sampling.max_tokens=24",
    "engine.replicas=2",
    "threads=1",
    "eval.tasks=0",
    "checkpoint.export_final=false",
]

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def trained_tokens_behind(run: Path) -> list[int]:
    """For every saved trajectory, how many versions its oldest generated token (KV included) was behind the
    weights that trained it: the version after its iteration's sync, minus one."""
    trained_at = {r["iteration"]: r["policy_version"] - 1 for r in read_jsonl(run / "metrics.jsonl")}
    behind = []
    for path in sorted((run / "trajectories").glob("iter-*.jsonl")):
        for line in path.read_text().splitlines():
            t = json.loads(line)
            if t["status"] != "finished":
                continue
            kv = t["kv_versions"] or t["versions"]
            oldest = min(min(v, k) for v, k in zip(t["versions"], kv, strict=True) if v >= 0)
            behind.append(trained_at[t["iteration"]] - oldest)
    return behind


def test_one_step_ahead_survives_a_killed_replica_trains_nothing_beyond_the_bound_and_resumes(tmp_path):
    """SIGKILL one engine replica while it samples: its requests go on elsewhere, it is restarted with the current
    weights, no episode fails or is retried, and the run finishes. No trained token is more than one version
    behind, and a checkpoint that holds the rollout sampled ahead resumes and trains it."""
    shutil.copytree(MODEL, tmp_path / "model")
    proc = start_agentrl(
        "train",
        "--env",
        "code_sandbox",
        *sets(*RUN, "iterations=3"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        for _ in proc.stdout:  # iteration 0 is logged: the replicas are up and sampling iteration 1 ahead
            if (tmp_path / "run" / "metrics.jsonl").exists():
                break
        ours = our_pids("ray::EngineReplica")  # not another run's on this machine
        assert len(ours) == 2, ours
        os.kill(ours[0], signal.SIGKILL)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["fleet/restarts"] == 1, rows  # (requests it held, if any, were resent: fleet/retried)
    assert sum(r["rollout/failed"] + r["rollout/retried"] for r in rows) == 0, rows

    checkpoints = tmp_path / "run" / "checkpoints"
    # the learner crashes after iteration 1's checkpoint, which holds the rollout sampled ahead for iteration 2
    shutil.rmtree(checkpoints / "iter-00003")
    saved = json.loads((checkpoints / "iter-00002" / "state.json").read_text())
    statuses = [[e["trajectory"]["status"] for e in eps] for eps in saved["controller"]["groups"].values()]
    ahead = [s for s in statuses if "running" not in s and "finished" in s]  # complete, with something to train
    agentrl("train", "--resume", "run", *sets("iterations=3"), cwd=tmp_path)

    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert all(r["train/staleness_max"] <= 1 for r in rows), [r["train/staleness_max"] for r in rows]
    behind = trained_tokens_behind(tmp_path / "run")
    assert behind and max(behind) <= 1, behind
    # the pipeline ran ahead of the learner (a rollout was complete before its update), and the resume trained it
    assert len(ahead) >= 2 and rows[2]["batch/groups"] >= len(ahead)


def test_ctrl_c_parks_the_rollouts_in_flight_and_saves(tmp_path):
    shutil.copytree(MODEL, tmp_path / "model")
    proc = start_agentrl(
        "train",
        "--env",
        "code_sandbox",
        *sets(*RUN, "iterations=50"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    for _ in proc.stdout:  # once an iteration is logged, the next rollout runs ahead of the learner
        if (tmp_path / "run" / "metrics.jsonl").exists():
            break
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out  # interrupted, checkpointed
    assert "resume with: agentrl train --resume" in out
    latest = sorted((tmp_path / "run" / "checkpoints").glob("iter-*"))[-1]
    assert json.loads((latest / "state.json").read_text())["controller"]["groups"]  # parked and queued, kept
    agentrl(
        "train",
        "--resume",
        "run",
        *sets(f"iterations={len(read_jsonl(tmp_path / 'run' / 'metrics.jsonl')) + 1}"),
        cwd=tmp_path,
    )
