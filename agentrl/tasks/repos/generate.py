"""The offline task generator: a template, one planted bug, the issue it causes and the tests that grade a fix.

An instance is named `repo-<template>-<n>`. The number picks, in mixed radix, the bug site (the fastest digit),
the package's name and each template parameter, so ids `0 .. count(template) - 1` are distinct instances and
any process rebuilds one from its id alone. The names in the package's code (`names.py`: its functions, variables,
module files, renamed with synonyms), the phrasing of the issue and which failing session it shows are drawn from
generators seeded with a SHA-256 of the id. So `repo-<template>-<n>-<k>` (k >= 1), spelling k of instance n
(`spelling`), is the same bug, package and parameters with those drawn again: with the task set's `spellings=k`, SFT
data can show one bug in many spellings instead of one spelling many times.

What an instance holds:
- `repo`: the template's package with the bug planted, and the template's visible tests less those the bug
  breaks, so the visible suite is green on the base, as a real project's was when the bug slipped in: the
  agent must reproduce the issue itself, and `run_tests` cannot point at the bug;
- `test_patch`: puts the dropped visible tests back and adds `tests/test_regressions.py`, one hidden test per
  session of every site of the template, each asserting the value (or the exception) that the original
  package gives, computed by running it;
- FAIL_TO_PASS: the dropped visible tests and the hidden tests whose session the bug changes (at least one of
  its own site's); PASS_TO_PASS: every other test, visible and hidden;
- `checks`: each of those tests as a value test with the original package's outcomes (`checks.py`), which grading
  runs out of the package's reach;
- `problem_statement`: the site's symptom line and one failing session, as a REPL shows it, with the expected
  output; never the file, the code or the fix.
"""

from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass

from agentrl.tasks.repos.checks import value_tests
from agentrl.tasks.repos.instance import RepoInstance, content_hash, make_patch
from agentrl.tasks.repos.names import draw, renamable, rename, rename_path, words
from agentrl.tasks.repos.sessions import Outcome, plain, run, split_session
from agentrl.tasks.repos.template import Site, Template
from agentrl.tasks.repos.templates import TEMPLATES

HIDDEN_TESTS = "tests/test_regressions.py"
"""the file `test_patch` adds"""

_ID = re.compile(r"^repo-([a-z]+)-(\d+)(?:-([1-9]\d*))?$")


@dataclass(frozen=True)
class Variant:
    """What an instance id chooses within its template: the bug site, the package's name, the parameters' values
    (its number's digits) and the renaming of the package's names (drawn from the id)."""

    template: Template
    site: Site
    pkg: str
    values: Mapping[str, str]
    names: Mapping[str, str]
    """the package's names in code -> this instance's spelling (`names.rename`)"""

    def files(self) -> dict[str, str]:
        """The original repository: the template's files for this package, parameters and names."""
        out = {}
        for path, text in self.template.files(self.pkg, self.values).items():
            own = path.startswith(f"{self.pkg}/")
            out[rename_path(path, self.names) if own else path] = rename(text, self.names, docstrings=own)
        return out

    def render(self, code: str, *, module_text: bool = False) -> str:
        """Template code (a session, or with `module_text` a site's text in a module) for this instance."""
        return rename(self.template.render(code, self.pkg, self.values), self.names, docstrings=module_text)

    def module(self, site: Site) -> str:
        """The path of `site`'s module in this instance's repository."""
        return rename_path(f"{self.pkg}/{site.module}", self.names)

    def title(self, site: Site) -> str:
        """`site`'s symptom line, with the package's public names as this instance spells them."""
        text = self.template.render(site.title, self.pkg, self.values)
        public = _public_names_cached(self.template.name, self.pkg, tuple(self.values.items()))
        return re.sub(r"[A-Za-z_]\w*", lambda m: self.names.get(m[0], m[0]) if m[0] in public else m[0], text)


def count(template: Template) -> int:
    """How many distinct instances a template has: sites x package names x parameter values."""
    return len(template.sites) * len(template.packages) * math.prod(len(v) for v in template.params.values())


def instance_id(template: str, n: int) -> str:
    return f"repo-{template}-{n}"


