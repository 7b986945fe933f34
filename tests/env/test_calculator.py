"""tool_use's calculator: whatever the agent writes is a value or a ToolError it can read, never an exception that
the env would count as its own failure (an infrastructure error, retried or masked instead of scored)."""

import json
from fractions import Fraction

import pytest

import agentrl
from agentrl.env import FailureClass
from agentrl.env.tools import ToolError
from agentrl.envs import tool_use
from agentrl.envs.tool_use import calculate


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("1e999", "ValueError"),  # a float constant that is inf
        ("pow(2, 2, 0)", "3rd argument cannot be 0"),
        ("pow(2, -1, 4)", "not invertible"),
        ("2 ** (10 ** 20000)", "more than 20000 digits"),  # the bound made a float of a 20,000-digit exponent
        ("-" * 5000 + "1", "RecursionError"),
        ("1\x00+2", "null bytes"),
        ("1/0", "division by zero"),
        # one step on the env's event loop that ran past 90 s (every episode of the loop waiting on it)
        ("pow(3, 10**19999, 10**19999 + 7)", "beyond the calculator"),
    ],
)
def test_the_agent_s_bad_arithmetic_is_a_tool_error(expression, says):
    with pytest.raises(ToolError, match=says):
        calculate(expression)


def test_exact_values_still_come_out():
    assert calculate("2**70 + 1/3") == Fraction(3 * 2**70 + 1, 3)
    assert calculate("pow(3, 4, 5)") == 1 and calculate("-(2**3)") == -8


def test_a_long_computation_is_cut_at_the_time_limit(monkeypatch):
    monkeypatch.setattr(tool_use, "CALCULATOR_S", 0.05)  # 1000 quick steps take ~0.4 s: the limit cuts the whole
    with pytest.raises(ToolError, match=r"takes longer than 0\.05 s"):
        calculate("gcd(" + ",".join(["7**23000"] * 1000) + ")")


def test_a_result_too_long_to_show_is_a_tool_error_not_the_env_s():
    env = agentrl.make("tool_use")
    env.reset(seed=0)
    action = json.dumps({"name": "calculator", "arguments": {"expression": "10**5000"}})
    obs, r, term, trunc, info = env.step(f"<tool_call>{action}</tool_call>")  # str() raised: infra_error, truncated
    assert obs == [{"role": "tool", "content": "Error: the result has more than 4300 digits, too many to show"}]
    assert (r, term, trunc, info["failure"]) == (0.0, False, False, FailureClass.OK)
    env.close()
