"""tool_use: questions with exact answers that need a tool (exact arithmetic, long string processing)."""

from __future__ import annotations

import ast
import math
import operator
import re
import sys
import time
from fractions import Fraction

from pydantic import Field

from agentrl.env import StepResult, ToolEnv, ToolEnvConfig
from agentrl.env.base import Message
from agentrl.env.grading import check_answer
from agentrl.env.tools import ToolError, ToolOutput, tool
from agentrl.envs._format import run_output
from agentrl.tasks import Task

SYSTEM = """Answer the question exactly. You have {turns} turns and two tools:
- calculator(expression): exact arithmetic on integers and fractions;
- python(code): run Python code and read its output.
When you know the answer, reply with it in <answer></answer> tags and no tool call."""

MAX_DIGITS = 20_000  # calculator results and operands beyond this are refused (a 10**10**9 would hang the host)
# It runs on the env's event loop, beside every other episode of it: each step of a big expression is quick (under
# MAX_DIGITS), so the whole is cut at a time limit; pow(a, b, m), one step, costs about bits(b)·bits(m)² and is bounded
# by that (pow(3, 10**19999, 10**19999 + 7) ran past 90 s).
CALCULATOR_S = 2.0
MAX_POWMOD_WORK = 10**11  # ~0.2 s; the arithmetic tasks' 18-digit powmods take ~2·10**5
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ToolUseConfig(ToolEnvConfig):
    tasks: str = "arithmetic"
    max_turns: int = Field(6, ge=1)
    python_timeout_s: float = Field(10.0, gt=0)
    """wall-clock limit of one python call"""


class ToolUseEnv(ToolEnv):
    """Exact questions solved with a calculator and a Python sandbox; answers checked exactly."""

    description = "Exact-answer questions that need tools: a calculator and Python in a sandbox."
    reward_doc = (
        "outcome (on the answer): 1 if the <answer> matches exactly (whitespace trimmed), else 0; "
        "malformed: malformed_penalty per bad tool call or message with neither a call nor an answer. "
        "No answer within max_turns: truncated, no outcome."
    )
    Config = ToolUseConfig
    cfg: ToolUseConfig

    async def _reset(self, task: Task) -> list[Message]:
        if task.answer is None:
            raise ValueError(f"tool_use needs question tasks with an answer; {task.id} is a code task")
        return [
            {"role": "system", "content": SYSTEM.format(turns=self.cfg.max_turns)},
            {"role": "user", "content": task.prompt},
        ]

    @tool
    async def python(self, code: str) -> ToolOutput:
        """Run Python code in a sandbox and return its exit status and output. Print what you need to see.

        Args:
            code: Python source to run.
        """
        sandbox = await self.sandbox()
        return run_output(await self.timed(sandbox.run_python(code, timeout_s=self.cfg.python_timeout_s)))

    @tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly: integers and fractions, + - * / // % **, pow(a, b, m), abs, gcd.

        Args:
            expression: The expression, e.g. "123456789 * 987654321" or "pow(7, 128, 1000007)".
        """
        value = calculate(expression)
        try:
            return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
        except ValueError:  # Python's limit on int-to-str (4300 digits); an observation would be cut shorter anyway
            raise ToolError(
                f"the result has more than {sys.get_int_max_str_digits()} digits, too many to show"
            ) from None

    async def _no_call(self, text: str) -> StepResult:
        found = _ANSWER.findall(text)
        if not found:
            return self.malformed(
                "no tool call and no <answer></answer> found. Call a tool, or give your final answer in tags.",
                role="user",
            )
        outcome = float(check_answer(self.task, found[-1]))
        return StepResult(reward_breakdown={"outcome": outcome}, terminated=True, info={"outcome": outcome})


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expression: str) -> Fraction:
    """Exact value of an arithmetic expression, walked on its AST (never eval: it is the agent's text)."""
    try:
        return _eval(ast.parse(expression.strip(), mode="eval").body, time.monotonic() + CALCULATOR_S)
    except SyntaxError as e:
        raise ToolError(f"not an expression: {e.msg}") from None
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    # the agent's text (nested too deep, a null byte, an inf, a modulus of 0), not the env's fault
    except (ValueError, OverflowError, RecursionError, MemoryError) as e:
        raise ToolError(f"cannot compute that: {type(e).__name__}: {e}"[:300]) from None


def _eval(node: ast.AST, deadline: float) -> Fraction:
    if time.monotonic() > deadline:
        raise ToolError(f"the expression takes longer than {CALCULATOR_S} s to compute; use python")
    match node:
        case ast.Constant(value=bool()):
            raise ToolError("booleans are not numbers here")
        case ast.Constant(value=int() | float() as v):
            return _bounded(Fraction(str(v)) if isinstance(v, float) else Fraction(v))
        case ast.UnaryOp(op=ast.USub(), operand=x):
            return -_eval(x, deadline)
        case ast.UnaryOp(op=ast.UAdd(), operand=x):
            return _eval(x, deadline)
        case ast.BinOp(op=ast.Pow(), left=a, right=b):
            base, exp = _eval(a, deadline), _eval(b, deadline)
            if exp.denominator != 1:
                raise ToolError("only whole-number exponents are exact")
            # the result's digits, |exp| · log10(base), compared without making a float of a huge exponent
            if abs(exp) > MAX_DIGITS / math.log10(max(2, abs(base.numerator), base.denominator)):
                raise ToolError(f"the result would have more than {MAX_DIGITS} digits")
            return base**exp
        case ast.BinOp(op=op, left=a, right=b) if type(op) in _BINARY:
            return _bounded(_BINARY[type(op)](_eval(a, deadline), _eval(b, deadline)))
        case ast.Call(func=ast.Name(id=name), args=args, keywords=[]) if name in ("pow", "abs", "gcd"):
            vals = [_eval(a, deadline) for a in args]
            if name == "abs" and len(vals) == 1:
                return abs(vals[0])
            ints = [_integer(v, name) for v in vals]
            if name == "gcd" and len(ints) >= 1:
                return Fraction(math.gcd(*ints))
            if name == "pow" and len(ints) == 3:
                if abs(ints[1]).bit_length() * ints[2].bit_length() ** 2 > MAX_POWMOD_WORK:
                    raise ToolError("pow(a, b, m) with b and m that large is beyond the calculator; use python")
                return Fraction(pow(*ints))
            if name == "pow" and len(ints) == 2:
                return _eval(ast.BinOp(op=ast.Pow(), left=args[0], right=args[1]), deadline)
            raise ToolError(f"wrong number of arguments to {name}")
    raise ToolError(f"unsupported in the calculator: {ast.unparse(node)!r} (use python for anything beyond arithmetic)")


def _integer(v: Fraction, fn: str) -> int:
    if v.denominator != 1:
        raise ToolError(f"{fn} takes integers")
    return v.numerator


def _bounded(v: Fraction) -> Fraction:
    if max(v.numerator.bit_length(), v.denominator.bit_length()) > MAX_DIGITS * 3.33:
        raise ToolError(f"the result would have more than {MAX_DIGITS} digits")
    return v