def spelling(instance_id: str, k: int) -> str:
    """The id of spelling k of an instance; spelling 0 is the instance itself. `base_id` is its inverse."""
    return f"{instance_id}-{k}" if k else instance_id


def base_id(instance_id: str) -> str:
    """The instance a spelling is of (`repo-<template>-<n>`); the id itself for an instance."""
    m = _ID.match(instance_id)
    return f"repo-{m[1]}-{m[2]}" if m and m[3] else instance_id


def variant(instance_id: str) -> Variant:
    """Decode an id; ValueError for one that names no template or is past its template's count."""
    m = _ID.match(instance_id)
    if not m:
        raise ValueError(f"not a generated repository id (`repo-<template>-<n>[-<k>]`): {instance_id!r}")
    name, n = m[1], int(m[2])
    if name not in TEMPLATES:
        raise ValueError(f"{instance_id}: no template {name!r}; templates: {sorted(TEMPLATES)}")
    template = TEMPLATES[name]
    if n >= count(template):
        raise ValueError(f"{instance_id}: template {name} has {count(template)} instances (0 .. {count(template) - 1})")
    n, site = divmod(n, len(template.sites))
    n, pkg = divmod(n, len(template.packages))
    values = {}
    for param, choices in template.params.items():
        n, k = divmod(n, len(choices))
        values[param] = choices[k]
    package = template.packages[pkg]
    candidates, in_use = _renamable(name, package, tuple(values.items()))
    names = draw(candidates, set(in_use), _rng(instance_id, "names"))
    return Variant(template, template.sites[site], package, values, names)


def _rng(instance_id: str, purpose: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256(f"{instance_id}{purpose}".encode()).digest()[:8], "big"))


@functools.lru_cache(maxsize=256)
def _renamable(name: str, pkg: str, values: tuple[tuple[str, str], ...]) -> tuple[frozenset[str], frozenset[str]]:
    """The names of a variant's package that may be renamed, and every word its code already uses."""
    template = TEMPLATES[name]
    files = template.files(pkg, dict(values))
    modules = {p: t for p, t in files.items() if p.startswith(f"{pkg}/")}
    sessions = [template.render(s, pkg, dict(values)) for site in template.sites for s in site.sessions()]
    others = [t for p, t in files.items() if p not in modules] + sessions
    return renamable(modules, others, pkg), frozenset(words([*files.values(), *sessions]))


def generate(instance_id: str) -> RepoInstance:
    """The instance with this id, the same in every process."""
    v = variant(instance_id)
    template, site, pkg = v.template, v.site, v.pkg
    original = v.files()
    full = plant(v, original)  # the buggy package with every visible test
    names, sessions, owners = _hidden_sessions(v)
    visible = collect_tests(full)
    expected = _expected(v, original, sessions)
    got, passed = run(full, pkg, sessions, visible)
    failing = [names[k] for k, (e, g) in enumerate(zip(expected, got, strict=True)) if not g.same(e)]
    own = [k for k, name in enumerate(names) if name in failing and owners[k] == site.id]
    if not own:
        raise ValueError(f"template {template.name}, site {site.id}: the bug changes none of the site's sessions")
    # Visible tests the bug breaks leave the repository and come back through the test patch: the visible suite
    # stays green on the base, as a real project's did when the bug slipped in.
    broken = [node for node, ok in zip(visible, passed, strict=True) if not ok]
    buggy = _drop_tests(full, broken)
    module = v.module(site)
    restored = {n.split("::")[0]: full[n.split("::")[0]] for n in broken}
    hidden = _hidden_file(v, names, sessions, expected)
    fail_to_pass = broken + [f"{HIDDEN_TESTS}::{name}" for name in failing]
    pass_to_pass = [n for n in visible if n not in broken]
    pass_to_pass += [f"{HIDDEN_TESTS}::{name}" for name in names if name not in failing]
    graded = [*fail_to_pass, *pass_to_pass]
    checks = value_tests({**full, HIDDEN_TESTS: hidden}, graded, original, pkg)
    rng = _rng(instance_id, "")
    shown = rng.choice(own)
    return RepoInstance(
        instance_id=instance_id,
        repo=buggy,
        base_commit=content_hash(buggy),
        problem_statement=_statement(v, got[shown], expected[shown], rng),
        patch=make_patch(buggy, {**buggy, module: original[module]}),
        test_patch=make_patch(buggy, {**buggy, **restored, HIDDEN_TESTS: hidden}),
        FAIL_TO_PASS=fail_to_pass,
        PASS_TO_PASS=pass_to_pass,
        template=template.name,
        family=site.family,
        checks=checks,
    )


