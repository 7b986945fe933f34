"""The built-in environments against real Docker sandboxes."""

from __future__ import annotations

import asyncio
import json
import time

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import agentrl
from agentrl.env import FailureClass, SandboxSource
from agentrl.sandbox import DockerSandbox, SandboxPool, reaper

pytestmark = pytest.mark.docker


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize("name", ["code_sandbox", "tool_use", "humaneval"])
def test_gymnasium_check_env(name, sandbox_image):
    env = gymnasium.make(f"agentrl/{name}-v0")
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


@pytest.fixture
async def source(sandbox_image):
    pool = SandboxPool(DockerSandbox.create, size=2)
    yield SandboxSource(pool)
    await pool.close()


async def test_code_sandbox_episode_run_test_submit(source):
    env = agentrl.make("code_sandbox", sandboxes=source, max_turns=5)
    obs, info = await env.areset(seed=3)
    assert [m["role"] for m in obs] == ["system", "user"] and info["task_id"].startswith("procedural/")
    assert {t["function"]["name"] for t in info["tools"]} == {"run_python", "run_tests", "submit"}
    solution = env.task_set.reference_solution(env.task)

    obs, r, term, trunc, info = await env.astep(call("run_python", code="print(6 * 7)"))
    assert obs == [{"role": "tool", "content": "exit code 0\nstdout:\n42\n"}] and r == 0.0
    assert env.sandbox_s > 0
    # the step's record of its calls (what `agentrl view` shows): the parsed call and its sandbox run
    (rec,) = info["calls"]
    assert rec["tool"] == "run_python" and rec["arguments"] == {"code": "print(6 * 7)"} and rec["status"] == "ok"
    assert rec["run"]["status"] == "ok" and rec["run"]["exit_code"] == 0 and rec["run"]["stdout"] == "42\n"
    obs, r, term, trunc, info = await env.astep(call("run_python", code="import sys; sys.exit(3)") + call("nope"))
    ran, bad = info["calls"]
    assert ran["run"]["exit_code"] == 3 and (bad["tool"], bad["status"]) == ("nope", "malformed")

    obs, r, term, trunc, info = await env.astep(call("run_tests", code=solution))
    assert obs[0]["content"].startswith("2/2 example tests passed")
    assert info["reward_breakdown"] == {"public_tests": pytest.approx(0.1)}
    obs, r, *_ = await env.astep(call("run_tests", code=solution))
    assert r == 0.0  # shaping pays once per example
    assert obs[-1] == {"role": "user", "content": "One turn left: submit your solution now."}

    obs, r, term, trunc, info = await env.astep(call("submit", code=solution))
    assert (r, term, trunc) == (1.0, True, False)
    assert info["outcome"] == 1.0 and info["tests_passed"] == info["tests_total"] == 10
    await env.aclose()


async def test_code_sandbox_partial_outcome_code_block_submit_and_truncation(source):
    env = agentrl.make("code_sandbox", sandboxes=source, max_turns=2)
    await env.areset(seed=5)
    entry = env.task.tests.entry_point
    wrong = f"def {entry}(*args):\n    return None\n"
    obs, r, term, trunc, info = await env.astep(f"Here it is:\n```python\n{wrong}```")
    assert term and r == 0.0 and info["outcome"] == 0.0 and obs[0]["content"].startswith("0/10 tests passed")

    await env.areset(seed=5)
    assert (await env.astep("I am thinking."))[4]["failure"] is FailureClass.AGENT
    obs, r, term, trunc, info = await env.astep(call("run_python", code="1"))
    assert (term, trunc) == (False, True) and "outcome" not in info
    await env.aclose()


async def test_code_sandbox_persistent_interpreter(source):
    env = agentrl.make("code_sandbox", sandboxes=source, persistent=True)
    await env.areset(seed=0)
    await env.astep(call("run_python", code="x = 41"))
    obs, *_ = await env.astep(call("run_python", code="x + 1"))
    assert obs[0]["content"] == "exit code 0\nstdout:\n42\n"
    await env.aclose()


async def test_a_dead_sandbox_fails_the_episode_not_the_run(source, docker_client):
    env = agentrl.make("code_sandbox", sandboxes=source)
    await env.areset(seed=1)
    await env.astep(call("run_python", code="print(1)"))
    docker_client.containers.get((await env.sandbox()).container.id).kill()
    _, r, term, trunc, info = await env.astep(call("submit", code=env.task_set.reference_solution(env.task)))
    assert info["failure"] is FailureClass.INFRA and "sandbox failed" in info["error"]
    assert (r, term, trunc) == (0.0, False, True)  # cut from outside, not scored
    await env.areset(seed=1)  # the next episode gets a fresh sandbox
    _obs, r, term, *_ = await env.astep(call("submit", code=env.task_set.reference_solution(env.task)))
    assert (r, term) == (1.0, True)
    await env.aclose()


