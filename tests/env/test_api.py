"""The env contract without sandboxes: parsing, tools, dispatch, errors, registry, Gymnasium checks."""

from __future__ import annotations

import asyncio
import json

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import agentrl
from agentrl.env import FailureClass, ToolEnv, ToolEnvConfig, list_envs, tool
from agentrl.env.parsers import HermesParser, get_parser
from agentrl.env.tools import Tool, ToolArgumentError, ToolError, ToolOutput
from agentrl.tasks import ListTaskSet, Task


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# ---------------------------------------------------------------- parser


def test_hermes_parses_calls_and_keeps_the_rest():
    text = f"I will add.\n{call('add', a=1, b=2)}\nand {call('echo', s='x')}"
    p = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in p.calls] == [("add", {"a": 1, "b": 2}), ("echo", {"s": "x"})]
    assert p.errors == [] and p.content == "I will add.\n\nand"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("{not json}", "not valid JSON"),
        ('["add", 1]', 'string "name"'),
        ('{"name": "add", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "add", "arguments": "{bad"}', "not a JSON object"),
        # json.loads raises more than JSONDecodeError on these; they failed the episode as the env's own error
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"name": "add", "arguments": {"a": ' + "1" * 5000 + "}}", "4300 digits"),
        # half a surrogate pair is no character: the sandbox's executor failed on it (the episode infra_error)
        ('{"name": "add", "arguments": {"a": "\\ud800"}}', "surrogate"),
        ('{"name": "add", "arguments": "{\\"a\\": \\"\\\\udc00\\"}"}', "surrogate"),
        # Python's json reads them; a call's arguments go back out as JSON (to an OpenAI client too)
        ('{"name": "add", "arguments": {"a": NaN, "b": 1}}', "NaN is not a JSON value"),
        ('{"name": "add", "arguments": {"a": -Infinity}}', "-Infinity is not a JSON value"),
    ],
)
def test_hermes_reports_malformed_calls(body, needle):
    p = HermesParser().parse(f"<tool_call>{body}</tool_call>")
    assert p.calls == [] and len(p.errors) == 1 and needle in p.errors[0]


def test_hermes_accepts_double_encoded_arguments_and_flags_unclosed_tags():
    p = HermesParser().parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name"')
    assert p.calls[0].arguments == {"x": 1}
    assert p.errors == ["a <tool_call> was opened but never closed with </tool_call>"]


def test_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


# ---------------------------------------------------------------- tools


def scale(values: list[int], factor: float = 2.0) -> str:
    """Multiply values.

    Args:
        values: The numbers.
        factor: The multiplier.
    """
    return str([v * factor for v in values])


def test_tool_schema_comes_from_signature_and_docstring():
    fn = Tool(scale).schema["function"]
    assert fn["name"] == "scale" and fn["description"] == "Multiply values."
    assert fn["parameters"]["required"] == ["values"]
    assert fn["parameters"]["properties"]["values"] == {
        "type": "array",
        "items": {"type": "integer"},
        "description": "The numbers.",
    }
    assert fn["parameters"]["properties"]["factor"]["type"] == "number"


@pytest.mark.parametrize(
    ("arguments", "needle"),
    [
        ({}, "values: Field required"),
        ({"values": "abc"}, "values"),
        ({"values": [1], "extra": 1}, "extra"),
        # the schema's types as JSON has them, no coercion: a bool, a numeric string, a fraction-free float
        ({"values": [True]}, "values.0: Input should be a valid integer"),
        ({"values": ["3"]}, "values.0: Input should be a valid integer"),
        ({"values": [3.0]}, "values.0: Input should be a valid integer"),
        ({"values": [1], "factor": "2"}, "factor: Input should be a valid number"),
    ],
)
def test_tool_rejects_bad_arguments_with_a_readable_message(arguments, needle):
    with pytest.raises(ToolArgumentError, match=needle):
        asyncio.run(Tool(scale)(arguments))


def test_tool_validates_then_calls():
    assert asyncio.run(Tool(scale)({"values": [1, 2], "factor": 3})).content == "[3.0, 6.0]"  # an int is a number


