"""The sequences family: `term(n: int) -> int`, the n-th term of a linear recurrence (its order grows by level)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.tasks.procedural.steps import _Program


def _term(coef: int, what: str, style: str) -> str:
    """One term, e.g. `3*a(i-1)` (text) or `3 * a[i - 1]` (code); `what` is a lag (a digit), `i` or `c` (constant)."""
    if what == "c":
        return str(abs(coef))
    x = what if what == "i" else (f"a(i-{what})" if style == "text" else f"a[i - {what}]")
    mul = "*" if style == "text" else " * "
    return x if abs(coef) == 1 else f"{abs(coef)}{mul}{x}"


def _sum_text(terms: Sequence[tuple[int, str]], style: str) -> str:
    out = ("-" if terms[0][0] < 0 else "") + _term(*terms[0], style)
    return out + "".join(f" {'-' if c < 0 else '+'} {_term(c, w, style)}" for c, w in terms[1:])


def _recurrence(init: Sequence[int], terms: Sequence[tuple[int, str]], mod: int | None) -> Callable[[int], int]:
    """n -> a(n); remembers the terms computed so far, since a draft asks for a(0) to a(24)."""
    seq = list(init)

    def a(n: int) -> int:
        for i in range(len(seq), n + 1):
            v = sum(c * (i if w == "i" else 1 if w == "c" else seq[i - int(w)]) for c, w in terms)
            seq.append(v % mod if mod else v)
        return seq[n]

    return a


def _draw_sequences(r: random.Random, level: int) -> tuple[_Program, list[list[Any]], int]:
    # Level 1: first order plus a constant or i; 2: second order; 3: second or third order, mod m.
    order = level if level < 3 else r.choice([2, 3])
    mod = r.choice([97, 100, 101, 997, 1000]) if level == 3 else None
    lags = [(r.choice([-2, -1, 1, 2, 3] if level == 1 else [-2, -1, 1, 2]), "1")]
    lags += [(r.choice([-1, 1, 2]), str(k)) for k in range(2, order + 1) if k == order or r.random() < 0.5]
    extra = r.choice([(r.choice([-9, -5, -2, -1, 1, 2, 3, 4, 7]), "c"), (r.choice([-3, -2, -1, 1, 2, 3]), "i")])
    terms = lags + ([extra] if level != 2 or r.random() < 0.5 else [])
    init = [r.randint(0, 20) if mod else r.randint(-3, 5) for _ in range(order)]
    rule = _sum_text(terms, "text")
    if mod:
        rule = f"({rule}) mod {mod}"
    starts = ", ".join(f"a({k}) = {v}" for k, v in enumerate(init))
    statement = f"The sequence a has {starts}, and a(i) = {rule} for every i >= {order}."
    if mod:
        statement += (
            f"\nHere x mod {mod} is the remainder of x divided by {mod}, from 0 to {mod - 1} (for negative x too)."
        )
    statement += "\nReturn a(n) (n >= 0)."
    step = f"{_sum_text(terms, 'code')}"
    body = (
        f"a = {init}",
        f"for i in range({order}, n + 1):",
        f"    a.append({f'({step}) % {mod}' if mod else step})",
        "return a[n]",
    )
    fn = _recurrence(init, terms, mod)
    program = _Program(
        signature="term(n: int) -> int",
        statement=statement,
        body=body,
        fn=fn,
        ablations=tuple(_recurrence(init, [t for t in terms if t is not dropped], mod) for dropped in terms),
        near_misses=(lambda n: fn(n + 1),),
    )
    rest = list(range(3, 25))
    r.shuffle(rest)
    return program, [[0], [1], [2]] + [[n] for n in rest], 3
