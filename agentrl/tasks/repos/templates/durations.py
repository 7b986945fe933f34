"""Durations and dates: "1h30m" read and written, clock format, calendar arithmetic on (y, m, d) tuples."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="durations",
    about="a library for durations and dates",
    packages=("durations", "timespan", "daycount"),
    modules={
        "__init__.py": r'''"""Parse and format durations; add days to dates."""

from .dates import add_days, day_of_year, is_leap
from .format import format_clock, format_duration
from .parse import parse_duration
from .schedule import deadline, month_end
''',
        "parse.py": r'''"""Read durations such as "1h30m", "2d 4h" or "90s" as seconds."""

UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text):
    """Seconds in `text`: numbers each followed by a unit letter; spaces are allowed."""
    total, number = 0, ""
    for ch in text.replace(" ", "").lower():
        if ch.isdigit():
            number += ch
        elif ch in UNITS:
            if not number:
                raise ValueError(f"unit {ch!r} without a number in {text!r}")
            total += int(number) * UNITS[ch]
            number = ""
        else:
            raise ValueError(f"unexpected {ch!r} in {text!r}")
    if number:
        raise ValueError(f"number without a unit in {text!r}")
    return total
''',
        "format.py": r'''"""Write seconds back as text."""

from .parse import UNITS


def format_duration(seconds):
    """`5400` -> `"1h30m"`: the largest units first, zero parts left out; zero is `"0s"`."""
    if seconds < 0:
        raise ValueError("negative duration")
    if seconds == 0:
        return "0s"
    parts = []
    for unit, size in UNITS.items():
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def format_clock(seconds):
    """`3725` -> `"1:02:05"`, `65` -> `"1:05"`: hours only when there are any."""
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"
''',
        "dates.py": r'''"""Calendar arithmetic on (year, month, day) tuples."""

DAYS_IN_MONTH = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def is_leap(year):
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    if month == 2 and is_leap(year):
        return 29
    return DAYS_IN_MONTH[month - 1]


def add_days(date, days):
    """The date `days` (>= 0) after `date`."""
    year, month, day = date
    day += days
    while day > days_in_month(year, month):
        day -= days_in_month(year, month)
        month += 1
        if month > 12:
            month, year = 1, year + 1
    return (year, month, day)


def day_of_year(date):
    year, month, day = date
    return sum(days_in_month(year, m) for m in range(1, month)) + day
''',
        "schedule.py": r'''"""Deadlines and month ends."""

from .dates import add_days, days_in_month
from .parse import parse_duration


def deadline(start, duration):
    """The date `duration` (text) after `start`, counting whole days only."""
    return add_days(start, parse_duration(duration) // 86400)


def month_end(date):
    """The last day of `date`'s month."""
    year, month, _ = date
    return (year, month, days_in_month(year, month))
''',
    },
    tests={
        "test_durations.py": r"""from @pkg@ import add_days, deadline, format_clock, format_duration, is_leap
from @pkg@ import parse_duration


def test_parse():
    assert parse_duration("1h30m") == 5400


def test_parse_days():
    assert parse_duration("2d") == 172800


def test_format():
    assert format_duration(3661) == "1h1m1s"


def test_clock_minutes():
    assert format_clock(65) == "1:05"


def test_clock_hours():
    assert format_clock(3725) == "1:02:05"


def test_leap():
    assert is_leap(2024) and not is_leap(2023) and not is_leap(1900)


def test_add_days_across_year():
    assert add_days((2023, 12, 30), 3) == (2024, 1, 2)


def test_deadline():
    assert deadline((2024, 3, 1), "2d 5h") == (2024, 3, 3)


def test_bad_unit():
    try:
        parse_duration("5x")
    except ValueError:
        return
    raise AssertionError("no ValueError")
""",
    },
    sites=(
        Site(
            "day_of_year_range",
            "off_by_one",
            "dates.py",
            "for m in range(1, month)) + day",
            "for m in range(1, month + 1)) + day",
            "day_of_year() is too large",
            "day_of_year((2023, 1, 1))",
            ("day_of_year((2024, 3, 1))",),
        ),
        Site(
            "month_overflow",
            "off_by_one",
            "dates.py",
            "while day > days_in_month(year, month):",
            "while day >= days_in_month(year, month):",
            "add_days() skips the last day of a month",
            "add_days((2024, 1, 30), 1)",
            ("add_days((2023, 4, 1), 29)",),
        ),
        Site(
            "hour_seconds",
            "wrong_operator_or_constant",
            "parse.py",
            '"h": 3600,',
            '"h": 360,',
            "Hours are counted as six minutes",
            'parse_duration("1h")',
            ("format_duration(7200)",),
        ),
        Site(
            "century_leap",
            "missing_case",
            "dates.py",
            "(year % 100 != 0 or year % 400 == 0)",
            "year % 100 != 0",
            "is_leap(2000) is False",
            "is_leap(2000)",
            ("add_days((2000, 2, 28), 1)",),
        ),
        Site(
            "zero_duration",
            "missing_case",
            "format.py",
            """    if seconds == 0:
        return "0s"
""",
            "",
            "format_duration(0) returns an empty string",
            "format_duration(0)",
        ),
        Site(
            "month_end_args",
            "wrong_cross_module_call",
            "schedule.py",
            "days_in_month(year, month))",
            "days_in_month(month, year))",
            "month_end() fails for ordinary dates",
            "month_end((2024, 2, 10))",
            ("month_end((2023, 11, 3))",),
        ),
        Site(
            "spaces",
            "parsing_or_config",
            "parse.py",
            'text.replace(" ", "").lower()',
            "text.lower()",
            "parse_duration() rejects durations written with spaces",
            'parse_duration("2d 4h")',
        ),
        Site(
            "trailing_number",
            "parsing_or_config",
            "parse.py",
            """    if number:
        raise ValueError(f"number without a unit in {text!r}")
""",
            "",
            "parse_duration() silently ignores a number without a unit",
            'parse_duration("1h30")',
        ),
    ),
)