# ---------------------------------------------------------------- a ToolEnv without a sandbox

TASKS = ListTaskSet(
    [Task(id=f"sum/{a}/{b}", prompt=f"What is {a} + {b}?", answer=str(a + b)) for a in range(5) for b in range(5)],
    name="sums",
    description="small sums",
)


class AdderConfig(ToolEnvConfig):
    tasks: str = "sums"
    split: str = "all"
    max_turns: int = 3


class Adder(ToolEnv):
    description = "sums with an add tool"
    reward_doc = "1 for the right answer"
    Config = AdderConfig

    def __init__(self, **kwargs):
        super().__init__(task_set=TASKS, **kwargs)

    async def _reset(self, task):
        return [{"role": "user", "content": task.prompt}]

    @tool
    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        return str(a + b)

    @tool
    def divide(self, a: int, b: int) -> str:
        """Divide.

        Args:
            a: numerator
            b: denominator
        """
        if b == 0:
            raise ToolError("division by zero")
        return str(a / b)

    @tool
    def answer(self, value: str) -> ToolOutput:
        """Give the final answer.

        Args:
            value: the answer
        """
        ok = float(value == self.task.answer)
        return ToolOutput(content="done", reward={"outcome": ok}, terminated=True, info={"outcome": ok})

    async def _no_call(self, text):
        return self.malformed("call a tool", role="user")


def test_tool_calls_run_in_order_and_a_terminal_call_stops_the_rest():
    env = Adder()
    env.reset(options={"task_id": "sum/2/3"})
    obs, r, term, trunc, info = env.step(call("add", a=2, b=3) + call("answer", value="5") + call("add", a=1, b=1))
    assert [m["content"] for m in obs] == ["5", "done"]
    assert (r, term, trunc) == (1.0, True, False)
    assert info["reward_breakdown"] == {"outcome": 1.0} and info["failure"] is FailureClass.OK
    env.close()


@pytest.mark.parametrize(
    ("action", "needle"),
    [
        ("<tool_call>{oops</tool_call>", "not valid JSON"),
        (call("multiply", a=1, b=2), "there is no tool 'multiply'; the tools are ['add', 'answer', 'divide']"),
        (call("add", a="one", b=2), "bad arguments for add: a:"),
        (call("add", a=1), "b: Field required"),
        ("just text", "call a tool"),
        ("<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>", "nested too deeply"),
    ],
)
def test_malformed_actions_become_observations_with_a_penalty(action, needle):
    env = Adder(malformed_penalty=-0.25)
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step(action)
    assert needle in obs[0]["content"] and needle in info["error"]
    assert r == -0.25 and info["reward_breakdown"] == {"malformed": -0.25}
    assert info["failure"] is FailureClass.AGENT and not term and not trunc
    env.close()


def test_a_tool_error_is_a_result_not_a_malformed_call():
    env = Adder()
    env.reset(seed=0)
    obs, r, *_, info = env.step(call("divide", a=1, b=0))
    assert obs == [{"role": "tool", "content": "Error: division by zero"}]
    assert r == 0.0 and info["failure"] is FailureClass.OK
    env.close()


def test_results_come_back_in_the_order_of_the_calls():
    # A chat template shows tool results by position: a malformed call's error came first, before earlier results.
    env = Adder()
    env.reset(seed=0)
    obs, r, *_ = env.step(call("add", a=2, b=3) + "<tool_call>{oops</tool_call>" + call("add", a=1, b=1))
    assert [m["content"][:31] for m in obs] == ["5", "Error: the tool call is not val", "2"]
    assert r == pytest.approx(-0.1)
    env.close()


def test_error_observations_are_cut_like_results():
    env = Adder(max_observation_chars=200)
    env.reset(seed=0)
    obs, *_ = env.step(call("x" * 50_000))  # "there is no tool 'xxx…'" came back whole: 50,000 characters
    assert len(obs[0]["content"]) < 300 and obs[0]["content"].startswith("Error: there is no tool 'xxx")
    env.close()


