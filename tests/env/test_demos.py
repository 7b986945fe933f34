"""Demonstrations: a scripted expert's episodes, played through the real env and sandboxes."""

import pytest

import agentrl
from agentrl.env.demos import play, record
from agentrl.env.parsers import HermesParser
from agentrl.env.tools import ToolCall


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


async def test_an_env_without_an_expert_says_so():
    with pytest.raises(NotImplementedError, match="ToolUseEnv has no scripted expert"):
        async for _ in record("tool_use", 1, sandbox="local"):
            pass
