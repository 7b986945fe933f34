"""pytest_integrity: a pytest plugin that watches pytest's reporting machinery for tampering by the code it tests.
Standard library and pytest only; any Python >= 3.9.

Loaded with `-p pytest_integrity` (this file's folder on the path) and two environment variables:
AGENTRL_INTEGRITY_TOKEN, a secret word, and AGENTRL_INTEGRITY_FILE, where the verdict goes. At the end of the session
it writes one line there: `<token> clean`, or `<token> tampered: <what changed, the first few>`. If pytest never
gets there (the process exits early) no line is written, and the host treats a missing or wrong line as tampering.

What it watches, against what it recorded when imported (before any conftest or module of the repository):
- the functions and classes of pytest's reporting and outcome machinery, pluggy's hook calling, unittest's
  `TestCase` and result classes, the builtins, and the XML writer of the JUnit report: the module attributes
  (identity, and each function's `__code__`), the methods and attributes of their classes (no new or removed
  names either), and each module's entry in `sys.modules`;
- the plugin manager: its own callables, its hook callers, and every hook implementation registered from the start
  must stay registered; one added later must live in a conftest or a test file, or outside the repository (an
  installed plugin), not in the repository's other code, nor in code of no file (`exec`);
- the import system: no new finder ahead of those that were there (a finder could hand pytest other test modules),
  none of those removed, no cache entry for a folder of an unknown kind; the tracer and profiler (a tracer can
  rewrite a test's locals), and `sys.monitoring` tools;
- each test function: the same function and code at its run as at its collection, and no `runtest` of its own.
It checks before the first test, after each test (a hookwrapper on `pytest_runtest_protocol`; nothing runs between
two tests' protocols, so that is also before the next), and when the session ends, after the JUnit report is written.
Before pytest's configure, changes by code outside the repository's non-test files are pytest's own set-up and
taken as recorded. After it, a watched attribute that changes counts, whoever changed it; a new hook implementation,
tracer, import hook or test function counts when its code is in the repository's non-test files or in no file.

Best effort: the code under test runs in this process and can do anything this plugin can. Known ways past it:
- the token: it is removed from os.environ at import, before any repository code runs, but stays in this process's
  memory (this module's globals, /proc/self/environ), where code that looks for it finds it and can write a clean
  verdict itself; likewise the verdict file's name;
- patching this plugin's own state, or patches made and undone within one test;
- values that lie: an object whose `__eq__` always says True passes `assert f(x) == 5`; and names rebound in a
  test module's namespace (its `pytest`, a fake whose `raises` passes everything);
- anything after the verdict: an `atexit` handler or a forked process that rewrites the JUnit report;
- pytest's own repository, where the code under test is pytest itself.
False alarms it can raise: a repository whose pytest plugin lives in its non-test code (anyio's, hypothesis's), and
a fixture wider than a test that patches a watched attribute (a session fixture replacing `builtins.input`).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from itertools import chain, repeat
from operator import attrgetter, is_not, itemgetter

import pytest

# Read and removed before any test or repository module is imported (a best effort: see the docstring).
_TOKEN = os.environ.pop("AGENTRL_INTEGRITY_TOKEN", "")
_VERDICT_FILE = os.environ.pop("AGENTRL_INTEGRITY_FILE", "")
# Captured now, so the verdict is written with the functions the interpreter started with.
_open, _write, _close, _isinstance, _getattr = os.open, os.write, os.close, isinstance, getattr
_CWD = os.getcwd()
_HERE = os.path.normpath(os.path.join(_CWD, __file__))

_MODULES = (
    "pytest",
    "_pytest.reports",
    "_pytest.runner",
    "_pytest.python",
    "_pytest.python_api",
    "_pytest.raises",
    "_pytest.approx",
    "_pytest.outcomes",
    "_pytest.skipping",
    "_pytest.unittest",
    "_pytest.subtests",
    "_pytest.junitxml",
    "_pytest.terminal",
    "_pytest.main",
    "_pytest.nodes",
    "_pytest.assertion",
    "_pytest.assertion.rewrite",
    "_pytest.assertion.util",
    "_pytest.recwarn",
    "_pytest.warnings",
    "pluggy",
    "pluggy._hooks",
    "pluggy._callers",
    "pluggy._manager",
    "pluggy._result",
    "pluggy.hooks",  # pluggy < 1.0
    "pluggy.callers",
    "pluggy.manager",
    "unittest",
    "unittest.case",
    "unittest.result",
    "builtins",
    "xml.etree.ElementTree",
    "py._xmlgen",  # the JUnit writer of pytest < 7
    __name__,
)
_TEST_DIRS = {"tests", "test", "testing"}
"""as SWE-bench's harness tells test files (agentrl.env.repos.is_test_path)"""
_MISSING = object()
_HEAPTYPE, _IMMUTABLETYPE = 1 << 9, 1 << 8  # Py_TPFLAGS_*
_CODE = attrgetter("__code__")
_GET = itemgetter.__call__
_FUNCTION = attrgetter("function")


