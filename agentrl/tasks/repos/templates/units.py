"""A unit converter: length, mass and time by factor, temperatures by offset, quantities read from text."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="units",
    about="a unit conversion library",
    packages=("unitconv", "measures", "quantities"),
    params={"DIGITS": ("2", "3")},
    modules={
        "__init__.py": r'''"""Convert quantities between units."""

from .convert import convert
from .parse import convert_text, parse_quantity
from .temperature import convert_temperature
''',
        "tables.py": r'''"""Factors to each dimension's base unit (metre, gram, second)."""

LENGTH = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048}
MASS = {"g": 1.0, "kg": 1000.0, "lb": 453.59237, "oz": 28.349523125}
TIME = {"s": 1.0, "min": 60.0, "h": 3600.0, "day": 86400.0}
DIMENSIONS = {"length": LENGTH, "mass": MASS, "time": TIME}


def dimension_of(unit):
    """The name of the dimension `unit` measures; KeyError for an unknown unit."""
    for name, table in DIMENSIONS.items():
        if unit in table:
            return name
    raise KeyError(f"unknown unit: {unit}")


def factor(unit):
    """How many base units one `unit` is."""
    return DIMENSIONS[dimension_of(unit)][unit]
''',
        "temperature.py": r'''"""Temperatures, which convert by an offset as well as a scale."""

SCALES = ("C", "F", "K")


def is_temperature(unit):
    return unit in SCALES


def to_celsius(value, unit):
    if unit == "F":
        return (value - 32) * 5 / 9
    if unit == "K":
        return value - 273.15
    return value


def from_celsius(value, unit):
    if unit == "F":
        return value * 9 / 5 + 32
    if unit == "K":
        return value + 273.15
    return value


def convert_temperature(value, source, target):
    """`value` degrees on scale `source` on scale `target`."""
    if not (is_temperature(source) and is_temperature(target)):
        raise ValueError(f"cannot convert {source} to {target}")
    return from_celsius(to_celsius(value, source), target)
''',
        "convert.py": r'''"""Convert between units of one dimension."""

from .tables import dimension_of, factor
from .temperature import convert_temperature, is_temperature


def convert(value, source, target):
    """`value` in `source` units expressed in `target` units."""
    if is_temperature(source) or is_temperature(target):
        return convert_temperature(value, source, target)
    if dimension_of(source) != dimension_of(target):
        raise ValueError(f"cannot convert {source} to {target}")
    return value * factor(source) / factor(target)
''',
        "parse.py": r'''"""Quantities written as text, such as "3.5 km" or "10kg"."""

from .convert import convert

DIGITS = @DIGITS@


def parse_quantity(text):
    """(number, unit) of `text`; the unit follows the number, with or without a space."""
    text = text.strip()
    i = 0
    while i < len(text) and (text[i].isdigit() or text[i] in ".-"):
        i += 1
    if i == 0:
        raise ValueError(f"no number in {text!r}")
    return float(text[:i]), text[i:].strip()


def convert_text(text, target, digits=DIGITS):
    """The quantity in `text` converted to `target`, rounded to `digits` places."""
    value, unit = parse_quantity(text)
    return round(convert(value, unit, target), digits)
''',
    },
    tests={
        "test_convert.py": r"""from @pkg@ import convert, convert_text, parse_quantity


def test_km_to_m():
    assert convert(2, "km", "m") == 2000


def test_same_unit():
    assert convert(5, "kg", "kg") == 5


def test_freezing_in_kelvin():
    assert convert(0, "C", "K") == 273.15


def test_parse_with_space():
    assert parse_quantity("3.5 km") == (3.5, "km")


def test_parse_without_space():
    assert parse_quantity("10kg") == (10.0, "kg")


def test_convert_text():
    assert convert_text("1500 m", "km") == 1.5


def test_unknown_unit():
    try:
        convert(1, "parsec", "m")
    except KeyError:
        return
    raise AssertionError("no KeyError")
""",
    },
    sites=(
        Site(
            "number_end",
            "off_by_one",
            "parse.py",
            "return float(text[:i]), text[i:].strip()",
            "return float(text[: i - 1]), text[i - 1 :].strip()",
            "parse_quantity() misreads the number",
            'parse_quantity("12 km")',
            ('convert_text("250 cm", "m")',),
        ),
        Site(
            "hour_factor",
            "wrong_operator_or_constant",
            "tables.py",
            '"h": 3600.0',
            '"h": 360.0',
            "Converting hours gives the wrong number of minutes",
            'convert(2, "h", "min")',
            ('convert(1, "day", "h")',),
        ),
        Site(
            "fahrenheit_scale",
            "wrong_operator_or_constant",
            "temperature.py",
            "return (value - 32) * 5 / 9",
            "return (value - 32) * 9 / 5",
            "Fahrenheit temperatures convert to the wrong Celsius value",
            'convert(212, "F", "C")',
            ('convert(50, "F", "K")',),
        ),
        Site(
            "dimension_check",
            "missing_case",
            "convert.py",
            """    if dimension_of(source) != dimension_of(target):
        raise ValueError(f"cannot convert {source} to {target}")
""",
            "",
            "convert() turns kilograms into metres instead of refusing",
            'convert(1, "kg", "m")',
            ('convert_text("3 h", "km")',),
        ),
        Site(
            "temperature_order",
            "wrong_cross_module_call",
            "temperature.py",
            "return from_celsius(to_celsius(value, source), target)",
            "return to_celsius(from_celsius(value, source), target)",
            "Temperature conversions come out wrong",
            'convert(212, "F", "C")',
            ('convert(300, "K", "C")',),
        ),
        Site(
            "negative_number",
            "parsing_or_config",
            "parse.py",
            'text[i] in ".-"',
            'text[i] == "."',
            "parse_quantity() rejects negative numbers",
            'parse_quantity("-5 C")',
            ('convert_text("-40 F", "C")',),
        ),
        Site(
            "rounding_default",
            "parsing_or_config",
            "parse.py",
            "def convert_text(text, target, digits=DIGITS):",
            "def convert_text(text, target, digits=0):",
            "convert_text() rounds to whole numbers",
            'convert_text("1 in", "cm")',
        ),
    ),
)
