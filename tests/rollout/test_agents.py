"""Agent programs as environments: SDK-written agents trained through the session gateway, graded by the env."""

from __future__ import annotations

import json
from pathlib import Path

import agent_programs
import pytest
from ownership import bwrap_trees as trees
from transformers import AutoTokenizer

from agentrl.engine import EngineConfig, EngineModel, SamplingParams, build_engine
from agentrl.env.base import FailureClass
from agentrl.models.default import resolve_path
from agentrl.rollout import ChatFormat, RolloutConfig, RolloutController, Status
from agentrl.rollout.workers import task_ids
from agentrl.sandbox import SandboxConfig

TESTS = Path(__file__).parents[1]


@pytest.fixture
async def engine():
    async with build_engine(EngineConfig(), EngineModel(resolve_path("default"))) as e:
        yield e


@pytest.fixture
def chat():
    return ChatFormat(AutoTokenizer.from_pretrained(resolve_path("default")))


@pytest.fixture(autouse=True)
def workers_import_the_agents(monkeypatch, bwrap_runtime):
    """The env workers (processes of this one) register the agents by importing `agent_programs`."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def config(env: str, groups: int, **kw) -> RolloutConfig:
    return RolloutConfig(
        env=f"agent_programs:{env}",
        group_size=1,
        groups_per_iteration=groups,
        num_workers=1,
        sandboxes_per_worker=2,
        sampling=SamplingParams(max_tokens=12),
        partial=False,
        env_workers="local",
        on_infra_failure="mask",
        **kw,
    )


@pytest.mark.slow  # 29 s: the fast tier grades agent programs on their other envs in this file
async def test_agents_on_repo_fix_are_graded_by_the_env_and_their_failures_never_scored(engine, chat, bwrap_runtime):
    behaviours = ["expert", "claims", "raises", "silent", "sleeps", "rewrites"]
    tasks = task_ids("repo_fix", {"tasks": "repos"}, len(behaviours))
    agent_programs.BEHAVIOUR.update(zip(tasks, behaviours, strict=True))
    # the agents that end take under 1 s here, six at once; "sleeps" waits 60 s
    cfg = config("scripted_on_repo_fix", len(tasks), agent_timeout_s=10)
    async with RolloutController(cfg, engine, chat, sandbox=SandboxConfig(backend="bwrap")) as ctl:
        batch = await ctl.run_iteration(tasks)
        keys = [s.key for s in ctl.gateway.sessions.values()]
    by = {agent_programs.BEHAVIOUR[g.task_id]: g.trajectories[0] for g in batch.groups}
    expert, claims = by["expert"], by["claims"]
    assert expert.status is Status.FINISHED and expert.outcome_reward == 1.0  # run returned 0.0: the env graded
    assert claims.status is Status.FINISHED and claims.outcome_reward == 0.0  # run returned 1.0: no change, 0
    for t in (expert, claims):  # two calls, the second appended to the first: two turns, token-exact
        assert len(t.turns) == 2 and t.turns[-1].info["outcome"] == t.outcome_reward and t.terminated
        assert t.token_ids[: t.turns[1].start][: t.turns[0].end] == t.token_ids[: t.turns[0].end]
    assert expert.turns[-1].info["resolved"] and expert.turns[-1].info["changed_files"]
    for name, says in [
        ("raises", "RuntimeError: the agent's own bug"),
        ("silent", "never called the model"),
        ("sleeps", "ran past rollout.agent_timeout_s=10"),
    ]:
        t = by[name]
        assert t.status is Status.FAILED and t.failure is FailureClass.AGENT and says in t.error, (name, t.error)
        assert not t.trainable
    rewrites = by["rewrites"]  # two calls, the second a rewritten history: two sequences, trained
    assert (
        rewrites.status is Status.FINISHED
        and rewrites.trainable
        and [s.reason for s in rewrites.sequences] == ["rewritten"]
    )
    assert batch.stats.rewritten == 1 and batch.stats.failed == 3 and not keys  # every session closed
    assert not trees(bwrap_runtime), "no sandbox left behind"
    dumped = json.dumps([t.model_dump(mode="json") for t in batch.trajectories])
    assert "sessions/" not in dumped


async def test_an_agent_without_an_env_grades_itself(engine, chat):
    cfg = config("self_graded", 2)
    async with RolloutController(cfg, engine, chat, sandbox=SandboxConfig(backend="bwrap")) as ctl:
        batch = await ctl.run_iteration()
    assert [t.outcome_reward for t in batch.trajectories] == [0.5, 0.5]
    assert all(t.status is Status.FINISHED and len(t.turns) == 1 for t in batch.trajectories)


def test_an_env_that_cannot_host_agents_is_refused_before_anything_starts():
    import agentrl

    async def run(task, client, sandbox):
        return 1.0

    agentrl.register("agent_on_code_sandbox", agent=run, env="code_sandbox")
    with pytest.raises(ValueError, match="does not host agent programs"):
        RolloutController(RolloutConfig(env="agent_on_code_sandbox"), None, None)
    with pytest.raises(ValueError, match="give an entry point"):
        agentrl.register("neither")


@pytest.mark.slow
def test_the_example_agent_trains_two_iterations_end_to_end(tmp_path):
    from cli import agentrl, sets

    out = tmp_path / "run"
    agentrl(
        "train",
        "--env",
        "examples.mini_swe_agent:mini_swe",
        *sets(
            "iterations=2",
            "rollout.group_size=2",
            "rollout.groups_per_iteration=1",
            "rollout.max_groups_in_flight=1",
            "rollout.env_workers=local",
            "rollout.sampling.max_tokens=48",
            "sandbox.backend=bwrap",
            "eval.tasks=1",
            f"out={out}",
        ),
        cwd=TESTS.parent,
        timeout=600,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "rollout/episodes" in r] == [0, 1]
    for r in (r for r in rows if "rollout/episodes" in r):
        assert r["rollout/rewritten"] == 0 and r["rollout/failed"] == 0 and r["rollout/generated_tokens"] > 0
        assert r["policy_version"] == r["iteration"] + 1  # trained on, synced
    leaked = [p for p in out.rglob("*") if p.is_file() and b"/sessions/" in p.read_bytes()]
    assert not leaked, f"a session's address reached the run folder: {leaked}"


def test_the_readme_agent_registers_on_repo_fix():
    import subprocess
    import sys

    readme = (TESTS.parent / "README.md").read_text()
    section = readme[readme.index("### Agents written outside agentrl") :]
    block = section[section.index("```python\n") + 10 : section.index("\n```", section.index("```python"))]
    assert len([line for line in block.splitlines() if line.strip()]) <= 16
    check = block + "\nfrom agentrl.env.registry import agent_of\nprint(agent_of('mini_swe').env)\n"
    assert (
        subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout == "repo_fix\n"
    )
