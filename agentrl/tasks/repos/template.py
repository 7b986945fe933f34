"""Repository templates and the bug sites they declare.

A *template* is a small Python package (3-8 modules, docstrings, relative imports between them) with
its own passing pytest suite. A *site* is one place a bug can be planted: the text `original` in one of
its modules becomes `buggy`, so the gold patch is the reverse edit. A site also says how the bug shows:
an `example` session over the package's public names (what the issue shows), and `checks`, more
sessions that the hidden tests run. The generator computes every expected value by running the original
package, so a template never states an output by hand.

Template text is rendered before use: `@pkg@` is the package's name for this instance and `@NAME@` one
of the template's `params` (identifier names or constants that vary between instances).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

Family = Literal[
    "off_by_one", "wrong_operator_or_constant", "missing_case", "wrong_cross_module_call", "parsing_or_config"
]
FAMILIES: tuple[Family, ...] = get_args(Family)
"""off_by_one: a bound or index one off. wrong_operator_or_constant: `<` for `<=`, `-` for `+`, a wrong number.
missing_case: a branch or edge case removed. wrong_cross_module_call: a call into another module of the package
names the wrong helper or passes arguments in the wrong order. parsing_or_config: a wrong delimiter, default or key."""

_MARKER = re.compile(r"@(\w+)@")


@dataclass(frozen=True)
class Site:
    """One plantable bug: `original` (exactly once in `module`) becomes `buggy`."""

    id: str
    """short and unique within its template (a Python identifier: it names the hidden tests)"""
    family: Family
    module: str
    """the module's path inside the package, e.g. `parser.py`"""
    original: str
    buggy: str
    """what replaces `original`; empty for a removed branch"""
    title: str
    """the issue's first line: the symptom in a user's words, never the fix, the file or the code"""
    example: str
    """Python statements over the package's public names, the last an expression: the issue's reproducer"""
    checks: tuple[str, ...] = ()
    """more sessions like `example` that the hidden tests run (each one test)"""

    def sessions(self) -> tuple[str, ...]:
        return (self.example, *self.checks)


@dataclass(frozen=True)
class Template:
    """A repository to plant bugs in. Paths in `modules` are inside the package, those in `tests` inside `tests/`.

    The visible tests (`tests`) pass on the original and on every buggy version: the agent reproduces the issue
    itself. `packages` and `params` give the names and constants that vary between instances.
    """

    name: str
    """the template's id (lowercase letters); instance ids are `repo-<name>-<n>`"""
    about: str
    """what the package does, a few words for the issue (`a parser for INI files`)"""
    packages: tuple[str, ...]
    """names the package takes, one per instance; none may shadow a standard-library module"""
    modules: Mapping[str, str]
    tests: Mapping[str, str]
    sites: tuple[Site, ...]
    params: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """`@NAME@` -> the values it takes (identifier names, constants)"""

    def files(self, pkg: str, values: Mapping[str, str]) -> dict[str, str]:
        """The repository's files for package name `pkg` and parameter values `values`."""
        texts = {f"{pkg}/{path}": text for path, text in self.modules.items()}
        texts |= {f"tests/{path}": text for path, text in self.tests.items()}
        return {path: self.render(text, pkg, values) for path, text in texts.items()}

    def render(self, text: str, pkg: str, values: Mapping[str, str]) -> str:
        """`text` with its `@pkg@` and `@NAME@` markers filled in; KeyError for a marker it does not know."""

        def fill(m: re.Match[str]) -> str:
            name = m[1]
            if name == "pkg":
                return pkg
            if name not in values:
                raise KeyError(f"template {self.name}: unknown marker @{name}@ (params: {sorted(self.params)})")
            return values[name]

        return _MARKER.sub(fill, text)