def _function(obj):
    """The function behind a function, method, classmethod, staticmethod or property, or None."""
    if _isinstance(obj, (classmethod, staticmethod, types.MethodType)):
        obj = obj.__func__
    elif _isinstance(obj, property):
        obj = obj.fget
    return obj if _isinstance(obj, types.FunctionType) else None


def _code(obj):
    function = _function(obj)
    return None if function is None else function.__code__


def _watched(value) -> bool:
    """Behaviour rather than data: what a module or class attribute must keep."""
    return callable(value) or _isinstance(value, (classmethod, staticmethod, property, types.ModuleType))


def _shadows(cls, key) -> bool:
    """Whether a name new to `cls` changes behaviour: it holds code, or hides what a base class defines (a data
    `passed = True` over a report's `passed` property). pytest itself adds plain flags to its classes."""
    return _watched(cls.__dict__.get(key)) or any(_watched(base.__dict__.get(key)) for base in cls.__mro__[1:])


def _tools():
    monitoring = _getattr(sys, "monitoring", None)
    return () if monitoring is None else tuple(monitoring.get_tool(i) for i in range(6))


def _impl_lists(caller) -> list:
    """The live lists of a hook caller's implementations (pluggy >= 1.0 keeps one, older ones two)."""
    lists = [_getattr(caller, a, None) for a in ("_hookimpls", "_nonwrappers", "_wrappers")]
    return [lst for lst in lists if _isinstance(lst, list)]


def _identical(now, then) -> bool:
    return len(now) == len(then) and not any(map(is_not, now, then))


