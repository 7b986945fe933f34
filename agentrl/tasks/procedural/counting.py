"""The counting family: `analyze(nums: list[int]) -> int`, list steps (the lists family's) then a count or search."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

from agentrl.tasks.procedural.lists import _int_lists, _l_dedupe, _l_filter, _l_map, _l_order, _l_slice, _l_sums
from agentrl.tasks.procedural.steps import _atom, _compound, _Fn, _pipeline, _Pred, _pred_step, _Program, _Step

_FIRST = "next((i for i, x in enumerate({v}) if {p}), -1)"
_LAST = "max((i for i, x in enumerate({v}) if {p}), default=-1)"
_COUNT = "sum(1 for x in {v} if {p})"


def _c_reduce(r: random.Random, p: _Pred | None) -> _Step:
    """A final step that returns an integer computed from the list, using the condition p if one is given."""
    t = r.randint(-4, 16)

    def run(ok: Callable[[int], bool]) -> _Fn:
        def longest(xs: list[int]) -> int:
            return max((len(list(g)) for key, g in itertools.groupby(xs, ok) if key), default=0)

        return longest

    def first(ok: Callable[[int], bool]) -> _Fn:
        return lambda xs: next((i for i, x in enumerate(xs) if ok(x)), -1)

    def last(ok: Callable[[int], bool]) -> _Fn:
        return lambda xs: max((i for i, x in enumerate(xs) if ok(x)), default=-1)

    def count(ok: Callable[[int], bool]) -> _Fn:
        return lambda xs: len([x for x in xs if ok(x)])

    with_p = [
        ("Return how many elements are {p}.", _COUNT, count, ()),
        (
            "Return the sum of the elements that are {p} (0 if there are none).",
            "sum(x for x in {v} if {p})",
            lambda ok: lambda xs: sum(filter(ok, xs)),
            (),
        ),
        (
            "Return the index (counting from 0) of the first element that is {p}, or -1 if there is none.",
            _FIRST,
            first,
            ((last, _LAST),),
        ),
        (
            "Return the index (counting from 0) of the last element that is {p}, or -1 if there is none.",
            _LAST,
            last,
            ((first, _FIRST),),
        ),
        (
            "Return the length of the longest run of consecutive elements that are all {p} (0 if there is none).",
            "max(map(len, ''.join('1' if {p} else '0' for x in {v}).split('0')))",
            run,
            ((count, _COUNT),),
        ),
    ]
    if p is not None:
        text, code, make, misreads = r.choice(with_p)
        step = _pred_step(text, code, make, p)
        return _Step(
            step.text,
            step.code,
            step.fn,
            step.ablations,
            (*step.near_misses, *(m(p.fn) for m, _ in misreads)),
            (*step.misreadings, *(c.replace("{p}", p.on("x")) for _, c in misreads)),
        )
    return r.choice(
        [
            _Step(
                "Return the number of neighbouring pairs (a, b) in the list with a < b.",
                "sum(1 for a, b in zip({v}, {v}[1:]) if a < b)",
                lambda xs: sum(xs[i] < xs[i + 1] for i in range(len(xs) - 1)),
                near_misses=(lambda xs: sum(xs[i] <= xs[i + 1] for i in range(len(xs) - 1)),),
                misreadings=("sum(1 for a, b in zip({v}, {v}[1:]) if a <= b)",),
            ),
            _Step(
                "Return how many elements are greater than every element before them (the first element counts).",
                "sum(1 for i, x in enumerate({v}) if all(y < x for y in {v}[:i]))",
                lambda xs: sum(1 for i in range(len(xs)) if xs[i] > max(xs[:i], default=xs[i] - 1)),
                near_misses=(lambda xs: sum(1 for i in range(len(xs)) if xs[i] >= max(xs[:i], default=xs[i])),),
                misreadings=("sum(1 for i, x in enumerate({v}) if all(y <= x for y in {v}[:i]))",),
            ),
            _Step(
                f"Return the number of pairs of positions i < j whose elements add up to {t}.",
                f"sum(1 for i in range(len({{v}})) for j in range(i + 1, len({{v}})) if {{v}}[i] + {{v}}[j] == {t})",
                lambda xs: sum(a + b == t for a, b in itertools.combinations(xs, 2)),
                near_misses=(lambda xs: sum(a + b == t for a in xs for b in xs),),
                misreadings=(f"sum(1 for a in {{v}} for b in {{v}} if a + b == {t})",),
            ),
            _Step(
                "Return the number of distinct values in the list.",
                "len(set({v}))",
                lambda xs: len(dict.fromkeys(xs)),
                near_misses=(lambda xs: sum(xs.count(x) == 1 for x in xs),),
                misreadings=("sum(1 for x in {v} if {v}.count(x) == 1)",),
            ),
            _Step(
                "Return the largest element minus the smallest (0 for an empty list).",
                "max({v}) - min({v}) if {v} else 0",
                lambda xs: sorted(xs)[-1] - sorted(xs)[0] if xs else 0,
            ),
        ]
    )


_COUNTING_PREP = (_l_filter, _l_map, _l_order, _l_dedupe, _l_slice, _l_sums)


def _draw_counting(r: random.Random, level: int) -> tuple[_Program, list[list[Any]], int]:
    # Level 1: one reduction; 2: a compound condition or one step before; 3: both, or two steps before.
    if level == 1:
        n_prep, compound = 0, False
    else:
        n_prep, compound = r.choice([(1, False), (0, True)] if level == 2 else [(1, True), (2, False)])
    prep = [make(r) for make in r.sample(_COUNTING_PREP, n_prep)]
    p = _compound(r) if compound else _atom(r) if r.random() < 0.7 else None
    reduce = _c_reduce(r, p)
    program = _pipeline("analyze(nums: list[int]) -> int", "nums", "to the list nums", [*prep, reduce])
    return program, *_int_lists(r)