def test_too_many_calls_in_one_message_are_not_run():
    env = Adder(max_calls_per_turn=2, malformed_penalty=-0.1)
    env.reset(seed=0)
    obs, r, *_ = env.step(call("add", a=1, b=1) * 3)
    assert [m["content"] for m in obs] == ["2", "2", "Error: at most 2 tool calls per message; add was not run"]
    assert r == pytest.approx(-0.1)
    env.close()


def test_turn_limit_truncates():
    env = Adder(max_turns=2)
    env.reset(seed=0)
    assert env.step(call("add", a=1, b=1))[2:4] == (False, False)
    assert env.step(call("add", a=1, b=1))[2:4] == (False, True)
    with pytest.raises(gymnasium.error.ResetNeeded):
        env.step(call("add", a=1, b=1))
    env.close()


def test_step_before_reset_and_non_text_actions_are_refused():
    env = Adder()
    with pytest.raises(gymnasium.error.ResetNeeded):
        env.step("hi")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="str"):
        env.step(42)
    env.close()
    env.close()  # twice is fine


def test_reset_is_deterministic_per_seed_and_options_pick_a_task():
    env = Adder()
    ids = [env.reset(seed=s)[1]["task_id"] for s in (1, 2, 1)]
    assert ids[0] == ids[2]
    assert len({env.reset(seed=s)[1]["task_id"] for s in range(20)}) > 5
    obs, info = env.reset(options={"task_id": "sum/4/4"})
    assert obs == [{"role": "user", "content": "What is 4 + 4?"}] and info["task_id"] == "sum/4/4"
    assert [t["function"]["name"] for t in info["tools"]] == ["add", "answer", "divide"]
    env.close()


def test_bad_settings_are_rejected_with_the_valid_keys():
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['max_turn'\]; valid settings: .*'max_turns'"):
        Adder(max_turn=3)
    with pytest.raises(ValueError, match="max_turns"):
        Adder(max_turns=0)


async def test_sync_methods_refuse_to_run_inside_an_event_loop():
    env = Adder()
    with pytest.raises(RuntimeError, match=r"await env\.areset"):
        env.reset(seed=0)
    _, info = await env.areset(seed=0)  # the async API is the one to use here
    assert info["task_id"].startswith("sum/")
    await env.aclose()


def test_gymnasium_check_env_passes():
    check_env(Adder(), skip_render_check=True)


# ---------------------------------------------------------------- registry


def test_register_and_make_through_gymnasium():
    eid = agentrl.register("adder_test", entry_point=Adder, max_turns=2)
    assert eid == "agentrl/adder_test-v0"
    env = gymnasium.make(eid)
    assert env.unwrapped.cfg.max_turns == 2
    env.close()
    env = agentrl.make("adder_test", max_turns=3)
    assert isinstance(env, Adder) and env.cfg.max_turns == 3
    env.close()
    listed = {e.name: e for e in list_envs()}
    assert listed["adder_test"].source == "registered at runtime"
    assert {"code_sandbox", "tool_use", "humaneval"} <= listed.keys()


def test_unknown_env_suggests_the_close_name_and_names_them_all():
    with pytest.raises(gymnasium.error.NameNotFound, match="Did you mean: `code_sandbox`"):
        agentrl.make("code_sandbx")
    with pytest.raises(
        gymnasium.error.NameNotFound, match=r"The agentrl envs: .*code_sandbox, .*humaneval, .*tool_use"
    ):
        agentrl.make("nope")  # no close name: Gymnasium's message named none


def test_an_env_that_fails_to_import_is_named_and_the_others_still_list():
    agentrl.register("broken_test", entry_point="agentrl_no_such_module.env:Env")
    listed = {e.name: e for e in list_envs()}
    assert "No module named 'agentrl_no_such_module'" in listed["broken_test"].error
    assert listed["humaneval"].error is None
    with pytest.raises(ImportError, match=r"agentrl/broken_test-v0 .*failed to import"):
        agentrl.make("broken_test")