class _State:
    """What was recorded, and what was found changed since. `check` compares all of it in a few passes of C
    (`intact`: about 0.4 ms for some 3,000 objects); only when something differs does `explain` name it, or take it
    as recorded when it is harmless (pytest's own flags on its classes, an import hook appended by a library)."""

    def __init__(self):
        self.modules = []  # (name, module)
        self.entries = []  # (label, namespace, key, value, function behind it or None, its code)
        self.classes = []  # [label, class, namespace, names]
        self._record()
        self.meta_path, self.path_hooks = list(sys.meta_path), list(sys.path_hooks)
        self.cache_kinds = set(map(type, list(sys.path_importer_cache.values())))
        self.trace, self.profile, self.monitoring = sys.gettrace(), sys.getprofile(), _tools()
        self.pm = None
        self.pm_entries = []  # (label, owner, attribute, value)
        self.hooks = {}  # hook name -> [hook caller, (implementation, its function) as last accepted]
        self.root = None
        self.origins = {}  # id(code) -> (code, why it may not take part, or None)
        self.items = {}  # nodeid -> (test function, its code)
        self.problems = []
        self.checked = False
        self._index()

    def _record(self) -> None:
        """The watched modules' and classes' attributes. Entries keep the objects, so no id is reused."""
        classes = {}
        for name in _MODULES:
            try:
                module = sys.modules.get(name) or importlib.import_module(name)
            except Exception:  # not in this version of pytest, pluggy or Python
                continue
            self.modules.append((name, module))
            for key, value in list(module.__dict__.items()):
                self._entry(name, module.__dict__, key, value)
                # The classes these modules define; not those of C, whose attributes cannot be set.
                if (
                    _isinstance(value, type)
                    and _getattr(value, "__module__", None) in _MODULES
                    and value.__flags__ & _HEAPTYPE
                    and not value.__flags__ & _IMMUTABLETYPE
                ):
                    classes.setdefault(id(value), value)
        for cls in classes.values():
            label, space = f"{cls.__module__}.{cls.__qualname__}", cls.__dict__
            self.classes.append([label, cls, space, frozenset(space)])
            for key, value in list(space.items()):
                self._entry(label, space, key, value)

    def _entry(self, label: str, space, key, value) -> None:
        if _watched(value):
            function = _function(value)
            self.entries.append((f"{label}.{key}", space, key, value, function, _getattr(function, "__code__", None)))

    def _index(self) -> None:
        """The flat tuples `intact` compares: per namespace an itemgetter of its watched keys (two at least, so
        that it gives a tuple), the values in the same order, the functions and their code."""
        groups = {}
        for _, space, key, value, _, _ in self.entries:
            groups.setdefault(id(space), (space, []))[1].append((key, value))
        spaces = [space for space, _ in groups.values()]
        getters = [itemgetter(*[k for k, _ in pairs] * (2 if len(pairs) == 1 else 1)) for _, pairs in groups.values()]
        values = [v for _, pairs in groups.values() for _, v in pairs * (2 if len(pairs) == 1 else 1)]
        self._spaces = tuple(spaces), tuple(getters), tuple(values)
        functions = [e for e in self.entries if e[4] is not None]
        self._functions = tuple(e[4] for e in functions), tuple(e[5] for e in functions)
        self._sizes = tuple(c[2] for c in self.classes), [len(c[3]) for c in self.classes]
        self._modules = tuple(n for n, _ in self.modules), tuple(m for _, m in self.modules)
        self._pm = tuple(tuple(e[i] for e in self.pm_entries) for i in (1, 2, 3))
        hooks = list(self.hooks.items())
        lists = [lst for _, (caller, _) in hooks for lst in _impl_lists(caller)]
        impls = [impl for lst in lists for impl in lst]
        accepted = {id(impl): function for _, (_, pairs) in hooks for impl, function in pairs}
        self._hooks = (
            tuple(n for n, _ in hooks),
            tuple(c for _, (c, _) in hooks),
            tuple(lists),
            tuple(impls),
            tuple(accepted.get(id(impl)) for impl in impls),  # None for one not accepted: it stays found
        )

    def found(self, what: str) -> None:
        what = what[:200]  # names can be the package's own, of any length
        if what not in self.problems:
            self.problems.append(what)

    def check(self) -> None:
        if not self.intact():
            self.explain()

    def intact(self) -> bool:
        """Whether everything is as recorded (or last accepted)."""
        spaces, getters, values = self._spaces
        try:
            if any(map(is_not, chain.from_iterable(map(_GET, getters, spaces)), values)):
                return False
        except KeyError:
            return False
        functions, codes = self._functions
        if any(map(is_not, map(_CODE, functions), codes)) or list(map(len, self._sizes[0])) != self._sizes[1]:
            return False
        if any(map(is_not, map(sys.modules.get, self._modules[0]), self._modules[1])):
            return False
        if not (_identical(sys.meta_path, self.meta_path) and _identical(sys.path_hooks, self.path_hooks)):
            return False
        if not set(map(type, list(sys.path_importer_cache.values()))) <= self.cache_kinds:
            return False
        if sys.gettrace() is not self.trace or sys.getprofile() is not self.profile or _tools() != self.monitoring:
            return False
        if self.pm is None:
            return True
        owners, attributes, values = self._pm
        if any(map(is_not, map(_getattr, owners, attributes, repeat(_MISSING)), values)):
            return False
        hook = self.pm.hook
        names, callers, lists, impls, functions = self._hooks
        if len(vars(hook)) != len(names) or any(map(is_not, map(_getattr, repeat(hook), names), callers)):
            return False
        if sum(map(len, lists)) != len(impls) or any(map(is_not, chain.from_iterable(lists), impls)):
            return False
        return not any(map(is_not, map(_FUNCTION, impls), functions))

    def explain(self) -> None:
        """Name what changed; take as recorded what is harmless."""
        for name, module in self.modules:
            if sys.modules.get(name) is not module:
                self.found(f"sys.modules[{name!r}] replaced")
        for label, space, key, value, function, code in self.entries:
            now = space.get(key, _MISSING)
            if now is not value:
                self.found(f"{label} {'removed' if now is _MISSING else 'replaced'}")
            elif function is not None and function.__code__ is not code:
                self.found(f"{label}.__code__ replaced")
        for record in self.classes:
            label, cls, space, names = record
            lost, added = names - set(space), set(space) - names
            harmful = sorted(str(k) for k in added if _shadows(cls, k))
            for key in sorted(map(str, lost)):
                self.found(f"{label}.{key} removed")
            for key in harmful:
                self.found(f"{label}.{key} added")
            if not lost and not harmful:
                record[3] = names | added
        self._explain_imports()
        for what, now, then in (("tracer", sys.gettrace(), self.trace), ("profiler", sys.getprofile(), self.profile)):
            if now is not then:
                why = self.origin(now)
                if why is None:
                    self.trace, self.profile = sys.gettrace(), sys.getprofile()
                else:
                    self.found(f"a {what} {why}")
        if _tools() != self.monitoring:
            self.found("a sys.monitoring tool registered")
        if self.pm is not None:
            self._explain_plugins()
        self._index()

    def _explain_imports(self) -> None:
        for name, now in (("sys.meta_path", sys.meta_path), ("sys.path_hooks", sys.path_hooks)):
            then = self.meta_path if name == "sys.meta_path" else self.path_hooks
            old = [i for i, f in enumerate(now) if any(f is g for g in then)]
            bad = len(old) != len(then) or any(now[i] is not then[k] for k, i in enumerate(old))
            if bad:
                self.found(f"{name}: an entry removed or moved")
            for f in now[: old[-1] if old else 0]:  # a new entry ahead of an old one is asked first
                if not any(f is g for g in then) and (why := self.origin(type(f))) is not None:
                    bad = True
                    self.found(f"{name}: a new entry ahead of pytest's, {why}")
            if not bad:  # appended by a library (six), or by a test file
                then[:] = now
        for kind in set(map(type, list(sys.path_importer_cache.values()))) - self.cache_kinds:
            why = self.origin(kind)
            if why is None:
                self.cache_kinds.add(kind)
            else:
                self.found(f"sys.path_importer_cache: a finder {why}")

    def _explain_plugins(self) -> None:
        for label, owner, attribute, value in self.pm_entries:
            if _getattr(owner, attribute, _MISSING) is not value:
                self.found(f"{label} replaced")
        hook = self.pm.hook
        for name, caller in list(vars(hook).items()):
            if not hasattr(caller, "get_hookimpls"):
                continue
            recorded = self.hooks.setdefault(name, [caller, ()])
            if recorded[0] is not caller:
                self.found(f"the hook {name}: its caller replaced")
                continue
            now = caller.get_hookimpls()
            bad = False
            # A plugin unregistered and registered again (flask's tests do so with pytest's logging plugin) has new
            # implementations of the same functions: they stand for the old ones.
            present = {(id(impl.plugin), id(_function(impl.function) or impl.function)) for impl in now}
            for impl, function in recorded[1]:
                if impl in now and impl.function is not function:
                    bad = True
                    self.found(f"the hook {name}: {impl.plugin_name}'s implementation replaced")
                elif impl not in now and (id(impl.plugin), id(_function(function) or function)) not in present:
                    bad = True
                    self.found(f"the hook {name}: {impl.plugin_name}'s implementation removed")
            known = [impl for impl, _ in recorded[1]]
            for impl in now:
                if impl not in known and (why := self.origin(impl.function, code=True)) is not None:
                    bad = True
                    self.found(f"the hook {name} implemented {why}")
            if not bad:
                recorded[1] = tuple((impl, impl.function) for impl in now)
        for name in set(self.hooks) - set(vars(hook)):
            self.found(f"the hook {name} removed")

    def settle(self, config) -> None:
        """At configure: record the plugin manager's hooks, and take as recorded the changes made since the import
        by code outside the repository's non-test files. pytest's own set-up patches its classes (legacypath adds
        the py.path attributes); a change that is data, a builtin, or code of the repository's stays a change."""
        self.root = os.fspath(_getattr(config, "rootpath", None) or config.rootdir)

        def blessed(value) -> bool:
            return _function(value) is not None and self.origin(value) is None

        for i, (label, space, key, value, function, code) in enumerate(self.entries):
            now = space.get(key, _MISSING)
            if (now is not value or (function is not None and function.__code__ is not code)) and blessed(now):
                self.entries[i] = (label, space, key, now, _function(now), _code(now))
        for record in self.classes:
            label, _, space, names = record
            added = [k for k in set(space) - names if blessed(space[k])]
            record[3] = names | frozenset(added)
            for key in added:
                self._entry(label, space, key, space[key])
        for name, caller in list(vars(self.pm.hook).items()):
            hookexec = _getattr(caller, "_hookexec", None)
            if hookexec is not None:
                self.pm_entries.append((f"the hook {name}'s caller", caller, "_hookexec", hookexec))
        self.explain()  # records the hook implementations, unless some are already foreign

    def origin(self, obj, code: bool = False) -> str | None:
        """Why `obj` (a function, method or class) may not take part in the run: its code is in the repository but
        not in a test file or conftest, or has no file; with `code`, also when it has no Python code (a builtin).
        None when it may."""
        if _isinstance(obj, type):
            found = next((c for v in list(vars(obj).values()) if (c := _code(v)) is not None), None)
        else:
            found = _code(obj)
        if found is None:
            return f"by {type(obj).__name__} {_getattr(obj, '__name__', '')}, not Python code" if code else None
        known = self.origins.get(id(found))
        if known is None:
            known = self.origins[id(found)] = (found, self._why(found.co_filename))
        return known[1]

    def _why(self, filename: str) -> str | None:
        if filename.startswith("<frozen "):
            return None
        if filename.startswith("<") or not filename:
            return f"in code of no file ({filename})"
        path = os.path.normpath(os.path.join(_CWD, filename))
        if path == _HERE:
            return None
        rel = os.path.relpath(path, self.root or _CWD)
        if rel == ".." or rel.startswith(".." + os.sep):
            return None  # outside the repository: pytest, an installed plugin
        *dirs, name = rel.split(os.sep)
        if "site-packages" in dirs or "dist-packages" in dirs:
            return None
        if _TEST_DIRS & set(dirs) or name == "conftest.py" or name.startswith("test_") or name.endswith("_test.py"):
            return None
        return f"in {rel}"


