"""Value tests from a generated repository's pytest tests: grading that its package cannot tamper with.

pytest runs the package it grades in its own process, so the package can rewrite the verdict (patch pytest's
reports on import, say). A `ValueTest` (`agentrl.tasks.base`) splits a test instead: its code runs beside the
package, in the grader's worker, and reports only the plain value of each checked expression; the grader, which
alone holds what the original package gave for each, judges (`sandboxes/programs/grader.py`). The package can
change what its process reports, but passing takes the expected values, which it can only learn by computing them.

A test function becomes the function `test()` of its file's other top-level code (imports, constants, helpers;
`import pytest` left out), its asserts turned into checks, each a call `__agentrl_check__(thunk, compare)`:

- `assert A == B` / `assert A is B`: A is checked (B, when A is a literal), by `==` / `is`;
- `assert _plain(A) == V` (the hidden tests' helper): A, by `==` (the grader's encoding takes plain data only);
- `assert X`, `assert not X`: X's truth; `assert X and not Y`: each operand;
- `assert all(E for ...)` (`any`): the list of the E's, each checked as E alone would be;
- `with pytest.raises(E): body`, and `try: body / except E: return / raise AssertionError(...)`: the body must
  raise E (or a subclass).

The expected outcomes are the original package's, computed here by running the same code on it (trusted template
code, in this process, as `sessions` does) through the grader's own `run_checks`: one definition of what a test
reports, on the host and in the sandbox. Other statements are the test's own steps, run as they are (a `try` that
catches what a step raises included); a test of another shape (a fixture, a marker, a method, an assert inside a
function it defines) is refused with ValueError when the instance is generated, as is one that fails on the
original.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import itertools
from collections.abc import Mapping, Sequence
from types import ModuleType

from agentrl.sandbox.image import sandboxes_dir
from agentrl.tasks.base import ValueCheck, ValueTest
from agentrl.tasks.repos.sessions import alias_imports, loaded

CHECK = "__agentrl_check__"


@functools.cache
def grader() -> ModuleType:
    """sandboxes/programs/grader.py as a module of this process (it is a standard-library program the host sends
    into sandboxes): its `run_checks`, `judge_values` and codec."""
    spec = importlib.util.spec_from_file_location("agentrl_grader", sandboxes_dir() / "programs" / "grader.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def value_tests(
    files: Mapping[str, str], nodes: Sequence[str], original: Mapping[str, str], pkg: str
) -> dict[str, ValueTest]:
    """node id -> `ValueTest` for each of `nodes` (`tests/test_x.py::test_y`) of the test files in `files`, with
    the outcomes the package `pkg` of `original` gives. ValueError for a test of another shape, or one that raises
    or errs on the original. The tests must pass on the original: an assert's other side is not evaluated (`A == 3`
    expects what A gave); `generate` runs the visible tests on it and builds the hidden ones from its values."""
    parsed: dict[str, ast.Module] = {}  # each file once: the tests of a file share its top-level statements
    modules = {}
    for node in nodes:
        path = node.partition("::")[0]
        if path not in files:
            raise ValueError(f"{node}: no such test file")
        if path not in parsed:
            parsed[path] = ast.parse(files[path])
        modules[node] = _test_module(parsed[path], node)
    codes = {node: ast.unparse(module) + "\n" for node, module in modules.items()}
    with loaded(original, pkg) as package:
        for path, tree in parsed.items():  # the trees, now that the codes are written: run here on the alias
            alias_imports(tree, pkg, package.__name__, path)
        reports = {node: grader().run_checks(module) for node, module in modules.items()}
    tests = {}
    for node, report in reports.items():
        if report["error"] is not None or any("unplain" in o for o in report["outcomes"]):
            raise ValueError(f"{node} does not pass on the original package: {report}")
        tests[node] = ValueTest(code=codes[node], checks=[_expected(node, o) for o in report["outcomes"]])
    return tests


def judge(test: ValueTest, files: Mapping[str, str], pkg: str) -> bool:
    """Whether `test` passes on the package `pkg` of `files`, judged as the grader judges (for validating
    instances on this machine)."""
    tree = ast.parse(test.code)
    with loaded(files, pkg) as package:
        alias_imports(tree, pkg, package.__name__, "<value test>")
        report = grader().run_checks(tree)
    try:
        grader().judge_values([c.model_dump() for c in test.checks], report)
    except AssertionError:
        return False
    return True


def _expected(node: str, outcome: dict) -> ValueCheck:
    if outcome["compare"] == "raises":
        if "raised" not in outcome:
            raise ValueError(f"{node}: the original package raises nothing where the test expects it to")
        return ValueCheck(raised=outcome["raised"][0])
    if "raised" in outcome:
        raise ValueError(f"{node}: an assert raises {outcome['raised'][0]} on the original package")
    return ValueCheck(compare=outcome["compare"], value=outcome["value"])


def _test_module(tree: ast.Module, node: str) -> ast.Module:
    """The value test of the pytest test `node` of the file `tree` (see the module's docstring): the file's other
    top-level statements (shared with `tree`, not copied) and `test()`."""
    name = node.partition("::")[2]
    if "::" in name:
        raise ValueError(f"{node}: only top-level test functions become value tests, not methods")
    target = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if target is None:
        raise ValueError(f"{node}: no such test function")
    if target.args.args or target.decorator_list:
        raise ValueError(f"{node}: a test with fixtures or markers cannot become a value test")
    keep = [n for n in tree.body if not _is_test(n) and not _imports_pytest(n) and not _is_plain_helper(n)]
    body = _statements(target.body, node, itertools.count()) or [ast.Pass()]
    test = ast.FunctionDef(name="test", args=_no_args(), body=body, decorator_list=[], returns=None, type_params=[])
    return ast.fix_missing_locations(ast.Module(body=[*keep, test], type_ignores=[]))


def _is_plain_helper(node: ast.stmt) -> bool:
    """The hidden tests' `_plain`: every call of it is unwrapped (`_unwrapped`), so its definition is dead here."""
    return isinstance(node, ast.FunctionDef) and node.name == "_plain"


def _is_test(node: ast.stmt) -> bool:
    return isinstance(node, ast.FunctionDef) and node.name.startswith("test")


def _imports_pytest(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == "pytest" for a in node.names)
    return isinstance(node, ast.ImportFrom) and node.module == "pytest"


def _no_args() -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])


