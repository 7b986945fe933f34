"""Procedural Python coding tasks with hidden tests, in unbounded supply.

A task asks for one function, stated as a numbered list of steps (or a recurrence). Each step
is a primitive with random parameters, said three ways: an English sentence (the statement),
a Python expression (the reference solution's source) and a callable (which computes the
expected values). Tests check that the source and the callable agree on every case.

Tests are chosen to be strict: besides the right function, a draft knows wrong ones, each
step left out (or a compound condition cut to one half) and plausible misreadings (rotating
right for left, truncating for floor division). A draft is redrawn unless some test input
tells every left-out variant apart, so no step of a statement is idle; hidden cases are
picked to tell apart every wrong function that any input can, then edge cases, then inputs
with varied expected values.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agentrl.tasks._generated import GeneratedTaskSet, task_rng
from agentrl.tasks.base import CallCase, CallTests, Task

_Fn = Callable[[Any], Any]

MAX_CASES = 20
"""n_hidden + n_public at most: the sequences family has 25 distinct inputs"""
_RANDOM_INPUTS = 24
"""random inputs drawn per draft, besides the edge cases"""
_MAX_DRAWS = 200
"""drafts tried per task before giving up (an internal error: a few redraws are typical)"""


@dataclass(frozen=True)
class _Step:
    """One operation of a pipeline."""

    text: str
    """an English sentence, e.g. `Reverse it.`"""
    code: str
    """the same operation as a Python expression of the variable `{v}`"""
    fn: _Fn
    """the same operation as a callable"""
    ablations: tuple[_Fn, ...] = ()
    """simpler operations the statement rules out (one half of `even and positive`); some input must tell them apart"""
    near_misses: tuple[_Fn, ...] = ()
    """plausible misreadings; hidden cases tell them apart where some input can"""
    misreadings: tuple[str, ...] = ()
    """the near misses as code of `{v}`, in the same order (a sloppy demonstrator writes these)"""

    def __post_init__(self) -> None:
        assert len(self.misreadings) in (0, len(self.near_misses)), f"{self.text}: misreadings and near misses differ"


@dataclass(frozen=True)
class _Pred:
    """A condition on an integer, said three ways as a _Step is."""

    text: str
    """e.g. `even and greater than 3`"""
    code: str
    """a Python condition on the variable `{x}`"""
    fn: Callable[[int], bool]
    ablations: tuple[Callable[[int], bool], ...] = ()
    near_misses: tuple[Callable[[int], bool], ...] = ()
    misreadings: tuple[str, ...] = ()
    """the near misses as conditions on `{x}`, in the same order"""

    def on(self, var: str) -> str:
        return self.code.replace("{x}", var)


def _pred_step(text: str, code: str, make: Callable[[Callable[[int], bool]], _Fn], p: _Pred) -> _Step:
    """A step built around a condition; the condition's wrong readings become the step's."""
    return _Step(
        text.replace("{p}", p.text),
        code.replace("{p}", p.on("x")),
        make(p.fn),
        tuple(make(a) for a in p.ablations),
        tuple(make(m) for m in p.near_misses),
        tuple(code.replace("{p}", m.replace("{x}", "x")) for m in p.misreadings),
    )


@dataclass(frozen=True)
class _Program:
    """A function to write: its statement, reference source, and the right and wrong callables."""

    signature: str
    """e.g. `transform(s: str) -> str`"""
    statement: str
    body: tuple[str, ...]
    """the reference solution's body, one line each"""
    fn: _Fn
    """the right function, called with the case's arguments"""
    ablations: tuple[_Fn, ...]
    """statement parts left out: a draft is redrawn unless some input tells each apart"""
    near_misses: tuple[_Fn, ...]
    misread_bodies: tuple[tuple[tuple[str, ...], ...], ...] = ()
    """per step, the body lines it can be written as: first the right one, then its misreadings"""

    @property
    def entry_point(self) -> str:
        return self.signature.split("(")[0]

    def source(self, body: Sequence[str] | None = None) -> str:
        return f"def {self.signature}:\n" + "".join(f"    {line}\n" for line in body or self.body)

    def misread_sources(self) -> list[str]:
        """One source per near miss, in `near_misses` order: one step misread, the rest right."""
        right = [lines[0] for lines in self.misread_bodies]
        return [self.source([*right[:i], wrong, *right[i + 1 :]])
                for i, lines in enumerate(self.misread_bodies) for wrong in lines[1:]]  # fmt: skip

    def sloppy_source(self, rng: random.Random, misread: float) -> str:
        """As a sloppy reader writes it: each step that can be misread is, with probability `misread`."""
        return self.source([rng.choice(lines[1:]) if len(lines) > 1 and rng.random() < misread else lines[0]
                            for lines in self.misread_bodies])  # fmt: skip

    def starter(self) -> str:
        doc = "\n    ".join(self.statement.splitlines())
        return f'def {self.signature}:\n    """{doc}\n    """\n'


