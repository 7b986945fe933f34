"""The strings family: `transform(s: str) -> str`, one string step per level, over a small alphabet."""

from __future__ import annotations

import random
import string
from typing import Any

from agentrl.tasks.procedural.steps import _RANDOM_INPUTS, _pipeline, _Program, _rotation, _slice, _Step


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
