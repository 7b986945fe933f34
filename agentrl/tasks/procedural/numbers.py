"""The numbers family: `compute(n: int) -> int`, one integer step per level (from level 2, if/otherwise too)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from agentrl.tasks.procedural.steps import (
    _RANDOM_INPUTS,
    _add_text,
    _atom,
    _Fn,
    _pipeline,
    _Program,
    _signed,
    _Step,
)


def _n_affine(r: random.Random) -> _Step:
    k = r.choice([-3, -2, 2, 3, 5, 7])
    c = r.choice([i for i in range(-20, 21) if i])
    return r.choice(
        [
            _Step(f"Multiply it by {k}.", f"{{v}} * {k}", lambda n: n * k),
            _Step(f"{_add_text(c).capitalize()}.", f"{{v}}{_signed(c)}", lambda n: n + c),
            _Step("Square it.", "{v} * {v}", lambda n: n**2),
            _Step("Replace it by its absolute value.", "abs({v})", lambda n: n if n >= 0 else -n),
            _Step(f"Replace it by the larger of it and {c}.", f"max({{v}}, {c})", lambda n: n if n > c else c),
        ]
    )


def _n_digits(r: random.Random) -> _Step:
    return r.choice(
        [
            _Step(
                "Replace it by the sum of the decimal digits of its absolute value.",
                "sum(int(d) for d in str(abs({v})))",
                lambda n: sum(map(int, str(abs(n)))),
                near_misses=(lambda n: sum(map(int, str(abs(n)))) * (1 if n >= 0 else -1),),
                misreadings=("sum(int(d) for d in str(abs({v}))) * (1 if {v} >= 0 else -1)",),
            ),
            _Step(
                "Replace it by the number written with the decimal digits of its absolute value in reverse order "
                "(-120 becomes 21).",
                "int(str(abs({v}))[::-1])",
                lambda n: int("".join(reversed(str(abs(n))))),
                near_misses=(lambda n: int(str(abs(n))[::-1]) * (1 if n >= 0 else -1),),
                misreadings=("int(str(abs({v}))[::-1]) * (1 if {v} >= 0 else -1)",),
            ),
            _Step(
                "Replace it by the number of decimal digits of its absolute value (0 has 1 digit).",
                "len(str(abs({v})))",
                lambda n: len(str(n).lstrip("-")),
                near_misses=(lambda n: len(str(n)),),
                misreadings=("len(str({v}))",),
            ),
            _Step(
                "Replace it by the number of 1 bits in the binary form of its absolute value.",
                "bin(abs({v})).count('1')",
                lambda n: abs(n).bit_count(),
            ),
        ]
    )


def _n_divide(r: random.Random) -> _Step:
    m = r.randint(2, 12)
    d = r.randint(2, 5)
    return r.choice(
        [
            _Step(
                f"Replace it by its remainder modulo {m}, a number from 0 to {m - 1} "
                f"(for negative numbers too: -1 becomes {m - 1}).",
                f"{{v}} % {m}",
                lambda n: n - m * (n // m),
                near_misses=(lambda n: n - m * int(n / m),),
                misreadings=(f"{{v}} - {m} * int({{v}} / {m})",),
            ),
            _Step(
                f"Divide it by {d}, rounding down towards minus infinity (-7 becomes {-7 // d}).",
                f"{{v}} // {d}",
                lambda n: (n - n % d) // d,
                near_misses=(lambda n: int(n / d),),
                misreadings=(f"int({{v}} / {d})",),
            ),
        ]
    )


def _n_branch_op(r: random.Random) -> tuple[str, str, Callable[[int], int]]:
    """(text, code of `{v}`, fn) of a simple update, for one side of an if/otherwise."""
    k = r.choice([2, 3, 5])
    c = r.choice([i for i in range(-9, 10) if i])
    return r.choice(
        [
            ("halve it, rounding down", "{v} // 2", lambda n: n >> 1),
            ("negate it", "-{v}", lambda n: -n),
            (f"multiply it by {k}", f"{{v}} * {k}", lambda n: n * k),
            (_add_text(c), f"{{v}}{_signed(c)}", lambda n: n + c),
            (
                f"multiply it by {k} and then {'add' if c > 0 else 'subtract'} {abs(c)}",
                f"{{v}} * {k}{_signed(c)}",
                lambda n: n * k + c,
            ),
        ]
    )


def _n_branch(r: random.Random) -> _Step:
    """`If it is P, A; otherwise B.`: A alone and B alone must be told apart from it."""
    p = _atom(r)
    (a_text, a_code, a), (b_text, b_code, b) = _n_branch_op(r), _n_branch_op(r)

    def make(ok: Callable[[int], bool]) -> _Fn:
        return lambda n: a(n) if ok(n) else b(n)

    return _Step(
        f"If it is {p.text}, {a_text}; otherwise {b_text}.",
        f"{a_code} if {p.on('{v}')} else {b_code}",
        make(p.fn),
        ablations=(a, b),
        near_misses=tuple(map(make, p.near_misses)),
        misreadings=tuple(f"{a_code} if {m.replace('{x}', '{v}')} else {b_code}" for m in p.misreadings),
    )


def _draw_numbers(r: random.Random, level: int) -> tuple[_Program, list[list[Any]], int]:
    makers = [_n_affine, _n_digits, _n_divide] + ([_n_branch] if level > 1 else [])
    # Two affine steps (say, add then multiply) are as natural as any other pair.
    steps = [r.choice(makers)(r) for _ in range(level)]
    program = _pipeline("compute(n: int) -> int", "n", "to the integer n and return the result", steps)
    edges = [[0], [1], [-1], [r.choice([-100, -10, 10, 100])]]
    return program, edges + [[r.randint(-999, 999)] for _ in range(_RANDOM_INPUTS)], len(edges)
