"""A text wrapper: greedy wrapping, paragraphs, justification and centring."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="wraptext",
    about="a small text-wrapping library",
    packages=("wraptext", "linebreak", "textfill"),
    params={"WIDTH": ("70", "72", "78", "80")},
    modules={
        "__init__.py": r'''"""Wrap, justify and centre plain text."""

from .align import center, justify
from .paragraphs import fill_paragraphs
from .wrap import fill, wrap
''',
        "words.py": r'''"""Words and their lengths."""


def split_words(text):
    """The words of `text`, split on runs of whitespace."""
    return text.split()


def line_length(words):
    """The length of `words` joined by single spaces."""
    if not words:
        return 0
    return sum(len(w) for w in words) + len(words) - 1
''',
        "wrap.py": r'''"""Greedy line wrapping."""

from .words import line_length, split_words

DEFAULT_WIDTH = @WIDTH@


def wrap(text, width=DEFAULT_WIDTH):
    """Break `text` into lines of at most `width` characters; a longer word gets a line of its own."""
    if width < 1:
        raise ValueError("width must be at least 1")
    lines, current = [], []
    for word in split_words(text):
        if current and line_length([*current, word]) > width:
            lines.append(current)
            current = []
        current.append(word)
    if current:
        lines.append(current)
    return [" ".join(line) for line in lines]


def fill(text, width=DEFAULT_WIDTH):
    """The lines of `wrap` joined by newlines."""
    return "\n".join(wrap(text, width))
''',
        "paragraphs.py": r'''"""Paragraph-aware filling: blank lines separate paragraphs."""

from .wrap import fill


def split_paragraphs(text):
    """The non-empty paragraphs of `text`."""
    return [p for p in text.split("\n\n") if p.strip()]


def fill_paragraphs(text, width=40):
    """Fill each paragraph on its own, keeping a blank line between them."""
    return "\n\n".join(fill(p, width) for p in split_paragraphs(text))
''',
        "align.py": r'''"""Justified and centred lines."""

from .words import line_length, split_words


def pad(text, left, right):
    """`text` with `left` spaces before it and `right` after it."""
    return " " * left + text + " " * right


def center(line, width):
    """`line` centred in `width` columns; an odd leftover space goes to the right."""
    spare = max(width - len(line), 0)
    left = spare // 2
    return pad(line, left, spare - left)


def justify(line, width):
    """Stretch `line` to `width` by widening its gaps, the leftmost gaps first."""
    words = split_words(line)
    gaps = len(words) - 1
    if gaps < 1:
        return line
    extra, rest = divmod(width - line_length(words), gaps)
    out = words[0]
    for i, word in enumerate(words[1:]):
        out += " " * (1 + extra + (1 if i < rest else 0)) + word
    return out
''',
    },
    tests={
        "test_wrap.py": r"""from @pkg@ import center, fill, fill_paragraphs, justify, wrap


def test_wrap_breaks_long_text():
    assert wrap("one two three four", 9) == ["one two", "three", "four"]


def test_long_word_gets_its_own_line():
    assert wrap("a supercalifragilistic b", 5) == ["a", "supercalifragilistic", "b"]


def test_fill_joins_lines():
    assert fill("aa bb cc", 4) == "aa\nbb\ncc"


def test_short_text_is_one_line():
    assert wrap("hello world") == ["hello world"]


def test_paragraphs_stay_apart():
    assert fill_paragraphs("a b\n\nc d", 10) == "a b\n\nc d"


def test_center_even():
    assert center("ab", 6) == "  ab  "


def test_justify_even_gaps():
    assert justify("a b c", 7) == "a  b  c"
""",
    },
    sites=(
        Site(
            "exact_fit",
            "off_by_one",
            "words.py",
            "return sum(len(w) for w in words) + len(words) - 1",
            "return sum(len(w) for w in words) + len(words)",
            "wrap() breaks a line that would exactly fill the width",
            'wrap("aaa bbb", 7)',
            ('wrap("ab cd ef gh", 5)', 'justify("a b c", 5)'),
        ),
        Site(
            "gap_share",
            "wrong_operator_or_constant",
            "align.py",
            "(1 if i < rest else 0)",
            "(1 if i <= rest else 0)",
            "justify() makes lines longer than the width",
            'justify("a b c d", 8)',
            ('len(justify("one two three", 16))',),
        ),
        Site(
            "zero_width",
            "missing_case",
            "wrap.py",
            """    if width < 1:
        raise ValueError("width must be at least 1")
""",
            "",
            "wrap() accepts a width of 0 instead of rejecting it",
            'wrap("a b", 0)',
            ('fill("x", -3)',),
        ),
        Site(
            "center_sides",
            "wrong_cross_module_call",
            "align.py",
            "return pad(line, left, spare - left)",
            "return pad(line, spare - left, left)",
            "center() puts the odd leftover space on the left",
            'center("abc", 6)',
            ('center("x", 4)',),
        ),
        Site(
            "paragraph_split",
            "parsing_or_config",
            "paragraphs.py",
            'text.split("\\n\\n")',
            'text.split("\\n")',
            "fill_paragraphs() does not join the lines of a paragraph",
            'fill_paragraphs("a\\nb\\n\\nc", 10)',
            ('fill_paragraphs("one\\ntwo three", 20)',),
        ),
        Site(
            "default_width",
            "parsing_or_config",
            "wrap.py",
            "def fill(text, width=DEFAULT_WIDTH):",
            "def fill(text, width=DEFAULT_WIDTH - 10):",
            "fill() without a width wraps text shorter than wrap() does",
            'len(fill("word " * 40).splitlines()[0])',
        ),
    ),
)
