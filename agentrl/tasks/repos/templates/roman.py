"""Roman numerals: writing, strict reading, and arithmetic on numerals."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="roman",
    about="a Roman numerals library",
    packages=("romans", "numerals", "romanize"),
    modules={
        "__init__.py": r'''"""Roman numerals from 1 to 3999."""

from .arith import add, compare, subtract
from .parse import from_roman
from .write import to_roman
''',
        "write.py": r'''"""Writing Roman numerals."""

VALUES = (
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
    (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
)


def to_roman(n):
    """The numeral of `n`, 1 <= n <= 3999; ValueError otherwise."""
    if not 0 < n < 4000:
        raise ValueError(f"out of range: {n}")
    out = []
    for value, letters in VALUES:
        while n >= value:
            out.append(letters)
            n -= value
    return "".join(out)
''',
        "parse.py": r'''"""Reading Roman numerals."""

from .write import to_roman

LETTERS = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


def from_roman(text):
    """The value of `text`, in any case; ValueError unless it is the canonical numeral."""
    text = text.strip().upper()
    if not text or any(c not in LETTERS for c in text):
        raise ValueError(f"not a Roman numeral: {text!r}")
    total = 0
    for i, c in enumerate(text):
        value = LETTERS[c]
        if i + 1 < len(text) and LETTERS[text[i + 1]] > value:
            total -= value
        else:
            total += value
    if to_roman(total) != text:
        raise ValueError(f"not canonical: {text!r}")
    return total
''',
        "arith.py": r'''"""Arithmetic on numerals."""

from .parse import from_roman
from .write import to_roman


def add(a, b):
    return to_roman(from_roman(a) + from_roman(b))


def subtract(a, b):
    """`a - b`; ValueError unless the result is positive."""
    return to_roman(from_roman(a) - from_roman(b))


def compare(a, b):
    """-1, 0 or 1 as `a` is less than, equal to or greater than `b`."""
    x, y = from_roman(a), from_roman(b)
    return (x > y) - (x < y)
''',
    },
    tests={
        "test_roman.py": r"""from @pkg@ import add, compare, from_roman, subtract, to_roman


def test_to_roman():
    assert to_roman(1987) == "MCMLXXXVII"


def test_from_roman():
    assert from_roman("MMXXIV") == 2024


def test_round_trip():
    assert all(from_roman(to_roman(n)) == n for n in (1, 8, 49, 500, 1666))


def test_add():
    assert add("X", "V") == "XV"


def test_subtract():
    assert subtract("X", "III") == "VII"


def test_compare():
    assert compare("L", "C") == -1


def test_zero():
    try:
        to_roman(0)
    except ValueError:
        return
    raise AssertionError("no ValueError")
""",
    },
    sites=(
        Site(
            "upper_bound",
            "off_by_one",
            "write.py",
            "if not 0 < n < 4000:",
            "if not 0 < n < 3999:",
            "to_roman(3999) is refused",
            "to_roman(3999)",
            ('add("MMM", "CMXCIX")',),
        ),
        Site(
            "subtractive",
            "wrong_operator_or_constant",
            "parse.py",
            "LETTERS[text[i + 1]] > value:",
            "LETTERS[text[i + 1]] >= value:",
            "from_roman() rejects numerals with repeated letters",
            'from_roman("XX")',
            ('compare("III", "II")',),
        ),
        Site(
            "four",
            "missing_case",
            "write.py",
            ' (4, "IV"),',
            "",
            "to_roman(4) is written IIII",
            "to_roman(4)",
            ("to_roman(1994)",),
        ),
        Site(
            "canonical",
            "missing_case",
            "parse.py",
            """    if to_roman(total) != text:
        raise ValueError(f"not canonical: {text!r}")
""",
            "",
            "from_roman() accepts malformed numerals",
            'from_roman("IIII")',
            ('from_roman("VX")',),
        ),
        Site(
            "case",
            "parsing_or_config",
            "parse.py",
            "text = text.strip().upper()",
            "text = text.strip()",
            "from_roman() rejects lower-case numerals",
            'from_roman("xiv")',
            ('add("x", "ii")',),
        ),
    ),
)