def _signed(c: int) -> str:
    """` + c` or ` - |c|`, to append to an expression."""
    return f" + {c}" if c >= 0 else f" - {-c}"


def _add_text(c: int, what: str = "it") -> str:
    return f"add {c} to {what}" if c > 0 else f"subtract {-c} from {what}"


# ---- conditions on integers ----


def _atom(r: random.Random) -> _Pred:
    t = r.randint(-5, 10)
    k = r.randint(3, 5)
    return r.choice(
        [
            _Pred("even", "{x} % 2 == 0", lambda x: x % 2 == 0),
            _Pred("odd", "{x} % 2 == 1", lambda x: x % 2 == 1),
            _Pred("positive", "{x} > 0", lambda x: x > 0, near_misses=(lambda x: x >= 0,), misreadings=("{x} >= 0",)),
            _Pred("negative", "{x} < 0", lambda x: x < 0, near_misses=(lambda x: x <= 0,), misreadings=("{x} <= 0",)),
            _Pred(
                f"greater than {t}",
                f"{{x}} > {t}",
                lambda x: x > t,
                near_misses=(lambda x: x >= t,),
                misreadings=(f"{{x}} >= {t}",),
            ),
            _Pred(
                f"less than {t}",
                f"{{x}} < {t}",
                lambda x: x < t,
                near_misses=(lambda x: x <= t,),
                misreadings=(f"{{x}} <= {t}",),
            ),
            _Pred(
                f"at least {t}",
                f"{{x}} >= {t}",
                lambda x: x >= t,
                near_misses=(lambda x: x > t,),
                misreadings=(f"{{x}} > {t}",),
            ),
            _Pred(f"divisible by {k}", f"{{x}} % {k} == 0", lambda x: x % k == 0),
        ]
    )


def _compound(r: random.Random) -> _Pred:
    """`a and b` or `a or b`; each half alone must be told apart from the whole."""
    a, b = _atom(r), _atom(r)
    if r.random() < 0.5:
        return _Pred(
            f"{a.text} and {b.text}",
            f"{a.code} and {b.code}",
            lambda x: a.fn(x) and b.fn(x),
            ablations=(a.fn, b.fn),
            near_misses=(lambda x: a.fn(x) or b.fn(x),),
            misreadings=(f"{a.code} or {b.code}",),
        )
    return _Pred(
        f"{a.text} or {b.text}",
        f"{a.code} or {b.code}",
        lambda x: a.fn(x) or b.fn(x),
        ablations=(a.fn, b.fn),
        near_misses=(lambda x: a.fn(x) and b.fn(x),),
        misreadings=(f"{a.code} and {b.code}",),
    )


# ---- strings ----


def _rotate(xs: Any, k: int) -> Any:
    """xs rotated left by k (right when k < 0); works on strings and lists."""
    if not xs:
        return xs
    k %= len(xs)
    return xs[k:] + xs[:k]


def _s_reverse(r: random.Random, ab: str) -> _Step:
    return _Step("Reverse it.", "{v}[::-1]", lambda s: "".join(reversed(s)))


def _s_case(r: random.Random, ab: str) -> _Step:
    return r.choice(
        [
            _Step("Convert every letter to upper case.", "{v}.upper()", str.upper),
            _Step("Convert every letter to lower case.", "{v}.lower()", str.lower),
            _Step(
                "Swap the case of every letter (upper case becomes lower case and vice versa).",
                "{v}.swapcase()",
                str.swapcase,
                near_misses=(str.upper, str.lower),
                misreadings=("{v}.upper()", "{v}.lower()"),
            ),
        ]
    )


def _s_replace(r: random.Random, ab: str) -> _Step:
    old = r.choice(ab)
    new = r.choice(["", "*", "-", r.choice(ab), r.choice(ab) + r.choice(ab)])
    while new == old:
        new = r.choice(["*", "-"])
    note = f" (case-sensitive: {old.swapcase()!r} is not replaced)" if old.isalpha() else ""
    text = f"Delete every {old!r}{note}." if not new else f"Replace every {old!r} with {new!r}{note}."
    return _Step(
        text,
        f"{{v}}.replace({old!r}, {new!r})",
        lambda s: "".join(new if c == old else c for c in s),
        near_misses=(lambda s: "".join(new if c.lower() == old.lower() else c for c in s),),
        misreadings=(f"''.join({new!r} if c.lower() == {old.lower()!r} else c for c in {{v}})",),
    )


