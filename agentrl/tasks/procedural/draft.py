"""Drafts: a program drawn from its family and the cases that test it.

Tests are chosen to be strict: besides the right function, a draft knows wrong ones, each
step left out (or a compound condition cut to one half) and plausible misreadings (rotating
right for left, truncating for floor division). A draft is redrawn unless some test input
tells every left-out variant apart, so no step of a statement is idle; hidden cases are
picked to tell apart every wrong function that any input can, then edge cases, then inputs
with varied expected values.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.tasks.procedural.counting import _draw_counting
from agentrl.tasks.procedural.lists import _draw_lists
from agentrl.tasks.procedural.numbers import _draw_numbers
from agentrl.tasks.procedural.sequences import _draw_sequences
from agentrl.tasks.procedural.steps import _Fn, _Program
from agentrl.tasks.procedural.strings import _draw_strings

MAX_CASES = 20
"""n_hidden + n_public at most: the sequences family has 25 distinct inputs"""
_MAX_DRAWS = 200
"""drafts tried per task before giving up (an internal error: a few redraws are typical)"""


_FAMILIES: dict[str, Callable[[random.Random, int], tuple[_Program, list[list[Any]], int]]] = {
    "strings": _draw_strings,
    "lists": _draw_lists,
    "numbers": _draw_numbers,
    "counting": _draw_counting,
    "sequences": _draw_sequences,
}


@dataclass(frozen=True)
class _Case:
    index: int
    """position in the draft's inputs (edge cases first)"""
    args: list[Any]
    expected: Any
    kills: frozenset[int]
    """the wrong functions (indices into ablations + near misses) this case tells apart"""
    edge: bool


def _small(v: Any) -> bool:
    """Short enough to show in a prompt."""
    if isinstance(v, int):
        return abs(v) < 10**12
    if isinstance(v, str):
        return len(v) <= 100
    return len(v) <= 30 and all(_small(x) for x in v)


def _differs(wrong: _Fn, args: list[Any], expected: Any) -> bool:
    try:
        return wrong(*args) != expected
    except Exception:  # a wrong function may fail where the right one does not
        return True


def _evaluate(program: _Program, inputs: list[list[Any]], n_edges: int) -> list[_Case] | None:
    """The distinct inputs as cases; None when the draft is unfit (see the module docstring)."""
    wrongs = program.ablations + program.near_misses
    seen: set[str] = set()
    cases = []
    for i, args in enumerate(inputs):
        key = json.dumps(args)
        if key in seen:
            continue
        seen.add(key)
        expected = program.fn(*args)
        if not _small(expected):
            return None
        kills = frozenset(j for j, w in enumerate(wrongs) if _differs(w, args, expected))
        cases.append(_Case(i, args, expected, kills, i < n_edges))
    told_apart = frozenset().union(*(c.kills for c in cases))
    commonest = Counter(json.dumps(c.expected) for c in cases).most_common(1)[0][1]
    # An idle step, a value most inputs share (a constant would pass most tests), or too few inputs.
    if not told_apart >= set(range(len(program.ablations))) or commonest > len(cases) / 2 or len(cases) < MAX_CASES:
        return None
    return cases


def _draft(family: str, level: int, rng: random.Random) -> tuple[_Program, list[_Case]]:
    for _ in range(_MAX_DRAWS):
        program, inputs, n_edges = _FAMILIES[family](rng, level)
        cases = _evaluate(program, inputs, n_edges)
        if cases is not None:
            return program, cases
    raise AssertionError(f"no fit {family} task of level {level} in {_MAX_DRAWS} draws")


def _spread(cases: Sequence[_Case], k: int) -> list[_Case]:
    """k cases taking each expected value in turn, so that few share one."""
    groups: dict[str, list[_Case]] = {}
    for c in cases:
        groups.setdefault(json.dumps(c.expected), []).append(c)
    turns = itertools.chain.from_iterable(itertools.zip_longest(*groups.values()))
    return [c for c in turns if c is not None][:k]


def _choose(cases: list[_Case], n_hidden: int, n_public: int) -> tuple[list[_Case], list[_Case]]:
    """(hidden, public): hidden first tells apart every wrong function it can (greedy set cover)."""
    hidden: list[_Case] = []
    rest = list(cases)
    open_ = frozenset().union(*(c.kills for c in cases))
    while open_ and len(hidden) < n_hidden:
        best = max(rest, key=lambda c: len(c.kills & open_))
        hidden.append(best)
        rest.remove(best)
        open_ -= best.kills
    # Examples: ordinary inputs with non-empty, varied answers, that tell many wrong functions apart.
    shown = sorted((c for c in rest if not c.edge), key=lambda c: (not c.expected and c.expected != 0, -len(c.kills)))
    public = _spread(shown, n_public)
    rest = [c for c in rest if c not in public]
    hidden += [c for c in rest if c.edge][: n_hidden - len(hidden)]
    # Then the rarest expected value so far, so that no constant passes most cases.
    counts = Counter(json.dumps(c.expected) for c in hidden)
    rest = [c for c in rest if not c.edge]
    while len(hidden) < n_hidden:
        best = min(rest, key=lambda c: counts[json.dumps(c.expected)])
        hidden.append(best)
        rest.remove(best)
        counts[json.dumps(best.expected)] += 1
    return sorted(hidden, key=lambda c: c.index), public