_state = _State()


def pytest_addhooks(pluginmanager) -> None:
    """Called as this plugin is registered, before conftests load: record the plugin manager's own callables."""
    _state.pm = pluginmanager
    for label, owner in (("pluginmanager", pluginmanager), ("pluginmanager.hook", pluginmanager.hook)):
        for attribute, value in list(vars(owner).items()):
            if callable(value):
                _state.pm_entries.append((f"{label}.{attribute}", owner, attribute, value))
    _state._index()


@pytest.hookimpl(trylast=True)
def pytest_configure(config) -> None:
    _state.settle(config)


def _test_function(item):
    obj = item.__dict__.get("_obj")
    return _getattr(obj, "__func__", obj)


def pytest_itemcollected(item) -> None:
    function = _test_function(item)
    if function is not None:
        _state.items[item.nodeid] = (function, _code(function))


def _check_item(item) -> None:
    """The test's function and code are those collected, or were replaced by code outside the repository's non-test
    files (a plugin such as pytest-asyncio wraps coroutines); and its item has no `runtest` of the repository's."""
    runtest = item.__dict__.get("runtest")
    if runtest is not None and (why := _state.origin(runtest, code=True)) is not None:
        _state.found(f"{item.nodeid}: its runtest replaced, {why}")
    recorded = _state.items.get(item.nodeid)
    function = _test_function(item)
    if recorded is None or function is None or (function is recorded[0] and _code(function) is recorded[1]):
        return
    if (why := _state.origin(function, code=True)) is not None:
        _state.found(f"{item.nodeid}: its test function replaced, {why}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Checks before the first test and after each."""
    if not _state.checked:
        _state.checked = True
        _state.check()
    _check_item(item)
    yield
    _check_item(item)
    _state.check()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    """The last check, after the JUnit report is written; then the verdict."""
    _state.check()
    if not _VERDICT_FILE:
        return
    problems = _state.problems
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    verdict = f"tampered: {'; '.join(problems[:5])}{more}" if problems else "clean"
    line = f"{_TOKEN} {verdict}".replace("\n", " ").replace("\r", " ")
    fd = _open(_VERDICT_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write(fd, f"{line}\n".encode())
    finally:
        _close(fd)
