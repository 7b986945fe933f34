"""A URL query-string library: percent-encoding, parsing, building and merging parameters."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="querystring",
    about="a URL query-string library",
    packages=("querystring", "urlquery", "qsparse"),
    modules={
        "__init__.py": r'''"""Parse and build URL query strings."""

from .build import add_params, path_of, urlencode
from .escape import quote, unquote
from .parse import parse_qs, parse_qsl
''',
        "escape.py": r'''"""Percent-encoding (UTF-8); a space is `+`."""

SAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~"


def quote(text):
    out = []
    for ch in text:
        if ch in SAFE:
            out.append(ch)
        elif ch == " ":
            out.append("+")
        else:
            out.extend(f"%{b:02X}" for b in ch.encode())
    return "".join(out)


def unquote(text):
    """Undo `quote`; a `%` without two hex digits after it stays as it is."""
    data, i = bytearray(), 0
    while i < len(text):
        ch = text[i]
        if ch == "%" and _is_hex(text[i + 1 : i + 3]):
            data.append(int(text[i + 1 : i + 3], 16))
            i += 3
        else:
            data.extend(b" " if ch == "+" else ch.encode())
            i += 1
    return data.decode()


def _is_hex(pair):
    return len(pair) == 2 and all(c in "0123456789abcdefABCDEF" for c in pair)
''',
        "parse.py": r'''"""Parse query strings such as `?a=1&b=x+y&a=2`."""

from .escape import unquote


def parse_qs(query):
    """{key: [values]} in first-seen key order; a leading `?` and empty parts are ignored."""
    result = {}
    for part in query.lstrip("?").split("&"):
        if not part:
            continue
        key, _, value = part.partition("=")
        result.setdefault(unquote(key), []).append(unquote(value))
    return result


def parse_qsl(query):
    """The (key, value) pairs of `query`, grouped by key in first-seen order."""
    return [(k, v) for k, values in parse_qs(query).items() for v in values]
''',
        "build.py": r'''"""Build query strings and URLs."""

from .escape import quote, unquote
from .parse import parse_qs


def urlencode(params):
    """`{"a": 1, "b": ["x", "y"]}` -> `a=1&b=x&b=y`: a list repeats its key."""
    parts = []
    for key, value in params.items():
        for v in value if isinstance(value, list) else [value]:
            parts.append(f"{quote(str(key))}={quote(str(v))}")
    return "&".join(parts)


def add_params(url, params):
    """`url` with `params` merged into its query; a new value replaces the old ones."""
    base, _, query = url.partition("?")
    merged = parse_qs(query)
    for key, value in params.items():
        merged[key] = value if isinstance(value, list) else [value]
    return f"{base}?{urlencode(merged)}"


def path_of(url):
    """The decoded path of `url`, without its query."""
    return unquote(url.partition("?")[0])
''',
    },
    tests={
        "test_query.py": r"""from @pkg@ import add_params, parse_qs, parse_qsl, path_of, quote, unquote, urlencode


def test_parse_simple():
    assert parse_qs("a=1&b=2") == {"a": ["1"], "b": ["2"]}


def test_repeated_key():
    assert parse_qsl("a=1&a=2") == [("a", "1"), ("a", "2")]


def test_quote_safe_text():
    assert quote("abc-1.0") == "abc-1.0"


def test_unquote_plain():
    assert unquote("abc") == "abc"


def test_urlencode_list():
    assert urlencode({"a": 1, "b": ["x", "y"]}) == "a=1&b=x&b=y"


def test_add_params():
    assert add_params("/s?a=1", {"b": "2"}) == "/s?a=1&b=2"


def test_path_of():
    assert path_of("/docs/intro?x=1") == "/docs/intro"
""",
    },
    sites=(
        Site(
            "escape_skip",
            "off_by_one",
            "escape.py",
            "            i += 3\n",
            "            i += 2\n",
            "unquote() leaves stray characters after each escape",
            'unquote("caf%C3%A9")',
            ('parse_qs("q=%41B")',),
        ),
        Site(
            "hex_base",
            "wrong_operator_or_constant",
            "escape.py",
            "data.append(int(text[i + 1 : i + 3], 16))",
            "data.append(int(text[i + 1 : i + 3], 10))",
            "unquote() decodes percent escapes to the wrong characters",
            'unquote("%41%42")',
            ('parse_qs("path=%2Fhome")',),
        ),
        Site(
            "plus_space",
            "missing_case",
            "escape.py",
            'data.extend(b" " if ch == "+" else ch.encode())',
            "data.extend(ch.encode())",
            "A `+` in a query is not read as a space",
            'parse_qs("q=hello+world")',
            ('unquote(quote("a b"))',),
        ),
        Site(
            "empty_parts",
            "missing_case",
            "parse.py",
            """        if not part:
            continue
""",
            "",
            "parse_qs() invents an empty key for a doubled `&`",
            'parse_qs("a=1&&b=2")',
            ('parse_qs("")',),
        ),
        Site(
            "encode_helper",
            "wrong_cross_module_call",
            "build.py",
            'parts.append(f"{quote(str(key))}={quote(str(v))}")',
            'parts.append(f"{quote(str(key))}={unquote(str(v))}")',
            "urlencode() does not escape values",
            'urlencode({"q": "a b&c"})',
            ('add_params("/s", {"name": "x y"})',),
        ),
        Site(
            "pair_separator",
            "parsing_or_config",
            "parse.py",
            'query.lstrip("?").split("&")',
            'query.lstrip("?").split(";")',
            "parse_qs() runs all parameters together",
            'parse_qs("a=1&b=2&c=3")',
            ('add_params("/s?a=1&b=2", {"c": "3"})',),
        ),
        Site(
            "leading_question_mark",
            "parsing_or_config",
            "parse.py",
            'query.lstrip("?").split',
            "query.split",
            "parse_qs() keeps the `?` in the first key",
            'parse_qs("?page=2")',
        ),
    ),
)
