"""A semantic-version comparator: parsing, precedence with prereleases, ranges and bumps."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="semver",
    about="a semantic versioning library",
    packages=("semverlite", "versions", "vercmp"),
    modules={
        "__init__.py": r'''"""Semantic versions: parse, compare, match ranges, bump."""

from .bump import bump
from .compare import compare, sort_versions
from .ranges import satisfies
from .version import Version, parse
''',
        "version.py": r'''"""MAJOR.MINOR.PATCH with an optional -prerelease."""


class Version:
    def __init__(self, major, minor, patch, pre=()):
        self.major, self.minor, self.patch, self.pre = major, minor, patch, tuple(pre)

    def __str__(self):
        core = f"{self.major}.{self.minor}.{self.patch}"
        return core + ("-" + ".".join(self.pre) if self.pre else "")


def parse(text):
    """A Version of `text`; a leading `v` is allowed. ValueError for anything else."""
    text = text.strip().lstrip("v")
    core, _, pre = text.partition("-")
    parts = core.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a version: {text!r}")
    return Version(*(int(p) for p in parts), pre=pre.split(".") if pre else ())
''',
        "compare.py": r'''"""Precedence of versions (semver.org, item 11)."""

from .version import parse


def _pre_key(pre):
    """A release sorts after its prereleases; numeric identifiers sort as numbers, before words."""
    if not pre:
        return (1,)
    return (0, *[(0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre])


def key(version):
    v = parse(version) if isinstance(version, str) else version
    return (v.major, v.minor, v.patch, _pre_key(v.pre))


def compare(a, b):
    """-1, 0 or 1 as `a` has lower, equal or higher precedence than `b`."""
    ka, kb = key(a), key(b)
    return (ka > kb) - (ka < kb)


def sort_versions(texts):
    return sorted(texts, key=key)
''',
        "ranges.py": r'''"""Ranges: `^1.2.3`, `~1.2.3`, `>=1.0.0`, `<2.0.0`, `=1.0.0`; all parts must hold."""

from .compare import compare
from .version import parse

OPERATORS = (">=", "<=", ">", "<", "=")


def satisfies(version, spec):
    return all(_holds(version, part) for part in spec.split())


def _holds(version, part):
    if part[0] in "^~":
        base, v = parse(part[1:]), parse(version)
        same = v.major == base.major and (part[0] == "^" or v.minor == base.minor)
        return same and compare(version, part[1:]) >= 0
    for op in OPERATORS:
        if part.startswith(op):
            c = compare(version, part[len(op) :])
            return {">=": c >= 0, "<=": c <= 0, ">": c > 0, "<": c < 0, "=": c == 0}[op]
    raise ValueError(f"bad range {part!r}")
''',
        "bump.py": r'''"""The next version."""

from .version import Version, parse


def bump(text, part):
    """`text` with `part` ("major", "minor" or "patch") raised, lower parts reset, any prerelease dropped."""
    v = parse(text)
    if part == "major":
        return str(Version(v.major + 1, 0, 0))
    if part == "minor":
        return str(Version(v.major, v.minor + 1, 0))
    if part == "patch":
        return str(Version(v.major, v.minor, v.patch + 1))
    raise ValueError(f"unknown part {part!r}")
''',
    },
    tests={
        "test_versions.py": r"""from @pkg@ import bump, compare, parse, satisfies, sort_versions


def test_parse():
    v = parse("1.2.3")
    assert (v.major, v.minor, v.patch) == (1, 2, 3)


def test_compare_minor():
    assert compare("1.2.0", "1.10.0") == -1


def test_equal():
    assert compare("2.0.0", "2.0.0") == 0


def test_sort():
    assert sort_versions(["1.0.1", "0.9.0", "1.0.0"]) == ["0.9.0", "1.0.0", "1.0.1"]


def test_caret():
    assert satisfies("1.4.0", "^1.2.0")


def test_caret_major():
    assert not satisfies("2.0.0", "^1.2.0")


def test_bump_major():
    assert bump("1.2.3", "major") == "2.0.0"


def test_not_a_version():
    try:
        parse("1.2")
    except ValueError:
        return
    raise AssertionError("no ValueError")
""",
    },
    sites=(
        Site(
            "minor_reset",
            "wrong_operator_or_constant",
            "bump.py",
            "return str(Version(v.major, v.minor + 1, 0))",
            "return str(Version(v.major, v.minor + 1, v.patch))",
            "bump(..., 'minor') keeps the old patch number",
            'bump("1.2.3", "minor")',
        ),
        Site(
            "inclusive_bound",
            "wrong_operator_or_constant",
            "ranges.py",
            '{">=": c >= 0,',
            '{">=": c > 0,',
            "A >= range excludes its own lower bound",
            'satisfies("1.0.0", ">=1.0.0")',
            ('satisfies("2.1.0", ">=2.1.0 <3.0.0")',),
        ),
        Site(
            "release_after_pre",
            "missing_case",
            "compare.py",
            """    if not pre:
        return (1,)
""",
            "",
            "A release sorts before its own prereleases",
            'compare("1.0.0", "1.0.0-alpha")',
            ('sort_versions(["1.0.0", "1.0.0-rc.1"])',),
        ),
        Site(
            "caret_args",
            "wrong_cross_module_call",
            "ranges.py",
            "compare(version, part[1:]) >= 0",
            "compare(part[1:], version) >= 0",
            "^ and ~ ranges reject newer versions",
            'satisfies("1.5.0", "^1.2.0")',
            ('satisfies("1.2.9", "~1.2.3")',),
        ),
        Site(
            "prerelease_separator",
            "parsing_or_config",
            "version.py",
            'core, _, pre = text.partition("-")',
            'core, _, pre = text.partition("+")',
            "parse() rejects versions with a prerelease",
            'str(parse("1.0.0-beta.2"))',
        ),
        Site(
            "operator_order",
            "parsing_or_config",
            "ranges.py",
            'OPERATORS = (">=", "<=", ">", "<", "=")',
            'OPERATORS = (">", "<", ">=", "<=", "=")',
            "satisfies() fails on a >= or <= range",
            'satisfies("1.2.0", ">=1.0.0")',
        ),
    ),
)
