"""A Markdown table renderer: cell text, column widths, alignment markers and padding."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="mdtable",
    about="a Markdown table renderer",
    packages=("mdtable", "tablemark", "pipetable"),
    modules={
        "__init__.py": r'''"""Render rows as Markdown tables."""

from .align import pad, parse_align, separator
from .cells import cell_text
from .render import render, render_dicts
''',
        "cells.py": r'''"""Cell text."""


def escape(text):
    """`text` with `|` escaped, so it does not end the cell."""
    return text.replace("|", "\\|")


def cell_text(value):
    """How a value shows: None is empty, a float has two decimals, other values are escaped text."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return escape(str(value))


def width(texts, minimum=3):
    """A column's width: its longest text, at least `minimum` (a separator needs three dashes)."""
    return max([minimum, *(len(t) for t in texts)])
''',
        "align.py": r'''"""Alignment: padding cells and separator markers."""

ALIGN = {"l": "left", "r": "right", "c": "center"}


def parse_align(spec, n):
    """Alignments of `n` columns from a spec such as "lrc"; columns past the spec are left-aligned."""
    return [ALIGN[ch] for ch in spec.lower()] + ["left"] * (n - len(spec))


def pad(text, width, align):
    """`text` padded to `width`: "left", "right" or "center" (an odd space goes right)."""
    gap = width - len(text)
    if align == "right":
        return " " * gap + text
    if align == "center":
        left = gap // 2
        return " " * left + text + " " * (gap - left)
    return text + " " * gap


def separator(width, align):
    """The dashes under a header cell, with colons marking the alignment."""
    if align == "right":
        return "-" * (width - 1) + ":"
    if align == "center":
        return ":" + "-" * (width - 2) + ":"
    return "-" * width
''',
        "render.py": r'''"""Render rows as a Markdown table."""

from .align import pad, parse_align, separator
from .cells import cell_text, escape, width


def render(header, rows, align=""):
    """A Markdown table of `rows` (lists of values) under `header`; `align` as in `parse_align`."""
    aligns = parse_align(align, len(header))
    texts = [[cell_text(v) for v in row] for row in [header, *rows]]
    widths = [width(column) for column in zip(*texts)]
    lines = [_line(texts[0], widths, aligns)]
    lines.append("| " + " | ".join(separator(w, a) for w, a in zip(widths, aligns)) + " |")
    lines += [_line(row, widths, aligns) for row in texts[1:]]
    return "\n".join(lines)


def _line(cells, widths, aligns):
    return "| " + " | ".join(pad(c, w, a) for c, w, a in zip(cells, widths, aligns)) + " |"


def render_dicts(records, columns, align=""):
    """`render` of dicts, one row each, with `columns` as the header; a missing key is an empty cell."""
    return render(columns, [[r.get(c) for c in columns] for r in records], align)
''',
    },
    tests={
        "test_render.py": r"""from @pkg@ import cell_text, pad, render


def test_simple_table():
    assert render(["a", "b"], [["x", "y"]]) == "| a   | b   |\n| --- | --- |\n| x   | y   |"


def test_right_align():
    assert render(["n"], [[1]], "r") == "|   n |\n| --: |\n|   1 |"


def test_wide_cell():
    assert render(["name"], [["alice"]]).splitlines()[1] == "| ----- |"


def test_int_cell():
    assert cell_text(7) == "7"


def test_pad_left():
    assert pad("ab", 4, "left") == "ab  "
""",
    },
    sites=(
        Site(
            "center_dashes",
            "off_by_one",
            "align.py",
            'return ":" + "-" * (width - 2) + ":"',
            'return ":" + "-" * (width - 1) + ":"',
            "The separator of a centred column is too long",
            'render(["name"], [["bob"]], "c").splitlines()[1]',
        ),
        Site(
            "float_digits",
            "wrong_operator_or_constant",
            "cells.py",
            'return f"{value:.2f}"',
            'return f"{value:.1f}"',
            "Float cells lose their second decimal",
            'render(["price"], [[2.25]])',
            ("cell_text(0.5)",),
        ),
        Site(
            "center_pad",
            "missing_case",
            "align.py",
            """    if align == "center":
        left = gap // 2
        return " " * left + text + " " * (gap - left)
""",
            "",
            "Centred columns are rendered left-aligned",
            'render(["x"], [["a"]], "c")',
            ('pad("ab", 6, "center")',),
        ),
        Site(
            "cell_helper",
            "wrong_cross_module_call",
            "render.py",
            "texts = [[cell_text(v) for v in row] for row in [header, *rows]]",
            "texts = [[escape(str(v)) for v in row] for row in [header, *rows]]",
            "render() prints None for missing values",
            'render_dicts([{"a": 1}, {"b": 2}], ["a", "b"])',
            ('render(["v"], [[1.5]])',),
        ),
        Site(
            "align_case",
            "parsing_or_config",
            "align.py",
            "for ch in spec.lower()]",
            "for ch in spec]",
            "render() fails when the alignment is given in capitals",
            'render(["a", "b"], [[1, 2]], "LR")',
        ),
    ),
)
