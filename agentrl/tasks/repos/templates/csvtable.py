"""A CSV-like table: quoted fields, typed cells, column statistics and rendering back to text."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="csvtable",
    about="a small library for CSV tables",
    packages=("csvtable", "tabular", "sheetlite"),
    modules={
        "__init__.py": r'''"""Read, query and write CSV-like tables."""

from .aggregate import column_sum, count_by, mean
from .render import render
from .table import Table, read_table
''',
        "reader.py": r'''"""Split CSV-like text into rows, honouring double quotes."""

DELIMITER = ","


def split_row(line, delimiter=DELIMITER):
    """The fields of one line; a quoted field may hold the delimiter, and `""` in it is a quote."""
    fields, field, quoted, i = [], "", False, 0
    while i < len(line):
        ch = line[i]
        if quoted:
            if ch == '"' and line[i + 1 : i + 2] == '"':
                field += '"'
                i += 1
            elif ch == '"':
                quoted = False
            else:
                field += ch
        elif ch == '"':
            quoted = True
        elif ch == delimiter:
            fields.append(field)
            field = ""
        else:
            field += ch
        i += 1
    fields.append(field)
    return fields


def read_rows(text, delimiter=DELIMITER):
    """The rows of `text`, skipping blank lines."""
    return [split_row(line, delimiter) for line in text.splitlines() if line.strip()]
''',
        "convert.py": r'''"""Cell conversion."""


def convert(field):
    """`field` as an int or a float when it reads as one, None when empty, else the stripped text."""
    text = field.strip()
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text
''',
        "table.py": r'''"""A table: a header row and converted data rows."""

from .convert import convert
from .reader import read_rows


class Table:
    """Rows of a CSV document, addressed by column name."""

    def __init__(self, header, rows):
        self.header = header
        self.rows = rows

    def column(self, name):
        """The cells of column `name`; KeyError for an unknown column."""
        if name not in self.header:
            raise KeyError(name)
        index = self.header.index(name)
        return [row[index] for row in self.rows]

    def where(self, name, value):
        """A new Table of the rows whose column `name` equals `value`."""
        index = self.header.index(name)
        return Table(self.header, [row for row in self.rows if row[index] == value])

    def head(self, n):
        """A new Table of the first `n` rows."""
        return Table(self.header, self.rows[:n])

    def to_dicts(self):
        return [dict(zip(self.header, row)) for row in self.rows]


def read_table(text, delimiter=","):
    """A Table of `text`; its first row is the header."""
    rows = read_rows(text, delimiter)
    header = [name.strip() for name in rows[0]]
    return Table(header, [[convert(field) for field in row] for row in rows[1:]])
''',
        "aggregate.py": r'''"""Column statistics; empty and text cells are skipped."""


def numbers(cells):
    return [c for c in cells if isinstance(c, (int, float))]


def column_sum(table, name):
    return sum(numbers(table.column(name)))


def mean(table, name):
    """The mean of the numeric cells of column `name`; None when there are none."""
    values = numbers(table.column(name))
    if not values:
        return None
    return sum(values) / len(values)


def count_by(table, name):
    """{cell: rows holding it} for column `name`, in first-seen order."""
    counts = {}
    for cell in table.column(name):
        counts[cell] = counts.get(cell, 0) + 1
    return counts
''',
        "render.py": r'''"""Write a Table back as CSV text."""


def quote(cell, delimiter):
    """A cell as CSV: None is empty; text holding the delimiter or a quote is quoted."""
    if cell is None:
        return ""
    text = str(cell)
    if delimiter in text or '"' in text:
        return '"' + text.replace('"', '""') + '"'
    return text


def render(table, delimiter=","):
    lines = [delimiter.join(table.header)]
    for row in table.rows:
        lines.append(delimiter.join(quote(cell, delimiter) for cell in row))
    return "\n".join(lines)
''',
    },
    tests={
        "test_table.py": r"""from @pkg@ import column_sum, mean, read_table, render


def test_columns():
    t = read_table("name,age\nann,31\nbob,42")
    assert t.column("age") == [31, 42]


def test_quoted_delimiter():
    assert read_table('a,b\n"x,y",2').column("a") == ["x,y"]


def test_where():
    t = read_table("k,v\na,1\nb,2\na,3")
    assert t.where("k", "a").column("v") == [1, 3]


def test_sum_skips_text():
    assert column_sum(read_table("v\n1\nx\n2"), "v") == 3


def test_mean():
    assert mean(read_table("v\n2\n4"), "v") == 3


def test_render_round_trip():
    text = 'a,b\n"x,y",2'
    assert render(read_table(text)) == text


def test_unknown_column():
    try:
        read_table("a\n1").column("z")
    except KeyError:
        return
    raise AssertionError("no KeyError")
""",
    },
    sites=(
        Site(
            "head_rows",
            "off_by_one",
            "table.py",
            "return Table(self.header, self.rows[:n])",
            "return Table(self.header, self.rows[: n - 1])",
            "head(n) returns one row too few",
            'read_table("v\\n1\\n2\\n3").head(2).column("v")',
            ('len(read_table("a\\nx\\ny").head(5).rows)',),
        ),
        Site(
            "mean_division",
            "wrong_operator_or_constant",
            "aggregate.py",
            "return sum(values) / len(values)",
            "return sum(values) // len(values)",
            "mean() drops the fractional part",
            'mean(read_table("v\\n1\\n2"), "v")',
            ('mean(read_table("v\\n1.5\\n2\\n"), "v")',),
        ),
        Site(
            "count_start",
            "wrong_operator_or_constant",
            "aggregate.py",
            "counts[cell] = counts.get(cell, 0) + 1",
            "counts[cell] = counts.get(cell, 1) + 1",
            "count_by() over-counts every value",
            'count_by(read_table("k\\na\\nb\\na"), "k")',
        ),
        Site(
            "doubled_quote",
            "missing_case",
            "reader.py",
            """            if ch == '"' and line[i + 1 : i + 2] == '"':
                field += '"'
                i += 1
            elif ch == '"':""",
            """            if ch == '"':""",
            "A doubled quote inside a quoted field disappears",
            'read_table(\'name\\n"say ""hi"""\').column("name")',
            ('render(read_table(\'a\\n"x""y"\'))',),
        ),
        Site(
            "empty_cell",
            "missing_case",
            "convert.py",
            """    if text == "":
        return None
""",
            "",
            "Empty cells come back as empty strings",
            'read_table("a,b\\n1,").column("b")',
            ('read_table("a,b\\n,2").to_dicts()',),
        ),
        Site(
            "delimiter_arg",
            "wrong_cross_module_call",
            "table.py",
            "rows = read_rows(text, delimiter)",
            "rows = read_rows(text)",
            "read_table() ignores the delimiter it is given",
            'read_table("a;b\\n1;2", delimiter=";").to_dicts()',
            ('read_table("x|y\\n3|4", "|").column("y")',),
        ),
        Site(
            "header_spaces",
            "parsing_or_config",
            "table.py",
            "header = [name.strip() for name in rows[0]]",
            "header = list(rows[0])",
            "column() cannot find a column whose header follows a space",
            'read_table("a, b\\n1, 2").column("b")',
            ('read_table("x ,y\\n1,2").header',),
        ),
    ),
)
