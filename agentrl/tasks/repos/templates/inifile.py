"""An INI configuration parser: comments, sections, `key = value` or `key: value` pairs, typed getters."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="inifile",
    about="a parser for INI configuration files",
    packages=("inifile", "confparse", "settingsfile"),
    params={"DEFAULT": ("general", "main", "root")},
    modules={
        "__init__.py": r'''"""Read INI configuration text."""

from .config import Config, load
from .parser import ParseError, parse
''',
        "lexer.py": r'''"""Line-level lexing: comments, section headers and key/value pairs."""

COMMENT_PREFIXES = ("#", ";")


def strip_comment(line):
    """`line` without a trailing comment and surrounding whitespace."""
    for prefix in COMMENT_PREFIXES:
        at = line.find(prefix)
        if at != -1:
            line = line[:at]
    return line.strip()


def section_name(line):
    """The name of a `[section]` header line, or None."""
    if line.startswith("[") and line.endswith("]"):
        return line[1:-1].strip()
    return None


def split_pair(line, separator):
    """(key, value) of a `key <separator> value` line; keys are case-insensitive."""
    key, found, value = line.partition(separator)
    if not found:
        raise ValueError(f"expected {separator!r} in {line!r}")
    return key.strip().lower(), value.strip()
''',
        "values.py": r'''"""Typed values: booleans, integers and lists."""

TRUE = ("1", "yes", "true", "on")
FALSE = ("0", "no", "false", "off")


def to_bool(text):
    """`text` read as a boolean; ValueError for anything else."""
    low = text.lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def to_int(text):
    """`text` read as an integer; a `0x` prefix means hexadecimal."""
    if text.lower().startswith("0x"):
        return int(text[2:], 16)
    return int(text)


def to_list(text, separator=","):
    """The stripped, non-empty items of a separated list."""
    return [item.strip() for item in text.split(separator) if item.strip()]
''',
        "parser.py": r'''"""Parse INI text into {section: {key: value}}."""

from .lexer import section_name, split_pair, strip_comment

DEFAULT_SECTION = "@DEFAULT@"


class ParseError(Exception):
    """A line that is neither a header, a pair, a comment nor blank."""


def parse(text):
    """Sections in order of appearance; pairs before any header go to DEFAULT_SECTION."""
    sections = {}
    current = DEFAULT_SECTION
    for number, raw in enumerate(text.splitlines(), 1):
        line = strip_comment(raw)
        if not line:
            continue
        name = section_name(line)
        if name is not None:
            current = name
            sections.setdefault(current, {})
            continue
        try:
            key, value = split_pair(line, "=" if "=" in line else ":")
        except ValueError:
            raise ParseError(f"line {number}: {raw!r}") from None
        sections.setdefault(current, {})[key] = value
    return sections
''',
        "config.py": r'''"""A read-only view of parsed INI text with typed getters."""

from .parser import parse
from .values import to_bool, to_int, to_list


class Config:
    """Typed access to the sections of an INI document."""

    def __init__(self, sections):
        self._sections = sections

    def sections(self):
        return list(self._sections)

    def get(self, section, key, default=None):
        """The raw string, or `default` when the section or key is absent."""
        return self._sections.get(section, {}).get(key.lower(), default)

    def getint(self, section, key, default=0):
        value = self.get(section, key)
        return default if value is None else to_int(value)

    def getbool(self, section, key, default=False):
        value = self.get(section, key)
        return default if value is None else to_bool(value)

    def getlist(self, section, key):
        value = self.get(section, key)
        return [] if value is None else to_list(value)


def load(text):
    """A Config of INI `text`."""
    return Config(parse(text))
''',
    },
    tests={
        "test_config.py": r"""from @pkg@ import ParseError, load, parse


def test_pairs_by_section():
    assert parse("[db]\nhost = local\nport = 5432") == {"db": {"host": "local", "port": "5432"}}