def _s_vowels(r: random.Random, ab: str) -> _Step:
    return _Step(
        "Delete every vowel (a, e, i, o, u, in upper or lower case).",
        "''.join(c for c in {v} if c.lower() not in 'aeiou')",
        lambda s: "".join(c for c in s if c not in "aeiouAEIOU"),
        near_misses=(lambda s: "".join(c for c in s if c not in "aeiou"),),
        misreadings=("''.join(c for c in {v} if c not in 'aeiou')",),
    )


def _s_stride(r: random.Random, ab: str) -> _Step:
    k = r.choice([2, 3])
    start = r.randrange(k)
    nth = {2: "second", 3: "third"}
    positions = ", ".join(str(start + j * k) for j in range(3))
    return _Step(
        f"Keep only the characters at positions {positions}, ... (every {nth[k]} character, counting from 0).",
        f"{{v}}[{start}::{k}]",
        lambda s: "".join(c for i, c in enumerate(s) if i % k == start),
        near_misses=(lambda s: s[(start + 1) % k :: k],),
        misreadings=(f"{{v}}[{(start + 1) % k}::{k}]",),
    )


def _rotation(r: random.Random, noun: str, container: str) -> _Step:
    """Rotate left or right by k; strings and lists rotate alike."""
    k = r.randint(1, 4)
    times = "once" if k == 1 else f"{k} times"
    keep = f"(an empty {container} stays empty)"
    left = f"{{v}}[{k} % len({{v}}):] + {{v}}[:{k} % len({{v}})] if {{v}} else {{v}}"
    right = f"{{v}}[len({{v}}) - {k} % len({{v}}):] + {{v}}[:len({{v}}) - {k} % len({{v}})] if {{v}} else {{v}}"
    if r.random() < 0.5:
        return _Step(
            f"Rotate it left by {k}: move its first {noun} to the end, {times} {keep}.",
            left,
            lambda xs: _rotate(xs, k),
            near_misses=(lambda xs: _rotate(xs, -k), lambda xs: xs[k:] + xs[:k]),
            misreadings=(right, f"{{v}}[{k}:] + {{v}}[:{k}]"),
        )
    return _Step(
        f"Rotate it right by {k}: move its last {noun} to the front, {times} {keep}.",
        right,
        lambda xs: _rotate(xs, -k),
        near_misses=(lambda xs: _rotate(xs, k), lambda xs: xs[-k:] + xs[:-k]),
        misreadings=(left, f"{{v}}[-{k}:] + {{v}}[:-{k}]"),
    )


def _s_rotate(r: random.Random, ab: str) -> _Step:
    return _rotation(r, "character", "string")


def _s_double(r: random.Random, ab: str) -> _Step:
    return _Step(
        "Write every character twice in a row ('ab' becomes 'aabb').",
        "''.join(c * 2 for c in {v})",
        lambda s: "".join(c + c for c in s),
        near_misses=(lambda s: s + s,),
        misreadings=("{v} + {v}",),
    )


def _s_sort(r: random.Random, ab: str) -> _Step:
    return _Step(
        "Sort its characters by Unicode code point (a space comes first, then upper-case letters, then lower-case).",
        "''.join(sorted({v}))",
        lambda s: "".join(sorted(s, key=ord)),
        near_misses=(lambda s: "".join(sorted(s, key=str.lower)),),
        misreadings=("''.join(sorted({v}, key=str.lower))",),
    )


def _s_dedupe(r: random.Random, ab: str) -> _Step:
    def first_occurrences(s: str) -> str:
        return "".join(c for i, c in enumerate(s) if c not in s[:i])

    return _Step(
        "Delete every character that already occurs earlier in it (case-sensitive), keeping first occurrences.",
        "''.join(dict.fromkeys({v}))",
        first_occurrences,
        near_misses=(lambda s: first_occurrences(s[::-1])[::-1],),
        misreadings=("''.join(dict.fromkeys({v}[::-1]))[::-1]",),
    )


def _slice(r: random.Random, noun: str) -> _Step:
    """Keep or delete a prefix or suffix; strings and lists slice alike."""
    k = r.randint(1, 4)
    part = noun if k == 1 else f"{k} {noun}s"
    return r.choice(
        [
            _Step(f"Keep only its first {part} (all of them if it is shorter).", f"{{v}}[:{k}]", lambda xs: xs[:k]),
            _Step(f"Keep only its last {part} (all of them if it is shorter).", f"{{v}}[-{k}:]", lambda xs: xs[-k:]),
            _Step(f"Delete its first {part} (all of them if it is shorter).", f"{{v}}[{k}:]", lambda xs: xs[k:]),
        ]
    )


