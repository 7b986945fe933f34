"""Folders written by an earlier agentrl (tests/data/run_v0, made at commit 2d4a9b5: see its README) still
open in `agentrl view` and still resume with `agentrl train --resume`."""

import json
import re
import shutil
from pathlib import Path

import pytest
from cli import agentrl

from agentrl.runs import RunDir, read_jsonl
from agentrl.view import Filters, Folder

FIXTURE = Path(__file__).parents[1] / "data" / "run_v0"


@pytest.fixture
def old(tmp_path) -> Path:
    """A copy (the fixture itself is never written): model/, run/, eval/."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "run_v0"))


def test_an_old_run_folder_opens_in_the_viewer(old):
    folder = Folder(old / "run")
    assert folder.kind == "run" and folder.overview()["settings"]["model"]["path"] == "model"
    metrics = folder.metrics()
    assert [r["iteration"] for r in metrics["metrics"]] == [0] and len(metrics["eval"]) == 2
    assert not metrics["warnings"]
    page = folder.trajectories(Filters())
    assert page["total"] == page["matching"] == 4 and not page["warnings"]
    for item in page["items"]:
        shown = folder.trajectory(item["episode_id"])
        assert shown["episode_id"] == item["episode_id"] and shown["turns"]
        assert all(len(t["tokens"]) == len(t["logprob"]) == len(t["advantage"]) for t in shown["turns"])
        assert shown["prompt"].startswith("<|im_start|>system")
    # the index an old run wrote and the one a scan of its files would make agree
    scanned, _ = folder._scan()
    assert scanned == page["items"][::-1]


def test_an_old_eval_folder_opens_in_the_viewer(old):
    folder = Folder(old / "eval")
    assert folder.kind == "eval"
    results = folder.results()
    assert results["matching"] == 2 and {r["task_id"] for r in results["items"]} == {"HumanEval/0", "HumanEval/1"}
    page = folder.trajectories(Filters())
    assert page["total"] == 2 and set(page["verdicts"]) == {"HumanEval/0", "HumanEval/1"}
    assert folder.trajectory(page["items"][0]["episode_id"])["turns"]


@pytest.mark.docker
def test_an_old_run_resumes_and_trains_on(old):
    """One more iteration from the old checkpoint: its parked episodes are rebuilt and trained, its logs go on."""
    before = RunDir(old / "run")
    parked = json.loads((before.latest_checkpoint() / "state.json").read_text())["controller"]
    # every group in flight must finish this iteration (4 of at most 4), the old run's parked ones included
    r = agentrl(
        "train",
        "--resume",
        "run",
        "--set",
        "iterations=2",
        "--set",
        "rollout.groups_per_iteration=4",
        "--set",
        "rollout.env_workers=local",
        cwd=old,
        timeout=300,
    )
    assert "resumed from run/checkpoints/iter-00001: iteration 1, policy version 1" in r.stdout + r.stderr
    # stdout is a pipe here, as a log file: the iteration's progress is one line, however long
    assert re.search(r"^it +1 +reward .+ tok/s .+ left \d+:\d\d:\d\d$", r.stdout, re.M), r.stdout
    metrics = read_jsonl(before.metrics)
    assert [m["iteration"] for m in metrics] == [0, 1] and metrics[1]["policy_version"] == 2
    assert metrics[1]["rollout/restore_dropped"] == 0 and parked["groups"]
    assert metrics[1]["rollout/partial_trained"] > 0  # the old run's parked episodes, finished under version 1
    assert metrics[1]["rollout/groups"] == 4
    assert before.latest_checkpoint().name == "iter-00002"
    # the old run's last evaluation (after iteration 1) was logged past its checkpoint: the resume drops it
    assert [e["iteration"] for e in read_jsonl(before.eval)] == [0, 2]
    folder = Folder(before.path)
    assert folder.trajectories(Filters(iteration=1))["total"] > 4
