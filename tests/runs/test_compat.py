"""Folders written by an earlier agentrl (tests/data/run_v0, made at commit 2d4a9b5: see its README) still
open in `agentrl view` and still resume with `agentrl train --resume`."""

import errno
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli import agentrl
from pydantic import BaseModel

from agentrl.runs import JsonlTail, RunDir, append_jsonl, read_jsonl, write_trajectories
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


def test_a_line_appended_after_a_torn_one_is_kept(tmp_path):
    """A killed writer's torn last line: the next row (a resume without a checkpoint appends to it) starts on its
    own line instead of being glued to the torn one and lost with it."""
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"iteration": 0})
    with open(path, "a") as f:
        f.write('{"iteration": 1, "rollout/rew')
    append_jsonl(path, {"iteration": 0, "again": True})
    assert read_jsonl(path) == [{"iteration": 0}, {"iteration": 0, "again": True}]
    # the trajectory index too: its first new line was glued to the torn one, and that trajectory went unlisted
    folder = tmp_path / "trajectories"
    write_trajectories(folder, "iter-00000.jsonl", [_Saved(episode_id="a")], 0, {})
    with open(folder / "index.jsonl", "a") as f:
        f.write('{"iteration": 1, "episode_id": "b", "gr')
    write_trajectories(folder, "iter-00001.jsonl", [_Saved(episode_id="c"), _Saved(episode_id="d")], 1, {})
    assert [r["episode_id"] for r in read_jsonl(folder / "index.jsonl")] == ["a", "c", "d"]


class _Saved(BaseModel):
    """The fields of a rollout trajectory that a saved one's index line reads."""

    episode_id: str
    group_id: str = "g"
    task_id: str = "t"
    outcome_reward: float = 1.0
    status: str = "done"
    failure: str = "ok"
    turns: list[dict] = []
    versions: list[int] = [0]
    token_ids: list[int] = [1]
    truncated: bool = False
    truncation: str | None = None
    error: str | None = None


def test_a_viewer_open_across_a_resume_reads_the_rewritten_logs(tmp_path):
    """The resume rewrites metrics.jsonl without its later rows and the run appends anew: a tail that read the old
    file went on from its old offset (the old row kept, a torn piece of the new one reported unreadable)."""
    run = RunDir(tmp_path)
    for i in range(3):
        append_jsonl(run.metrics, {"iteration": i, "reward": 0.1})
    tail = JsonlTail(run.metrics)
    assert len(tail.rows()) == 3
    run.truncate_logs(2)
    append_jsonl(run.metrics, {"iteration": 2, "reward": 0.123456789})
    append_jsonl(run.metrics, {"iteration": 3, "reward": 0.5})
    assert [r["reward"] for r in tail.rows()] == [0.1, 0.1, 0.123456789, 0.5] and not tail.warnings


def test_a_resume_cut_short_while_rewriting_the_logs_keeps_them(tmp_path):
    """truncate_logs rewrote metrics.jsonl in place: a write cut short (here the file size limit, as a full disk)
    left a part of the history, and the next resume read that."""
    run = RunDir(tmp_path)
    for i in range(200):
        append_jsonl(run.metrics, {"iteration": i, "pad": "x" * 100})
    code = (
        "import resource, signal, sys\n"
        "from agentrl.runs import RunDir\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    RunDir(sys.argv[1]).truncate_logs(150)\n"
        "except OSError as e:\n"
        "    print(e.errno)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == str(errno.EFBIG), r.stderr
    assert len(read_jsonl(run.metrics)) == 200
