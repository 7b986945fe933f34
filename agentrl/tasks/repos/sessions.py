"""Run short sessions against a package held in memory: how the generator learns what the original and the
buggy package return, to write the issue and the hidden tests' expected values.

The package is imported from its files under a fresh private name (its modules import each other relatively),
so two versions, or two templates that share a package name, never meet in `sys.modules`, and nothing is
written to disk. Only template code runs here: it is ours and trusted, and a session takes microseconds.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import itertools
import math
import re
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_lock = threading.Lock()
_counter = itertools.count()


@dataclass(frozen=True)
class Outcome:
    """What a session ended with: the last expression's value, or the exception a statement raised."""

    value: Any = None
    raised: BaseException | None = None
    shown: tuple[tuple[str, str], ...] = ()
    """(statement source, what a REPL prints after it) for each statement run, the last included"""

    def same(self, other: Outcome) -> bool:
        """Whether the hidden test expecting `other` passes on this outcome: as its `assert ... == expected` or
        `pytest.raises(type)` judges (so 2.0 passes for 2, and a subclass for its exception)."""
        if other.raised is not None:
            return self.raised is not None and isinstance(self.raised, type(other.raised))
        if self.raised is not None:
            return False
        try:
            return bool(self.value == other.value)
        except Exception:
            return False


def split_session(session: str) -> list[str]:
    """The statements of a session, each as its source lines (a decorated definition with its decorators);
    ValueError unless the last is an expression or when two statements share a line."""
    tree = ast.parse(session)
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        raise ValueError(f"a session must end with an expression: {session!r}")
    lines = session.splitlines()
    starts = [min([n.lineno, *(d.lineno for d in getattr(n, "decorator_list", []))]) for n in tree.body]
    if any(a.end_lineno >= b for a, b in zip(tree.body[:-1], starts[1:], strict=True)):
        raise ValueError(f"a session puts each statement on lines of its own: {session!r}")
    return ["\n".join(lines[start - 1 : n.end_lineno]) for start, n in zip(starts, tree.body, strict=True)]


def plain(value: object) -> bool:
    """A value whose repr is a literal that reads back equal, the same in every process (no sets: their order
    follows the salted string hash; no objects: their repr holds an address)."""
    match value:
        case None | bool() | int() | str():
            return True
        case float():
            return math.isfinite(value)
        case list() | tuple():
            return all(plain(v) for v in value)
        case dict():
            return all(plain(k) and plain(v) for k, v in value.items())
    return False


def run(files: Mapping[str, str], pkg: str, sessions: list[str], tests: list[str]) -> tuple[list[Outcome], list[bool]]:
    """Run each session in its own namespace holding the package's public names, and each test (a node id
    `tests/test_x.py::test_y` of a plain test function); what each session ended with, whether each test passed.

    Tests run in this process, so they may import the package and the standard library only, not pytest.
    """
    with loaded(files, pkg) as module:
        public = {k: v for k, v in vars(module).items() if not k.startswith("_")}
        outcomes = [_run(session, dict(public), module.__name__, pkg) for session in sessions]
        modules: dict[str, dict[str, Any]] = {}
        passed = []
        for node in tests:
            path, name = node.split("::")
            if path not in modules:
                modules[path] = _test_module(files[path], path, pkg, module.__name__)
            passed.append(_passes(modules[path][name]))
        return outcomes, passed


def _test_module(text: str, path: str, pkg: str, alias: str) -> dict[str, Any]:
    """A test file executed with its imports of `pkg` pointed at `alias`."""
    tree = ast.parse(text)
    alias_imports(tree, pkg, alias, path)
    namespace: dict[str, Any] = {"__name__": path}
    exec(compile(tree, path, "exec"), namespace)
    return namespace


def alias_imports(tree: ast.AST, pkg: str, alias: str, path: str) -> None:
    """Point the imports of `pkg` in `tree` at `alias` (a package `loaded` under a private name), in place."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == pkg or node.module.startswith(pkg + "."):
                node.module = alias + node.module[len(pkg) :]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == pkg:
                    a.name, a.asname = alias, a.asname or pkg
                elif a.name.startswith(pkg + "."):
                    raise ValueError(f"{path}: write `from {a.name} import ...` rather than `import {a.name}`")


def _passes(test: Any) -> bool:
    try:
        test()
    except Exception:
        return False
    return True


def _run(session: str, namespace: dict[str, Any], alias: str, pkg: str) -> Outcome:
    shown: list[tuple[str, str]] = []
    statements = split_session(session)
    value = None
    for k, source in enumerate(statements):
        last = k == len(statements) - 1
        try:
            node = ast.parse(source).body[0]
            if isinstance(node, ast.Expr):
                value = eval(compile(ast.Expression(node.value), "<session>", "eval"), namespace)
                shown.append((source, "" if value is None else _shown(value)))
            else:
                exec(compile(source, "<session>", "exec"), namespace)
                shown.append((source, ""))
        except Exception as e:
            # as the package's own name would print, without this process's addresses
            message = re.sub(r"0x[0-9a-f]+", "0x...", f"{type(e).__name__}: {e}".replace(alias, pkg))
            shown.append((source, message))
            return Outcome(raised=e, shown=tuple(shown))
        if last:
            return Outcome(value=value, shown=tuple(shown))
    raise AssertionError("unreachable: split_session guarantees a last expression")


def _shown(value: object) -> str:
    """What a REPL prints for `value`, made the same in every process: an object without a literal repr
    shows its class alone."""
    return repr(value) if plain(value) else f"<{type(value).__name__} object>"


class _Importer(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `alias` and `alias.<module>` from the files of package `pkg`."""

    def __init__(self, alias: str, pkg: str, files: Mapping[str, str]):
        self.alias, self.pkg, self.files = alias, pkg, files

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        if fullname != self.alias and not fullname.startswith(self.alias + "."):
            return None
        rel = fullname[len(self.alias) :].lstrip(".").replace(".", "/")
        for name, is_pkg in ((f"{rel}/__init__.py".lstrip("/"), True), (f"{rel}.py", False)):
            if f"{self.pkg}/{name}" in self.files:
                return importlib.util.spec_from_loader(fullname, self, origin=f"{self.pkg}/{name}", is_package=is_pkg)
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        origin = module.__spec__.origin
        exec(compile(self.files[origin], origin, "exec"), module.__dict__)


@contextmanager
def loaded(files: Mapping[str, str], pkg: str) -> Iterator[types.ModuleType]:
    """The package `pkg` of `files` imported under a private name (its `__name__`), for the `with` block."""
    alias = f"_agentrl_repo_{next(_counter)}"
    importer = _Importer(alias, pkg, files)
    with _lock:  # sys.meta_path and sys.modules are process-wide
        sys.meta_path.insert(0, importer)
        try:
            yield importlib.import_module(alias)
        finally:
            sys.meta_path.remove(importer)
            # a snapshot: other threads (Ray's, the event loop's) import while we hold only our own lock, and a
            # comprehension over the live dict fails when they do ("dictionary changed size during iteration")
            for name in [n for n in tuple(sys.modules) if n == alias or n.startswith(alias + ".")]:
                del sys.modules[name]
