"""A calculator: a tokenizer, a shunting-yard parser to reverse Polish notation, and an evaluator."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="calc",
    about="an arithmetic expression calculator",
    packages=("calc", "arith", "mathexpr"),
    modules={
        "__init__.py": r'''"""Evaluate arithmetic expressions such as "2 * (3 + 4) ^ 2"."""

from .evaluate import calculate, eval_rpn
from .parser import to_rpn
from .tokens import tokenize
''',
        "tokens.py": r'''"""Split arithmetic text into numbers, operators and parentheses."""

OPERATORS = "+-*/^"


def tokenize(text):
    """Tokens of `text`: floats for numbers, one-character strings for the rest."""
    tokens, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch.isdigit() or ch == ".":
            j = i
            while j < len(text) and (text[j].isdigit() or text[j] == "."):
                j += 1
            tokens.append(float(text[i:j]))
            i = j
        elif ch in OPERATORS or ch in "()":
            tokens.append(ch)
            i += 1
        else:
            raise ValueError(f"unexpected {ch!r} at {i}")
    return tokens
''',
        "parser.py": r'''"""Shunting-yard: infix tokens to reverse Polish notation."""

PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "^": 3}
RIGHT_ASSOCIATIVE = {"^"}


def binds_first(top, op):
    """Whether operator `top`, on the stack, applies before `op`."""
    if op in RIGHT_ASSOCIATIVE:
        return PRECEDENCE[top] > PRECEDENCE[op]
    return PRECEDENCE[top] >= PRECEDENCE[op]


def to_rpn(tokens):
    """`tokens` in postfix order; ValueError for unbalanced parentheses."""
    out, stack = [], []
    for tok in tokens:
        if isinstance(tok, float):
            out.append(tok)
        elif tok == "(":
            stack.append(tok)
        elif tok == ")":
            while stack and stack[-1] != "(":
                out.append(stack.pop())
            if not stack:
                raise ValueError("unbalanced ')'")
            stack.pop()
        else:
            while stack and stack[-1] != "(" and binds_first(stack[-1], tok):
                out.append(stack.pop())
            stack.append(tok)
    while stack:
        if stack[-1] == "(":
            raise ValueError("unbalanced '('")
        out.append(stack.pop())
    return out
''',
        "ops.py": r'''"""The binary operators."""


def apply(op, a, b):
    """`a op b`."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return a / b
    return a**b
''',
        "evaluate.py": r'''"""Evaluate reverse Polish notation."""

from .ops import apply
from .parser import to_rpn
from .tokens import tokenize


def eval_rpn(rpn):
    stack = []
    for tok in rpn:
        if isinstance(tok, float):
            stack.append(tok)
        else:
            b, a = stack.pop(), stack.pop()
            stack.append(apply(tok, a, b))
    if len(stack) != 1:
        raise ValueError("malformed expression")
    return stack[0]


def calculate(text):
    """The value of arithmetic `text`; a whole number comes back as an int."""
    value = eval_rpn(to_rpn(tokenize(text)))
    return int(value) if value == int(value) else value
''',
    },
    tests={
        "test_calc.py": r"""from @pkg@ import calculate, to_rpn, tokenize


def test_tokenize():
    assert tokenize("3 + 4.5") == [3.0, "+", 4.5]


def test_add():
    assert calculate("1 + 2") == 3


def test_parentheses():
    assert calculate("(1 + 2) * 3") == 9


def test_float_result():
    assert calculate("1 / 4") == 0.25


def test_rpn():
    assert to_rpn(tokenize("1 + 2")) == [1.0, 2.0, "+"]


def test_unbalanced():
    try:
        calculate("(1 + 2")
    except ValueError:
        return
    raise AssertionError("no ValueError")


def test_bad_character():
    try:
        tokenize("2 $ 3")
    except ValueError:
        return
    raise AssertionError("no ValueError")
""",
    },
    sites=(
        Site(
            "last_digit",
            "off_by_one",
            "tokens.py",
            "while j < len(text) and",
            "while j < len(text) - 1 and",
            "calculate() gets the last number of an expression wrong",
            'calculate("12 + 34")',
            ('tokenize("7*10")',),
        ),
        Site(
            "product_precedence",
            "wrong_operator_or_constant",
            "parser.py",
            '"*": 2,',
            '"*": 1,',
            "Multiplication does not bind tighter than addition",
            'calculate("2 + 3 * 4")',
            ('to_rpn(tokenize("1 + 2 * 3"))',),
        ),
        Site(
            "left_associative",
            "wrong_operator_or_constant",
            "parser.py",
            "return PRECEDENCE[top] >= PRECEDENCE[op]",
            "return PRECEDENCE[top] > PRECEDENCE[op]",
            "Chained subtraction groups from the right",
            'calculate("8 - 3 - 2")',
            ('calculate("16 / 4 / 2")',),
        ),
        Site(
            "right_associative",
            "missing_case",
            "parser.py",
            """    if op in RIGHT_ASSOCIATIVE:
        return PRECEDENCE[top] > PRECEDENCE[op]
""",
            "",
            "Chained powers are evaluated left to right",
            'calculate("2 ^ 3 ^ 2")',
        ),
        Site(
            "operand_order",
            "wrong_cross_module_call",
            "evaluate.py",
            "stack.append(apply(tok, a, b))",
            "stack.append(apply(tok, b, a))",
            "Subtraction and division give wrong results",
            'calculate("7 - 2")',
            ('calculate("8 / 2")',),
        ),
        Site(
            "power_token",
            "parsing_or_config",
            "tokens.py",
            'OPERATORS = "+-*/^"',
            'OPERATORS = "+-*/"',
            "calculate() rejects the ^ operator",
            'calculate("2 ^ 10")',
        ),
    ),
)
