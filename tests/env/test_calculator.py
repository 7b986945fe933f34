"""tool_use's calculator: whatever the agent writes is a value or a ToolError it can read, never an exception that
the env would count as its own failure (an infrastructure error, retried or masked instead of scored)."""

from fractions import Fraction

import pytest

from agentrl.env.tools import ToolError
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
    ],
)
def test_the_agent_s_bad_arithmetic_is_a_tool_error(expression, says):
    with pytest.raises(ToolError, match=says):
        calculate(expression)


def test_exact_values_still_come_out():
    assert calculate("2**70 + 1/3") == Fraction(3 * 2**70 + 1, 3)
    assert calculate("pow(3, 4, 5)") == 1 and calculate("-(2**3)") == -8