def test_pairs_before_a_header():
    assert parse("name = x") == {"@DEFAULT@": {"name": "x"}}


def test_hash_comment():
    assert parse("# top\n[a]\nk = v # note") == {"a": {"k": "v"}}


def test_colon_separator():
    assert load("[a]\nk: v").get("a", "k") == "v"


def test_getint():
    assert load("[a]\nn = 42").getint("a", "n") == 42


def test_missing_key_default():
    assert load("[a]").getint("a", "n", 7) == 7


def test_getbool_false():
    assert load("[a]\nflag = off").getbool("a", "flag") is False


def test_bad_line():
    try:
        parse("[a]\nnonsense")
    except ParseError:
        return
    raise AssertionError("no ParseError")
""",
    },
    sites=(
        Site(
            "header_brackets",
            "off_by_one",
            "lexer.py",
            "return line[1:-1].strip()",
            "return line[1:].strip()",
            "Section names come back with a stray bracket",
            'load("[db]\\nhost = h").sections()',
            ('parse("[a]\\nk = 1")',),
        ),
        Site(
            "line_numbers",
            "off_by_one",
            "parser.py",
            "enumerate(text.splitlines(), 1)",
            "enumerate(text.splitlines())",
            "ParseError reports the wrong line number",
            'try:\n    parse("[a]\\nx = 1\\noops")\nexcept ParseError as e:\n    message = str(e)\nmessage',
        ),
        Site(
            "hex_base",
            "wrong_operator_or_constant",
            "values.py",
            "return int(text[2:], 16)",
            "return int(text[2:], 8)",
            "getint() reads hexadecimal values wrongly",
            'load("[a]\\nmask = 0x17").getint("a", "mask")',
            ('load("[a]\\nm = 0x10").getint("a", "m")',),
        ),
        Site(
            "hex_prefix",
            "missing_case",
            "values.py",
            """    if text.lower().startswith("0x"):
        return int(text[2:], 16)
""",
            "",
            "getint() fails on hexadecimal values",
            'load("[a]\\nmask = 0x1f").getint("a", "mask")',
            ('load("[a]\\nm = 0X10").getint("a", "m")',),
        ),
        Site(
            "key_case",
            "missing_case",
            "config.py",
            ".get(key.lower(), default)",
            ".get(key, default)",
            "get() does not find a key spelt with capitals",
            'load("[a]\\nHost = x").get("a", "Host")',
            ('load("[a]\\nport = 1").getint("a", "PORT", 5)',),
        ),
        Site(
            "bool_helper",
            "wrong_cross_module_call",
            "config.py",
            "return default if value is None else to_bool(value)",
            "return default if value is None else bool(to_int(value))",
            "getbool() fails on yes/no values",
            'load("[a]\\ndebug = yes").getbool("a", "debug")',
            ('load("[a]\\nx = true").getbool("a", "x")',),
        ),
        Site(
            "semicolon_comment",
            "parsing_or_config",
            "lexer.py",
            'COMMENT_PREFIXES = ("#", ";")',
            'COMMENT_PREFIXES = ("#",)',
            "Values keep a trailing `;` comment",
            'load("[a]\\nx = 1 ; note").get("a", "x")',
            ('parse("; top\\n[a]\\nk = v")',),
        ),
        Site(
            "separator_choice",
            "parsing_or_config",
            "parser.py",
            'split_pair(line, "=" if "=" in line else ":")',
            'split_pair(line, ":" if ":" in line else "=")',
            "A URL value is split in two",
            'parse("[site]\\nurl = http://example.com")',
        ),
        Site(
            "list_separator",
            "parsing_or_config",
            "values.py",
            'def to_list(text, separator=","):',
            'def to_list(text, separator=";"):',
            "getlist() returns the whole value as one item",
            'load("[a]\\nhosts = a, b,c").getlist("a", "hosts")',
        ),
    ),
)
