"""benchmarks/repo_fix_bench.py --summarize-only on run folders made here: what it reads, how it times a run, and
what it says sharpening could reach."""

import json
import subprocess
import sys
from pathlib import Path

from cli import env
from repo_data import write_jsonl

from agentrl.tasks.registry import load_tasks

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "repo_fix_bench.py"


def test_summary_of_a_run_without_benchmarks_subtracts_only_the_evaluations_inside_its_elapsed_time(tmp_path):
    task, other = load_tasks("repos").split("test").ids()[:2]

    def resolved(task):
        return {"task_id": task, "turns": [{"info": {"resolved": True, "calls": []}}]}

    def gave_up(task):
        call = {"tool": "view", "status": "error", "arguments": {"path": "nowhere.py"}}
        return {"task_id": task, "turns": [{"info": {"calls": [call]}}]}

    for folder in ("before/trajectories", "after0/trajectories", "before_sampled/trajectories", "seed0"):
        (tmp_path / folder).mkdir(parents=True)
    # greedy: neither instance before RL, `task` after; of 8 samples before RL, 3 resolve `task`, none `other`
    write_jsonl(tmp_path / "before" / "trajectories" / "eval.jsonl", gave_up(task), gave_up(other))
    write_jsonl(tmp_path / "after0" / "trajectories" / "eval.jsonl", resolved(task), gave_up(other))
    write_jsonl(
        tmp_path / "before_sampled" / "trajectories" / "eval.jsonl",
        *[resolved(task)] * 3,
        *[gave_up(task)] * 5,
        *[gave_up(other)] * 8,
    )
    (tmp_path / "before_sampled" / "summary.json").write_text("{}")
    # evaluations at iterations 0 and 6 ran inside the 12 iterations' elapsed time, the one at 12 after it
    write_jsonl(
        tmp_path / "seed0" / "eval.jsonl",
        *({"iteration": i, "success_rate": r, "wall_s": 100.0} for i, r in ((0, 0.4), (6, 0.5), (12, 0.6))),
    )
    write_jsonl(
        tmp_path / "seed0" / "metrics.jsonl",
        *({"iteration": i, "time/elapsed_s": 150.0 * (i + 1) + 200.0 * (i >= 6)} for i in range(12)),
    )
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--seeds", "0", "--summarize-only", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(r.stdout)
    assert summary["failure_modes_before"]["wrong_file"] == 2
    assert summary["headroom"] == {
        "samples": 8,
        "instances": {"never": 1, "sometimes": 1, "always": 0},
        "greedy_solved": {"never": 0, "sometimes": 0, "always": 0},
        "greedy_pct": 0.0,
        "pass@8_pct": 50.0,
        "ceiling_pp": 50.0,
    }
    (run,) = summary["runs"]
    assert run["heldout_gain_pp"] == 20.0 and run["heldout_templates_curve"] == {}  # no bench.jsonl: none run
    assert run["wall_s"] == 2000 and run["wall_s_without_evaluations"] == 1800
    assert run["failure_modes_after"]["resolved"] == 1
    assert run["greedy_flips"] == {"gained": {"sometimes": 1}, "lost": {}}