def _drop_tests(files: Mapping[str, str], nodes: list[str]) -> dict[str, str]:
    """`files` without the test functions `nodes` (top-level functions only)."""
    out = dict(files)
    for path in sorted({n.split("::")[0] for n in nodes}):
        names = {n.split("::")[1] for n in nodes if n.startswith(f"{path}::")}
        lines = out[path].splitlines(keepends=True)
        for node in reversed(ast.parse(out[path]).body):
            if isinstance(node, ast.FunctionDef) and node.name in names:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
                del lines[first : node.end_lineno]
        out[path] = re.sub(r"\n{3,}", "\n\n\n", "".join(lines)).rstrip("\n") + "\n"
    return out


def plant(v: Variant, original: Mapping[str, str]) -> dict[str, str]:
    """The variant's `original` files (`Variant.files`) with its site's bug in them; ValueError unless the original
    text occurs exactly once."""
    template, site = v.template, v.site
    files = dict(original)
    path = v.module(site)
    if path not in files:
        raise ValueError(f"template {template.name}, site {site.id}: no module {site.module}")
    old, new = (v.render(t, module_text=True) for t in (site.original, site.buggy))
    if files[path].count(old) != 1:
        n = files[path].count(old)
        raise ValueError(f"template {template.name}, site {site.id}: the original text occurs {n} times in {path}")
    files[path] = files[path].replace(old, new)
    return files


def collect_tests(files: Mapping[str, str]) -> list[str]:
    """The node ids of the test functions in `tests/test_*.py` (top-level `test*`, and `test*` methods of
    `Test*` classes), in file order: what pytest would collect from them."""
    ids = []
    for path in sorted(p for p in files if re.fullmatch(r"tests/(.+/)?test_\w*\.py", p)):
        for node in ast.parse(files[path]).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                ids.append(f"{path}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                ids += [
                    f"{path}::{node.name}::{f.name}"
                    for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test")
                ]
    return ids


def _hidden_sessions(v: Variant) -> tuple[list[str], list[str], list[str]]:
    """(test name, session, site id) for every session of every site: `test_<site>` for the example, then
    `test_<site>_2`, `_3`...; ValueError when two names clash."""
    names, sessions, owners = [], [], []
    for site in v.template.sites:
        for k, session in enumerate(site.sessions(), 1):
            names.append(f"test_{site.id}" if k == 1 else f"test_{site.id}_{k}")
            sessions.append(v.render(session))
            owners.append(site.id)
    if len(set(names)) != len(names):
        raise ValueError(f"template {v.template.name}: hidden test names clash; rename a site")
    return names, sessions, owners


def _expected(v: Variant, files: Mapping[str, str], sessions: list[str]) -> list[Outcome]:
    """What the variant's original package (`files`) gives for every hidden session. ValueError for a template whose
    own tests fail, or whose sessions a test could not check. (Not cached: an instance's names are its own.)"""
    name = v.template.name
    visible = collect_tests(files)
    outcomes, passed = run(files, v.pkg, sessions, visible)
    if not all(passed):
        failed = [n for n, ok in zip(visible, passed, strict=True) if not ok]
        raise ValueError(f"template {name}: its own tests fail: {failed}")
    for session, outcome in zip(sessions, outcomes, strict=True):
        if outcome.raised is not None and len(outcome.shown) < len(split_session(session)):
            raise ValueError(f"template {name}: on the original, a statement before the last raises: {session!r}")
        if outcome.raised is None and not plain(outcome.value):
            raise ValueError(f"template {name}: the session's value is not a plain literal: {session!r}")
    return outcomes


