"""A templating engine: `{{ name }}` tags, dotted lookups, filters with arguments, and comments."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="minitemplate",
    about="a small text templating engine",
    packages=("minitemplate", "stencil", "tmplkit"),
    modules={
        "__init__.py": r'''"""Render `{{ name|filter:arg }}` templates."""

from .filters import apply_filter
from .lexer import tokenize
from .render import render
''',
        "lexer.py": r'''"""Split template text into literal text and `{{ ... }}` tags."""

OPEN, CLOSE = "{{", "}}"


def tokenize(source):
    """[("text", s) or ("tag", inner)] of `source`; ValueError for an unclosed tag."""
    tokens, pos = [], 0
    while True:
        start = source.find(OPEN, pos)
        if start == -1:
            break
        end = source.find(CLOSE, start)
        if end == -1:
            raise ValueError(f"unclosed tag at {start}")
        if start > pos:
            tokens.append(("text", source[pos:start]))
        tokens.append(("tag", source[start + 2 : end].strip()))
        pos = end + 2
    if pos < len(source):
        tokens.append(("text", source[pos:]))
    return tokens
''',
        "lookup.py": r'''"""Dotted names: `user.name` reads a key of a dict or an attribute of an object."""


def resolve(context, name):
    """The value of dotted `name` in `context`; None when a part is missing."""
    value = context
    for part in name.split("."):
        if isinstance(value, dict):
            value = value.get(part)
        else:
            value = getattr(value, part, None)
        if value is None:
            return None
    return value
''',
        "filters.py": r'''"""Filters: `{{ name|upper }}`, `{{ n|default:0 }}`, `{{ text|truncate:10 }}`."""


def apply_filter(value, name, arg):
    if name == "upper":
        return str(value).upper()
    if name == "lower":
        return str(value).lower()
    if name == "default":
        return arg if value in (None, "") else value
    if name == "truncate":
        n = int(arg)
        text = str(value)
        return text if len(text) <= n else text[: n - 3] + "..."
    raise ValueError(f"unknown filter {name!r}")
''',
        "render.py": r'''"""Render a template with a context."""

from .filters import apply_filter
from .lexer import tokenize
from .lookup import resolve


def render(source, context):
    """`source` with each tag replaced by its value; `{{# ... }}` is a comment."""
    out = []
    for kind, value in tokenize(source):
        if kind == "text":
            out.append(value)
        elif not value.startswith("#"):
            out.append(str(evaluate(value, context)))
    return "".join(out)


def evaluate(expr, context):
    """The value of `name|filter:arg|...`."""
    name, *filters = [part.strip() for part in expr.split("|")]
    value = resolve(context, name)
    for f in filters:
        fname, _, arg = f.partition(":")
        value = apply_filter(value, fname.strip(), arg.strip().strip('"'))
    return value
''',
    },
    tests={
        "test_render.py": r"""from @pkg@ import render, tokenize


def test_plain_text():
    assert render("hello", {}) == "hello"


def test_variable():
    assert render("Hi {{ name }}!", {"name": "Ann"}) == "Hi Ann!"


def test_upper():
    assert render("{{ x|upper }}", {"x": "ab"}) == "AB"


def test_tokens():
    assert tokenize("a{{b}}") == [("text", "a"), ("tag", "b")]


def test_unclosed():
    try:
        render("{{ x", {})
    except ValueError:
        return
    raise AssertionError("no ValueError")
""",
    },
    sites=(
        Site(
            "tag_end",
            "off_by_one",
            "lexer.py",
            "        pos = end + 2\n",
            "        pos = end + 1\n",
            "A stray brace follows every substituted value",
            'render("Hi {{ name }}!", {"name": "Ann"})',
            ('render("{{a}}{{b}}", {"a": 1, "b": 2})',),
        ),
        Site(
            "truncate_room",
            "wrong_operator_or_constant",
            "filters.py",
            "text[: n - 3]",
            "text[:n]",
            "truncate makes text longer than the limit",
            'render("{{ t|truncate:8 }}", {"t": "abcdefghijkl"})',
        ),
        Site(
            "empty_default",
            "missing_case",
            "filters.py",
            'value in (None, "")',
            "value is None",
            "default does not replace an empty string",
            'render("{{ nick|default:anon }}", {"nick": ""})',
        ),
        Site(
            "comment_tag",
            "missing_case",
            "render.py",
            'elif not value.startswith("#"):',
            "else:",
            "Comments show up in the output",
            'render("a{{# note }}b", {})',
        ),
        Site(
            "filter_args",
            "wrong_cross_module_call",
            "render.py",
            "value = apply_filter(value, fname.strip(), arg.strip().strip('\"'))",
            "value = apply_filter(fname.strip(), value, arg.strip().strip('\"'))",
            "Every filter fails",
            'render("{{ x|lower }}", {"x": "AB"})',
        ),
        Site(
            "filter_arg_separator",
            "parsing_or_config",
            "render.py",
            'fname, _, arg = f.partition(":")',
            'fname, _, arg = f.partition("=")',
            "Filters with an argument are rejected",
            'render("{{ n|default:0 }}", {})',
        ),
        Site(
            "dotted",
            "parsing_or_config",
            "lookup.py",
            'for part in name.split("."):',
            'for part in name.split(":"):',
            "Dotted names render as None",
            'render("{{ user.name }}", {"user": {"name": "Bo"}})',
        ),
    ),
)