async def test_tool_use_calculator_python_and_exact_answers(source):
    env = agentrl.make("tool_use", sandboxes=source)
    _, info = await env.areset(seed=2)
    assert {t["function"]["name"] for t in info["tools"]} == {"calculator", "python"}
    answer = env.task.answer
    obs, *_ = await env.astep(call("python", code=f"print({answer!r})"))
    assert answer in obs[0]["content"]
    obs, *_ = await env.astep(call("calculator", expression="2**70 + 1/3"))
    assert obs[0]["content"] == f"{3 * 2**70 + 1}/3"
    obs, r, term, _trunc, info = await env.astep(f"The answer is <answer> {answer} </answer>")
    assert (r, term, info["outcome"]) == (1.0, True, 1.0)
    await env.areset(seed=2)
    assert (await env.astep("<answer>not it</answer>"))[1] == 0.0
    await env.aclose()


async def test_humaneval_single_and_multi_turn(source):
    env = agentrl.make("humaneval", sandboxes=source)
    await env.areset(options={"task_id": "HumanEval/2"})
    body = env.task.metadata["canonical_solution"]
    _, r, term, *_ = await env.astep(body)  # a completion of the prompt
    assert (r, term) == (1.0, True)
    env = agentrl.make("humaneval", sandboxes=source, max_turns=2)
    await env.areset(options={"task_id": "HumanEval/2"})
    obs, r, term, trunc, _info = await env.astep("```python\ndef truncate_number(number):\n    return number\n```")
    assert (r, term, trunc) == (0.0, False, False) and obs[0]["content"].startswith("0/1 tests passed")
    obs, r, term, *_ = await env.astep(f"```python\ndef truncate_number(number: float) -> float:\n{body}```")
    assert (r, term) == (1.0, True)
    await env.aclose()


def _labelled(docker_client) -> set[str]:
    filters = {"label": f"{reaper.SESSION_LABEL}={reaper.SESSION_ID}"}
    return {c["Id"] for c in docker_client.api.containers(all=True, filters=filters)}


@pytest.mark.slow  # the fast tier stops envs and their pools one at a time below
async def test_one_hundred_concurrent_episodes_leave_no_container(sandbox_image, docker_client):
    before = _labelled(docker_client)

    async def episode(i: int, source: SandboxSource) -> tuple[float, float]:
        env = agentrl.make("code_sandbox", sandboxes=source)
        await env.areset(seed=i)
        t0 = time.perf_counter()
        _, _, _, _, info = await env.astep(call("run_python", code="print(sum(range(10)))"))
        overhead = time.perf_counter() - t0 - env.sandbox_s
        _, r, term, _, info = await env.astep(call("submit", code=env.task_set.reference_solution(env.task)))
        assert info["failure"] is FailureClass.OK and term, info
        await env.aclose()
        return r, overhead

    pool = SandboxPool(DockerSandbox.create, size=8)
    try:
        results = await asyncio.gather(*(episode(i, SandboxSource(pool)) for i in range(100)))
    finally:
        await pool.close()
    assert [r for r, _ in results] == [1.0] * 100
    assert _labelled(docker_client) - before == set()


@pytest.mark.parametrize("tasks", ["humaneval", "mbpp"])
async def test_code_sandbox_is_driven_by_any_code_task_set(source, tasks):
    from pathlib import Path

    if tasks == "mbpp":
        tasks = f"mbpp:{Path(__file__).parent.parent / 'tasks' / 'data' / 'mbpp_sample.jsonl'}"
    env = agentrl.make("code_sandbox", sandboxes=source, tasks=tasks, split="all")
    _, info = await env.areset(seed=0)
    _, r, term, _, info = await env.astep(call("submit", code=env.task_set.reference_solution(env.task)))
    assert (r, term, info["failure"]) == (1.0, True, FailureClass.OK)
    await env.aclose()


def test_code_sandbox_refuses_question_tasks():
    env = agentrl.make("code_sandbox", tasks="arithmetic")
    with pytest.raises(ValueError, match="needs function-level code tasks"):
        env.reset(seed=0)
    env.close()


@pytest.mark.parametrize("keep_open", [False, True])
async def test_an_owned_pool_stops_with_its_last_env_unless_kept_open(sandbox_image, keep_open):
    """Env workers keep their pool warm across episodes; an ad-hoc source frees it with its last env."""
    source = SandboxSource(size=1, keep_open=keep_open)
    for episode in range(2):
        env = agentrl.make("code_sandbox", sandboxes=source, max_turns=3)
        await env.areset(seed=episode)
        obs, *_ = await env.astep(call("run_python", code="print(6 * 7)"))
        assert "42" in obs[0]["content"]
        pool = source.pool
        await env.aclose()
        assert pool._closed is not keep_open
    await source.close()
    assert source.pool._closed and not source.pool._idle