def _s_slice(r: random.Random, ab: str) -> _Step:
    return _slice(r, "character")


def _s_caesar(r: random.Random, ab: str) -> _Step:
    k = r.randint(1, 25)
    low = string.ascii_lowercase
    wrap = low[(25 + k) % 26]
    return _Step(
        f"Shift every lower-case letter {k} places forward in the alphabet, wrapping around after 'z' "
        f"('z' becomes {wrap!r}); other characters stay as they are.",
        f"''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in {{v}})",
        lambda s: "".join(low[(low.index(c) + k) % 26] if c in low else c for c in s),
        near_misses=(lambda s: "".join(low[(low.index(c) - k) % 26] if c in low else c for c in s),),
        misreadings=(f"''.join(chr((ord(c) - 97 - {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in {{v}})",),
    )


def _s_mirror(r: random.Random, ab: str) -> _Step:
    return _Step(
        "Append its reverse to it ('ab' becomes 'abba').",
        "{v} + {v}[::-1]",
        lambda s: s + "".join(reversed(s)),
        near_misses=(lambda s: s[::-1] + s,),
        misreadings=("{v}[::-1] + {v}",),
    )


_STRING_STEPS = (
    _s_reverse,
    _s_case,
    _s_replace,
    _s_vowels,
    _s_stride,
    _s_rotate,
    _s_double,
    _s_sort,
    _s_dedupe,
    _s_slice,
    _s_caesar,
    _s_mirror,
)


def _alphabet(r: random.Random) -> str:
    """4 to 7 lower-case letters, sometimes with two of them upper-cased and a space."""
    letters = r.sample(string.ascii_lowercase, r.randint(4, 7))
    if r.random() < 0.4:
        letters += [c.upper() for c in r.sample(letters, 2)]
    if r.random() < 0.3:
        letters.append(" ")
    return "".join(letters)


def _draw_strings(r: random.Random, level: int) -> tuple[_Program, list[list[Any]], int]:
    ab = _alphabet(r)
    steps = [make(r, ab) for make in r.sample(_STRING_STEPS, level)]
    program = _pipeline("transform(s: str) -> str", "s", "to the string s and return the result", steps)
    c = r.choice(ab)
    edges = [[""], [c], [c * 3]]
    return program, edges + [["".join(r.choices(ab, k=r.randint(2, 12)))] for _ in range(_RANDOM_INPUTS)], len(edges)


# ---- lists of integers ----


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


# ---- integers ----


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


# ---- counting and search in lists ----


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
        return _Step(step.text, step.code, step.fn, step.ablations,
                     (*step.near_misses, *(m(p.fn) for m, _ in misreads)),
                     (*step.misreadings, *(c.replace("{p}", p.on("x")) for _, c in misreads)))  # fmt: skip
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


# ---- sequences defined by recurrences ----


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


# ---- drafts: a program and the cases that test it ----


def _pipeline(signature: str, var: str, what: str, steps: Sequence[_Step]) -> _Program:
    """Steps applied in order; the last one's value is returned. `what` ends the statement's first line."""

    def chain(fns: Sequence[_Fn]) -> _Fn:
        return lambda x: functools.reduce(lambda acc, f: f(acc), fns, x)

    fns = [s.fn for s in steps]
    swapped = [(i, alt) for i, s in enumerate(steps) for alt in s.ablations]
    ablations = [chain(fns[:i] + fns[i + 1 :]) for i in range(len(fns))]  # one step left out
    ablations += [chain([*fns[:i], alt, *fns[i + 1 :]]) for i, alt in swapped]
    if len(steps) > 1:
        ablations.append(chain([]))  # steps that together undo each other
    near_misses = [chain([*fns[:i], m, *fns[i + 1 :]]) for i, s in enumerate(steps) for m in s.near_misses]

    def line(k: int, code: str) -> str:
        return f"return {code.replace('{v}', var)}" if k == len(steps) - 1 else f"{var} = {code.replace('{v}', var)}"

    variants = tuple(tuple(line(k, c) for c in (s.code, *s.misreadings)) for k, s in enumerate(steps))
    intro = "Apply this step" if len(steps) == 1 else "Apply these steps in order"
    return _Program(
        signature=signature,
        statement=f"{intro} {what}:\n" + "\n".join(f"{i}. {s.text}" for i, s in enumerate(steps, 1)),
        body=tuple(v[0] for v in variants),
        fn=chain(fns),
        ablations=tuple(ablations),
        near_misses=tuple(near_misses),
        misread_bodies=variants if all(len(s.misreadings) == len(s.near_misses) for s in steps) else (),
    )


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


