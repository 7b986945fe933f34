"""A matrix helper: vectors and matrices as lists, products, powers, determinants, and text I/O."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="matrix",
    about="a small matrix library on plain lists",
    packages=("matrixlib", "linalg2", "gridmath"),
    modules={
        "__init__.py": r'''"""Matrices as lists of rows."""

from .matrix import identity, multiply, shape, transpose
from .ops import determinant, power, trace
from .text import format_matrix, parse_matrix
from .vector import add, dot, scale
''',
        "vector.py": r'''"""Vectors as lists of numbers."""


def dot(a, b):
    if len(a) != len(b):
        raise ValueError("length mismatch")
    return sum(x * y for x, y in zip(a, b))


def add(a, b):
    return [x + y for x, y in zip(a, b)]


def scale(a, k):
    return [k * x for x in a]
''',
        "matrix.py": r'''"""Matrices as lists of rows."""

from .vector import dot


def shape(m):
    return (len(m), len(m[0]) if m else 0)


def identity(n):
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]


def transpose(m):
    rows, cols = shape(m)
    return [[m[i][j] for i in range(rows)] for j in range(cols)]


def column(m, j):
    return [row[j] for row in m]


def multiply(a, b):
    """The product of `a` and `b`; ValueError when the shapes do not fit."""
    if shape(a)[1] != shape(b)[0]:
        raise ValueError(f"cannot multiply {shape(a)} by {shape(b)}")
    return [[dot(row, column(b, j)) for j in range(shape(b)[1])] for row in a]
''',
        "ops.py": r'''"""Powers, traces and determinants of square matrices."""

from .matrix import identity, multiply, shape


def power(m, k):
    """`m` multiplied by itself `k` times (k >= 0); the identity for k = 0."""
    if k < 0:
        raise ValueError("negative power")
    result = identity(shape(m)[0])
    for _ in range(k):
        result = multiply(result, m)
    return result


def trace(m):
    return sum(m[i][i] for i in range(min(shape(m))))


def determinant(m):
    """By cofactor expansion along the first row."""
    n = shape(m)[0]
    if n == 1:
        return m[0][0]
    if n == 2:
        return m[0][0] * m[1][1] - m[0][1] * m[1][0]
    total = 0
    for j in range(n):
        minor = [row[:j] + row[j + 1 :] for row in m[1:]]
        total += (-1) ** j * m[0][j] * determinant(minor)
    return total
''',
        "text.py": r'''"""Matrices as text: rows separated by ";" or newlines, numbers by spaces or commas."""


def parse_matrix(text):
    """`"1 2; 3 4"` -> [[1, 2], [3, 4]]; ValueError for rows of different lengths."""
    rows = []
    for line in text.replace(";", "\n").splitlines():
        if line.strip():
            rows.append([_number(x) for x in line.replace(",", " ").split()])
    if any(len(r) != len(rows[0]) for r in rows):
        raise ValueError("rows differ in length")
    return rows


def _number(text):
    value = float(text)
    return int(value) if value.is_integer() else value


def format_matrix(m):
    return "; ".join(" ".join(str(x) for x in row) for row in m)
''',
    },
    tests={
        "test_matrix.py": r"""from @pkg@ import determinant, identity, multiply, parse_matrix, power, trace, transpose


def test_parse():
    assert parse_matrix("1 2\n3 4") == [[1, 2], [3, 4]]


def test_identity():
    assert identity(2) == [[1, 0], [0, 1]]


def test_transpose():
    assert transpose([[1, 2, 3]]) == [[1], [2], [3]]


def test_multiply_by_identity():
    m = [[1, 2], [3, 4]]
    assert multiply(m, identity(2)) == m


def test_trace():
    assert trace([[1, 2], [3, 4]]) == 5


def test_power_zero():
    assert power([[2, 0], [0, 2]], 0) == identity(2)


def test_determinant_of_identity():
    assert determinant(identity(3)) == 1


def test_shape_mismatch():
    try:
        multiply([[1, 2]], [[1, 2]])
    except ValueError:
        return
    raise AssertionError("no ValueError")
""",
    },
    sites=(
        Site(
            "power_loop",
            "off_by_one",
            "ops.py",
            "    for _ in range(k):",
            "    for _ in range(k - 1):",
            "power(m, k) multiplies one time too few",
            "power([[1, 1], [0, 1]], 3)",
            ("power([[2]], 1)",),
        ),
        Site(
            "det_sign",
            "wrong_operator_or_constant",
            "ops.py",
            "return m[0][0] * m[1][1] - m[0][1] * m[1][0]",
            "return m[0][0] * m[1][1] + m[0][1] * m[1][0]",
            "determinant() is wrong for 2x2 matrices",
            "determinant([[1, 2], [3, 4]])",
            ("determinant([[2, 0, 1], [1, 3, 2], [1, 1, 1]])",),
        ),
        Site(
            "det_one",
            "missing_case",
            "ops.py",
            """    if n == 1:
        return m[0][0]
""",
            "",
            "determinant() of a 1x1 matrix is 0",
            "determinant([[5]])",
            ("determinant([[2, 0, 1], [1, 3, 2], [1, 1, 1]])",),
        ),
        Site(
            "ragged_rows",
            "missing_case",
            "text.py",
            """    if any(len(r) != len(rows[0]) for r in rows):
        raise ValueError("rows differ in length")
""",
            "",
            "parse_matrix() accepts rows of different lengths",
            'parse_matrix("1 2; 3")',
        ),
        Site(
            "column_call",
            "wrong_cross_module_call",
            "matrix.py",
            "dot(row, column(b, j))",
            "dot(row, b[j])",
            "multiply() gives the wrong product",
            "multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]])",
            ("multiply([[1, 0]], [[1, 2], [3, 4]])",),
        ),
        Site(
            "row_separator",
            "parsing_or_config",
            "text.py",
            'text.replace(";", "\\n")',
            'text.replace(",", "\\n")',
            "parse_matrix() fails on rows separated by semicolons",
            'parse_matrix("1 2; 3 4")',
            ('parse_matrix("1,2;3,4")',),
        ),
    ),
)