def _hidden_file(v: Variant, names: list[str], sessions: list[str], expected: list[Outcome]) -> str:
    """The hidden test module: each session's statements, then an assert on its last expression."""
    template, pkg = v.template, v.pkg
    public = _public_names(v)
    used: set[str] = set()
    bodies = []
    for name, session, outcome in zip(names, sessions, expected, strict=True):
        *setup, last = split_session(session)
        used |= _names(session) & public
        lines = [f"def {name}():", *(f"    {s}" for s in "\n".join(setup).splitlines())]
        if outcome.raised is not None:
            exc = type(outcome.raised).__name__
            if exc in public:
                used.add(exc)
            elif getattr(builtins, exc, None) is not type(outcome.raised):
                raise ValueError(f"template {template.name}: {exc} is neither a builtin nor exported by the package")
            lines += [f"    with pytest.raises({exc}):", f"        {last}"]
        elif outcome.value is None or isinstance(outcome.value, bool):
            lines.append(f"    assert {last} is {outcome.value!r}")
        else:
            lines.append(f"    assert _plain({last}) == {outcome.value!r}")
        bodies.append("\n".join(lines) + "\n")
    head = "import pytest\n\n" if any(o.raised is not None for o in expected) else ""
    head += f"from {pkg} import {', '.join(sorted(used))}\n" if used else ""
    if any("_plain(" in b for b in bodies):
        head += "\n\n" + _PLAIN
    return head + "\n\n" + "\n\n".join(bodies)


_PLAIN = '''def _plain(value):
    """`value` if it is made of builtin types only: an object that says it equals anything is no answer."""
    kind = type(value)
    if kind in (list, tuple):
        return kind(_plain(v) for v in value)
    if kind is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    if kind not in (int, float, str, bool, type(None)):
        raise AssertionError(f"not a plain value: {kind.__name__}")
    return value
'''


@functools.lru_cache(maxsize=256)
def _public_names_cached(name: str, pkg: str, values: tuple[tuple[str, str], ...]) -> frozenset[str]:
    template = TEMPLATES[name]
    tree = ast.parse(template.files(pkg, dict(values))[f"{pkg}/__init__.py"])
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return frozenset(n for n in names if not n.startswith("_"))


def _public_names(v: Variant) -> frozenset[str]:
    """The names the package's `__init__` defines or imports, as the variant spells them: what a session may use
    without an import."""
    return frozenset(v.names.get(n, n) for n in _public_names_cached(v.template.name, v.pkg, tuple(v.values.items())))


def _names(session: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(session)) if isinstance(n, ast.Name)}


def _prompted(source: str) -> list[str]:
    return [f"{'>>>' if k == 0 else '...'} {line}" for k, line in enumerate(source.splitlines())]


_LEADS = ("Steps to reproduce:", "To reproduce:", "A minimal example:", "Reproducer:")
_EXPECT = ("Expected:", "Expected output:", "It should give:")


def _statement(v: Variant, got: Outcome, expected: Outcome, rng: random.Random) -> str:
    """The issue: the symptom line, the session as a REPL shows it on the buggy package, the expected output."""
    template, pkg = v.template, v.pkg
    used = sorted(_names("\n".join(s for s, _ in got.shown)) & _public_names(v))
    repl = [f">>> from {pkg} import {', '.join(used)}"] if used else []
    for k, (source, printed) in enumerate(got.shown):
        repl += _prompted(source)
        if printed and got.raised is not None and k == len(got.shown) - 1:
            repl += ["Traceback (most recent call last):", "  ...", printed]
        elif printed:
            repl.append(printed)
    want = expected.shown[-1][1] if expected.raised is not None else repr(expected.value)
    if len(got.shown) < len(expected.shown):  # the bug stopped the session early: say how it should end
        want = "\n".join([*_prompted(expected.shown[-1][0]), want])
    title = v.title(v.site)
    return (
        f"{title}\n\n"
        f"Using `{pkg}` ({template.about}). {rng.choice(_LEADS)}\n\n"
        + "\n".join(repl)
        + f"\n\n{rng.choice(_EXPECT)}\n\n{want}\n"
    )