def _call(entry_point: str, args: list[Any]) -> str:
    return f"{entry_point}({', '.join(map(repr, args))})"


class ProceduralCodeTasks(GeneratedTaskSet):
    """Write one small Python function, graded by hidden call tests.

    Families: strings (str -> str steps), lists (list -> list steps), numbers (int -> int steps),
    counting (list steps, then a count or search), sequences (the n-th term of a recurrence).
    Level = number of steps: 1, 2 or 3 (counting: a compound condition counts as a step;
    sequences: 1 is first order, 2 second order, 3 up to third order modulo m). Level 1 has
    only dozens of statements per family (tasks differ in their test inputs; a split keeps
    each statement on one side); levels 2 and 3 have far more. With the default 10 hidden
    cases, no expected value filled more than half of them in 1500 tasks measured, so no
    constant passes. A task takes about 1 ms to build.
    """

    name = "procedural"
    description = "generated Python functions (strings, lists, numbers, counting, recurrences), hidden call tests"
    FAMILIES = tuple(_FAMILIES)

    def __init__(
        self,
        *,
        families: Sequence[str] | None = None,
        levels: Sequence[int] | None = None,
        n_hidden: int = 10,
        n_public: int = 2,
    ):
        super().__init__(families=families, levels=levels)
        if n_hidden < 1 or n_public < 0 or n_hidden + n_public > MAX_CASES:
            raise ValueError(f"need n_hidden >= 1, n_public >= 0, n_hidden + n_public <= {MAX_CASES}")
        self.n_hidden = n_hidden
        self.n_public = n_public

    def split_key(self, task: Task) -> str:
        """The statement (starter code: signature and docstring), not the test inputs: two tasks
        asking for the same function land on the same side, so a held-out problem is never
        trained on with other inputs."""
        return hashlib.sha256(task.starter_code.encode()).hexdigest()

    def _build(self, task_id: str, family: str, level: int, rng: random.Random) -> Task:
        program, cases = _draft(family, level, rng)
        hidden, public = _choose(cases, self.n_hidden, self.n_public)
        entry = program.entry_point
        starter = program.starter()
        examples = "".join(f"{_call(entry, c.args)} == {c.expected!r}\n" for c in public)
        prompt = (
            "Implement this Python function; hidden tests check it, edge cases included.\n\n"
            f"```python\n{starter}```\n" + (f"\nExamples:\n{examples}" if examples else "")
        )
        return Task(
            id=task_id,
            prompt=prompt,
            starter_code=starter,
            tests=CallTests(entry_point=entry, cases=[CallCase(args=c.args, expected=c.expected) for c in hidden]),
            public_tests=CallTests(
                entry_point=entry, cases=[CallCase(args=c.args, expected=c.expected) for c in public]
            )
            if public
            else None,
            metadata={"family": family, "level": level, "source": "procedural"},
        )


def _program(task: Task) -> _Program:
    family, level, n = ProceduralCodeTasks._parse(task.id)
    return _draft(family, level, task_rng(ProceduralCodeTasks.name, family, level, n))[0]


def reference_solution(task: Task) -> str:
    """The source of a correct solution to a procedural task, regenerated from its id (KeyError if not one)."""
    return _program(task).source()


def sloppy_solution(task: Task, rng: random.Random, misread: float) -> str:
    """A solution as a sloppy reader writes it: each step that has a plausible misreading (rotating right for
    left, truncating for floor division, `>=` for "greater than", ...) is misread with probability `misread`.
    The hidden tests tell every such misreading apart where some input can."""
    return _program(task).sloppy_source(rng, misread)


def reading(task: Task, code: str) -> Literal["reference", "misread", "printed", "other"]:
    """How a solution relates to its task, by source (whitespace aside): the reference solution, the
    reference with one or more steps misread as `sloppy_solution` writes them, either of those with its
    result printed instead of returned (`solutions.printing`), or something else (a wrong constant,
    another operation: an error of capability rather than of reading)."""
    from agentrl.tasks.solutions import printing

    program, squash = _program(task), (lambda s: "".join(s.split()))
    mine = squash(code)
    if mine == squash(program.source()):
        return "reference"
    sources = [program.source(v) for v in itertools.product(*program.misread_bodies)]  # the reference among them
    if mine in {squash(s) for s in sources}:
        return "misread"
    return "printed" if mine in {squash(printing(s)) for s in sources} else "other"
