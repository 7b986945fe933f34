"""Questions with exact answers that need a tool: trivial with Python or an exact calculator, impractical by hand.

Each task carries an exact `answer` (compared after stripping whitespace) and says in its prompt
what form the answer takes. `metadata["calculator_ok"]` says whether an exact calculator
suffices, that is, whether the answer is one arithmetic expression (+, -, *, /, parentheses)
over the numbers in the question; powers too large to expand, digit sums and string work need
Python. Sizes stay under Python's 4300-digit limit on int-to-str conversion, which an agent's
`str(2**N)` would otherwise hit.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from fractions import Fraction

from agentrl.tasks._generated import GeneratedTaskSet
from agentrl.tasks.base import Task

_INT = "Answer with the integer only: its digits, with a leading minus sign if negative, and no separators."


def _digits(r: random.Random, lo: int, hi: int) -> int:
    """A random integer with lo to hi decimal digits."""
    k = r.randint(lo, hi)
    return r.randint(10 ** (k - 1), 10**k - 1)


def _product(r: random.Random, level: int) -> tuple[str, str]:
    lo, hi = {1: (8, 10), 2: (12, 15), 3: (16, 20)}[level]
    a, b = _digits(r, lo, hi), _digits(r, lo, hi)
    if level == 3 and r.random() < 0.5:
        a = -a
    return f"Compute {a} * {b}.\n{_INT}", str(a * b)


def _sum(r: random.Random, level: int) -> tuple[str, str]:
    count, lo, hi = {1: (10, 6, 7), 2: (25, 9, 9), 3: (40, 9, 12)}[level]
    xs = [_digits(r, lo, hi) * (-1 if level == 3 and r.random() < 0.3 else 1) for _ in range(count)]
    return f"Compute the sum of these {count} integers:\n{', '.join(map(str, xs))}\n{_INT}", str(sum(xs))


def _powmod(r: random.Random, level: int) -> tuple[str, str]:
    # The exponent has 9+ digits, so a ** b cannot be expanded: it takes modular exponentiation.
    size = {1: 6, 2: 12, 3: 18}[level]
    a, b, m = _digits(r, size, size), _digits(r, max(size, 9), max(size, 9)), _digits(r, size, size)
    question = f"Compute {a}^{b} mod {m}: the remainder of {a} to the power {b}, divided by {m}."
    return f"{question}\n{_INT}", str(pow(a, b, m))


def _count(r: random.Random, level: int) -> tuple[str, str]:
    # Few letters, so the pattern occurs often and (from level 2) its occurrences overlap.
    length, width, letters = {1: (100, 1, 5), 2: (200, 2, 3), 3: (300, 3, 2)}[level]
    alphabet = r.sample(string.ascii_lowercase, letters)
    text = "".join(r.choices(alphabet, k=length))
    pattern = "".join(r.choices(alphabet, k=width))
    overlap = ' Overlapping occurrences count: "aa" occurs 2 times in "aaa".' if width > 1 else ""
    answer = sum(text.startswith(pattern, i) for i in range(len(text)))
    question = f'How many times does "{pattern}" occur in the string below?{overlap}\n\n{text}\n\n'
    return question + "Answer with the integer only.", str(answer)


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _strings(r: random.Random, level: int) -> tuple[str, str]:
    length, k_max = {1: (30, 3), 2: (60, 5), 3: (100, 7)}[level]
    k = r.randint(2, k_max)
    text = "".join(r.choices(string.ascii_lowercase, k=length))
    kept, steps = text, []
    if level == 3:
        gone = r.choice(text)
        kept = text.replace(gone, "")
        steps.append(f'delete every "{gone}"')
    every = f"every {_ordinal(k)} character to upper case (the {_ordinal(k)}, {_ordinal(2 * k)}, ..., counting from 1)"
    steps += ["reverse it", f"convert {every}"]
    chars = list(kept[::-1])
    chars[k - 1 :: k] = [c.upper() for c in chars[k - 1 :: k]]
    question = f"Take the string below, {', then '.join(steps)}.\n\n{text}\n\n"
    return question + "Answer with the resulting string only, without quotes.", "".join(chars)


def _fractions(r: random.Random, level: int) -> tuple[str, str]:
    n_terms, den_digits = {1: (2, 2), 2: (3, 3), 3: (4, 4)}[level]
    terms = [Fraction(r.randint(1, 10**den_digits), _digits(r, den_digits, den_digits)) for _ in range(n_terms)]
    ops = [r.choice("+-*" if level == 3 else "+-") for _ in range(n_terms - 1)]
    expr = f"({terms[0].numerator}/{terms[0].denominator})"
    # The usual precedence: products first, then sums and differences.
    addends, signs = [terms[0]], [1]
    for op, t in zip(ops, terms[1:], strict=True):
        expr += f" {op} ({t.numerator}/{t.denominator})"
        if op == "*":
            addends[-1] *= t
        else:
            addends.append(t)
            signs.append(1 if op == "+" else -1)
    value = sum(s * a for s, a in zip(signs, addends, strict=True))
    fmt = "Answer with the fraction p/q in lowest terms, q positive, a minus sign before p if negative (5 is 5/1)."
    return f"Compute {expr} exactly.\n{fmt}", f"{value.numerator}/{value.denominator}"


def _digitsum(r: random.Random, level: int) -> tuple[str, str]:
    lo, hi = {1: (100, 999), 2: (1000, 9999), 3: (10000, 14000)}[level]
    n = r.randint(lo, hi)
    answer = sum(map(int, str(2**n)))
    return f"What is the sum of the decimal digits of 2^{n} (2 to the power {n})?\n{_INT}", str(answer)


_FAMILIES: dict[str, tuple[Callable[[random.Random, int], tuple[str, str]], bool]] = {
    "product": (_product, True),
    "sum": (_sum, True),
    "powmod": (_powmod, False),
    "count": (_count, False),
    "strings": (_strings, False),
    "fractions": (_fractions, True),
    "digitsum": (_digitsum, False),
}
"""family: (question and answer, whether an exact calculator suffices)"""


class ArithmeticQuestions(GeneratedTaskSet):
    """Exact questions for a tool-using agent; level 1 to 3 scales the numbers and strings.

    Families: product (two 8- to 20-digit integers), sum (10 to 40 integers of 6 to 12 digits),
    powmod (a^b mod m, b of 9 to 18 digits), count (a letter or pattern in a 100- to 300-letter
    string), strings (reverse a 30- to 100-letter string and upper-case every k-th letter),
    fractions (2 to 4 fractions, in lowest terms), digitsum (digits of 2^N, N up to 14000).
    """

    name = "arithmetic"
    description = "exact arithmetic and string questions that need a Python interpreter or a calculator"
    FAMILIES = tuple(_FAMILIES)

    def _build(self, task_id: str, family: str, level: int, rng: random.Random) -> Task:
        make, calculator_ok = _FAMILIES[family]
        prompt, answer = make(rng, level)
        metadata = {"family": family, "level": level, "source": "arithmetic", "calculator_ok": calculator_ok}
        return Task(id=task_id, prompt=prompt, answer=answer, metadata=metadata)
