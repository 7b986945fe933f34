"""Demonstrations: a scripted expert's episodes, played through the real env and sandboxes."""

import contextlib
import io

import pytest

import agentrl
from agentrl.env.demos import play, record
from agentrl.env.parsers import HermesParser
from agentrl.env.tools import ToolCall
from agentrl.tasks.solutions import Expert, printing


def test_a_formatted_call_parses_back():
    call = ToolCall(name="submit", arguments={"code": 'def f(s):\n    return s + "\\n"'})
    parsed = HermesParser().parse(HermesParser().format(call))
    assert parsed.calls == [call] and not parsed.errors


@pytest.mark.docker
async def test_recorded_demonstrations_replay_to_full_reward_in_fresh_sandboxes():
    demos = [d async for d in record("code_sandbox", 6, seed=3, concurrency=3)]
    assert len(demos) == 6 and len({d.task_id for d in demos}) == 6
    styles = {sum(m["role"] == "assistant" for m in d.messages) for d in demos}
    assert styles == {1, 2}, "both styles: submit at once, and run the examples first"
    for d in demos:
        assert [m["role"] for m in d.messages[:3]] == ["system", "user", "assistant"]
        if len(d.messages) > 3:  # what the env really answered to run_tests
            assert d.messages[3] == {"role": "tool", "content": "2/2 example tests passed."}
    env = agentrl.make("code_sandbox")  # fresh, never-reused sandboxes: the episodes are not an artefact of reuse
    try:
        for d in demos:
            again = await play(env, d.task_id, [m["content"] for m in d.messages if m["role"] == "assistant"])
            assert again is not None and again.messages == d.messages and again.episode_return == d.episode_return
    finally:
        await env.aclose()


@pytest.mark.docker
async def test_a_holdout_keeps_its_share_of_statements_out_of_the_demonstrations():
    demos = [d async for d in record("code_sandbox", 8, seed=5, concurrency=4, holdout=0.5)]
    held_out = agentrl.make("code_sandbox").task_set.split("test", seed=1, test_fraction=0.5)
    for d in demos:  # 8 draws all on the kept half by chance: 1 in 256
        with pytest.raises(KeyError, match="other side"):
            held_out.get(d.task_id)


@pytest.mark.docker
async def test_the_printing_habit_prints_every_result_and_earns_nothing():
    """An expert with the habit always (prints=1) submits its solution with `return` written `print`:
    the hidden tests then see None and pay nothing, and an example run shows what it printed."""
    demos = [
        d async for d in record("code_sandbox", 6, seed=3, concurrency=3, expert=Expert(prints=1.0), min_return=None)
    ]
    assert len(demos) == 6
    tasks = agentrl.make("code_sandbox").task_set
    for d in demos:
        task = tasks.get(d.task_id)
        code = HermesParser().parse(d.messages[-1]["content"]).calls[0].arguments["code"]
        assert code == printing(tasks.reference_solution(task)) and "return" not in code and "print(" in code
        assert d.episode_return == 0.0
        if len(d.messages) > 3:
            assert d.messages[3]["content"].startswith("0/2 example tests passed.")
            assert "your code printed:" in d.messages[3]["content"]


def test_printing_keeps_the_value_and_the_layout():
    code = (
        "def f(xs):\n"
        "    # twice, für jedes x\n"
        "    if not xs:\n"
        "        é = 0; return (é +\n"
        "                0)\n"
        "    return [\n"
        "        2 * x for x in xs]\n"
    )
    printed = printing(code)
    # the value's own parentheses become print's
    assert printed == code.replace("return (é +", "print(é +").replace("return [", "print([").replace("xs]", "xs])")
    ns: dict = {}
    exec(printed, ns)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ns["f"]([1, 2]) is None and ns["f"]([]) is None
    assert out.getvalue() == "[2, 4]\n0\n[]\n"  # no early return any more: f([]) goes on to the end


async def test_an_env_without_an_expert_says_so():
    with pytest.raises(NotImplementedError, match="ToolUseEnv has no scripted expert"):
        async for _ in record("tool_use", 1, backend="local"):
            pass