def _check(thunk: ast.expr, compare: str) -> ast.stmt:
    return ast.Expr(ast.Call(ast.Name(CHECK, ast.Load()), [thunk, ast.Constant(compare)], []))


def _statements(body: list[ast.stmt], node: str, counter: itertools.count) -> list[ast.stmt]:
    """`body` with its asserts and expected raises turned into checks (nested blocks too)."""
    out: list[ast.stmt] = []
    skip = False
    for k, stmt in enumerate(body):
        if skip:
            skip = False
            continue
        if isinstance(stmt, ast.Assert):
            out += [_check(ast.Lambda(_no_args(), expr), compare) for expr, compare in _checked(stmt.test, node)]
        elif _pytest_raises(stmt):
            out += _raising(stmt.body, counter)
        elif _try_except_return(stmt, body[k + 1 : k + 2]):
            out += _raising(stmt.body, counter)
            skip = True  # the `raise AssertionError(...)` after it: the check stands for both
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            if any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
                raise ValueError(f"{node}: an assert in a function or class defined in a test cannot be checked")
            out.append(stmt)
        else:  # setup, with its nested blocks (a `for`, an `if`, a `try` that catches what a step raises)
            for field in ("body", "orelse", "finalbody"):
                if isinstance(getattr(stmt, field, None), list):
                    setattr(stmt, field, _statements(getattr(stmt, field), node, counter))
            for handler in getattr(stmt, "handlers", []):
                handler.body = _statements(handler.body, node, counter)
            out.append(stmt)
    return out


def _checked(test: ast.expr, node: str) -> list[tuple[ast.expr, str]]:
    """The expressions an assert's test checks, each with how it is compared."""
    match test:
        case ast.BoolOp(op=ast.And(), values=values):
            return [c for v in values for c in _checked(v, node)]
        case ast.UnaryOp(op=ast.Not(), operand=operand):
            return [(_unwrapped(operand), "truth")]
        case ast.Compare(left=left, ops=[ast.Eq() | ast.Is() as op], comparators=[right]):
            side = right if isinstance(left, ast.Constant) and not isinstance(right, ast.Constant) else left
            return [(_unwrapped(side), "is" if isinstance(op, ast.Is) else "==")]
        case ast.Call(func=ast.Name(id="all" | "any"), args=[ast.GeneratorExp(elt=elt, generators=generators)]):
            (item, compare), *more = _checked(elt, node)
            if more or compare == "is":
                raise ValueError(f"{node}: `{ast.unparse(test)}` cannot become a value test")
            if compare == "truth":
                item = ast.Call(ast.Name("bool", ast.Load()), [item], [])
            return [(ast.ListComp(item, generators), "==")]
    return [(_unwrapped(test), "truth")]


def _unwrapped(expr: ast.expr) -> ast.expr:
    """`_plain(A)` is A: the grader's encoding refuses what `_plain` refuses (anything but builtin plain data)."""
    match expr:
        case ast.Call(func=ast.Name(id="_plain"), args=[inner], keywords=[]):
            return inner
    return expr


def _pytest_raises(stmt: ast.stmt) -> bool:
    """`with pytest.raises(E):`"""
    match stmt:
        case ast.With(items=[ast.withitem(context_expr=ast.Call(func=ast.Attribute(ast.Name("pytest"), "raises")))]):
            return True
    return False


def _try_except_return(stmt: ast.stmt, after: list[ast.stmt]) -> bool:
    """`try: body / except E: return` (or `pass`) followed by `raise AssertionError(...)`."""
    match stmt, after:
        case (
            ast.Try(handlers=[ast.ExceptHandler(body=[ast.Return(value=None) | ast.Pass()])], orelse=[], finalbody=[]),
            [ast.Raise(exc=ast.Call(func=ast.Name(id="AssertionError")))],
        ):
            return True
    return False


def _raising(body: list[ast.stmt], counter: itertools.count) -> list[ast.stmt]:
    """A nested function of `body`, checked: its outcome is expected to be the exception the original raised."""
    name = f"__agentrl_body_{next(counter)}__"
    fn = ast.FunctionDef(name=name, args=_no_args(), body=body, decorator_list=[], returns=None, type_params=[])
    return [fn, _check(ast.Name(name, ast.Load()), "raises")]
