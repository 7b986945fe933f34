"""The lists family: `process(nums: list[int]) -> list[int]`, one list step per level."""

from __future__ import annotations

import itertools
import random
from typing import Any

from agentrl.tasks.procedural.steps import (
    _RANDOM_INPUTS,
    _add_text,
    _atom,
    _pipeline,
    _pred_step,
    _Program,
    _rotation,
    _signed,
    _slice,
    _Step,
)


def _l_filter(r: random.Random) -> _Step:
    return _pred_step(
        "Keep only the elements that are {p}.",
        "[x for x in {v} if {p}]",
        lambda p: lambda xs: [x for x in xs if p(x)],
        _atom(r),
    )


def _l_map(r: random.Random) -> _Step:
    k = r.choice([-3, -2, 2, 3])
    c = r.choice([-9, -5, -3, -2, -1, 1, 2, 3, 5, 9])
    m = r.randint(3, 7)
    d = r.randint(2, 4)
    return r.choice(
        [
            _Step(f"Multiply every element by {k}.", f"[x * {k} for x in {{v}}]", lambda xs: [x * k for x in xs]),
            _Step(
                f"{_add_text(c, 'every element').capitalize()}.",
                f"[x{_signed(c)} for x in {{v}}]",
                lambda xs: [x + c for x in xs],
            ),
            _Step(
                "Replace every element by its absolute value.",
                "[abs(x) for x in {v}]",
                lambda xs: [max(x, -x) for x in xs],
            ),
            _Step("Replace every element by its square.", "[x * x for x in {v}]", lambda xs: [x**2 for x in xs]),
            _Step(
                f"Replace every element x by x mod {m}, the remainder from 0 to {m - 1} "
                f"(for negative x too: -1 becomes {m - 1}).",
                f"[x % {m} for x in {{v}}]",
                lambda xs: [x - m * (x // m) for x in xs],
                near_misses=(lambda xs: [x - m * int(x / m) for x in xs],),
                misreadings=(f"[x - {m} * int(x / {m}) for x in {{v}}]",),
            ),
            _Step(
                f"Divide every element by {d}, rounding down towards minus infinity (-7 becomes {-7 // d}).",
                f"[x // {d} for x in {{v}}]",
                lambda xs: [(x - x % d) // d for x in xs],
                near_misses=(lambda xs: [int(x / d) for x in xs],),
                misreadings=(f"[int(x / {d}) for x in {{v}}]",),
            ),
        ]
    )


def _l_clamp(r: random.Random) -> _Step:
    lo = r.randint(-5, 5)
    hi = lo + r.randint(2, 10)
    return _Step(
        f"Clamp every element into the range {lo} to {hi}: smaller values become {lo}, larger ones {hi}.",
        f"[min(max(x, {lo}), {hi}) for x in {{v}}]",
        lambda xs: [lo if x < lo else hi if x > hi else x for x in xs],
    )


def _l_order(r: random.Random) -> _Step:
    return r.choice(
        [
            _Step("Sort it in increasing order.", "sorted({v})", sorted),
            _Step("Sort it in decreasing order.", "sorted({v}, reverse=True)", lambda xs: sorted(xs)[::-1]),
            _Step(
                "Sort it by absolute value, smallest first; elements with equal absolute values keep their order.",
                "sorted({v}, key=abs)",
                lambda xs: sorted(xs, key=lambda x: x * x),
                near_misses=(sorted,),
                misreadings=("sorted({v})",),
            ),
            _Step("Reverse it.", "{v}[::-1]", lambda xs: list(reversed(xs))),
        ]
    )


def _l_dedupe(r: random.Random) -> _Step:
    def first_occurrences(xs: list[int]) -> list[int]:
        return [x for i, x in enumerate(xs) if x not in xs[:i]]

    return _Step(
        "Delete every element that already occurs earlier in the list, keeping first occurrences.",
        "list(dict.fromkeys({v}))",
        first_occurrences,
        near_misses=(lambda xs: sorted(set(xs)), lambda xs: first_occurrences(xs[::-1])[::-1]),
        misreadings=("sorted(set({v}))", "list(dict.fromkeys({v}[::-1]))[::-1]"),
    )


def _l_slice(r: random.Random) -> _Step:
    return _slice(r, "element")


def _l_sums(r: random.Random) -> _Step:
    return r.choice(
        [
            _Step(
                "Replace it by its running sums: element i becomes the sum of elements 0 to i "
                "([1, 2, 3] becomes [1, 3, 6]).",
                "[sum({v}[:i + 1]) for i in range(len({v}))]",
                lambda xs: list(itertools.accumulate(xs)),
                near_misses=(lambda xs: [sum(xs[:i]) for i in range(len(xs))],),
                misreadings=("[sum({v}[:i]) for i in range(len({v}))]",),
            ),
            _Step(
                "Replace it by the differences of neighbours: [a, b, c] becomes [b - a, c - b] "
                "(a list of fewer than 2 elements becomes []).",
                "[b - a for a, b in zip({v}, {v}[1:])]",
                lambda xs: [xs[i + 1] - xs[i] for i in range(len(xs) - 1)],
                near_misses=(lambda xs: [xs[i] - xs[i + 1] for i in range(len(xs) - 1)],),
                misreadings=("[a - b for a, b in zip({v}, {v}[1:])]",),
            ),
        ]
    )


def _l_rotate(r: random.Random) -> _Step:
    return _rotation(r, "element", "list")


def _l_drop_max(r: random.Random) -> _Step:
    return _Step(
        "Delete every occurrence of its largest element (an empty list stays empty).",
        "[x for x in {v} if x != max({v})]",
        lambda xs: [x for x in xs if x < max(xs)],
        near_misses=(lambda xs: sorted(xs)[:-1] if xs else xs,),
        misreadings=("sorted({v})[:-1] if {v} else {v}",),
    )


_LIST_STEPS = (_l_filter, _l_map, _l_clamp, _l_order, _l_dedupe, _l_slice, _l_sums, _l_rotate, _l_drop_max)


def _int_lists(r: random.Random) -> tuple[list[list[Any]], int]:
    """Edge cases (empty, one element, duplicates), then random lists of -10..20; and the edge count."""
    x, y = r.randint(-10, 20), r.randint(-10, 20)
    edges: list[list[Any]] = [[[]], [[x]], [[y, x, x, y]]]
    randoms = [[[r.randint(-10, 20) for _ in range(r.randint(2, 10))]] for _ in range(_RANDOM_INPUTS)]
    return edges + randoms, len(edges)


def _draw_lists(r: random.Random, level: int) -> tuple[_Program, list[list[Any]], int]:
    steps = [make(r) for make in r.sample(_LIST_STEPS, level)]
    program = _pipeline(
        "process(nums: list[int]) -> list[int]", "nums", "to the list nums and return the result", steps
    )
    return program, *_int_lists(r)
