"""A SWE-bench-style instance: a repository, an issue, a gold patch and the hidden tests that grade a fix.

The fields keep SWE-bench's names (`FAIL_TO_PASS`, `PASS_TO_PASS` included), so a JSONL loader maps a
record onto this model field for field. A repository is held as files (path -> text); a generated one
is small enough to live in memory, and a loaded one is read from its tarball or git folder into the same
shape.

Patches are unified diffs with git's headers (`diff --git a/p b/p`, `new file mode`, `deleted file mode`),
so `git apply` takes ours and `apply_patch` takes SWE-bench's.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, model_validator

from agentrl.tasks.base import ValueTest

NODE_ID = re.compile(r"^[\w./-]+\.py::\S+$")
"""a pytest node id: `tests/test_parse.py::test_empty_line` (a class level, `::Class::test`, allowed)"""


class RepoInstance(BaseModel):
    """One repository-level task. The agent sees `repo` and `problem_statement`; the grader alone holds
    `test_patch`, `FAIL_TO_PASS` and `PASS_TO_PASS`, and `patch` is the known fix (for validation and
    demonstrations, never for the agent).

    The visible tests are files of `repo`; the hidden tests arrive only through `test_patch`. A fix passes
    when, on `repo` + the agent's diff of non-test files + `test_patch`, every FAIL_TO_PASS test passes and
    every PASS_TO_PASS test still does.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    instance_id: str
    """unique and stable, e.g. `repo-inifile-17` for a generated one"""
    repo: dict[str, str]
    """the base repository, path (relative, `/`-separated) -> text"""
    base_commit: str
    """the commit the base is at; a content hash of `repo` for generated repositories"""
    problem_statement: str
    """the issue: a failing behaviour or a traceback, never the fix"""
    patch: str
    """the gold patch: a unified diff of non-test files that fixes the issue"""
    test_patch: str
    """a unified diff adding or changing the hidden test files"""
    FAIL_TO_PASS: list[str]
    """pytest node ids that fail on the base and must pass after the fix"""
    PASS_TO_PASS: list[str]
    """pytest node ids that pass on the base and must keep passing"""
    image: str | None = None
    """path of a per-instance image tarball holding the repository's dependencies; None: the default image"""
    template: str | None = None
    """the repository template a generated instance came from; None for loaded instances"""
    family: str | None = None
    """the planted bug's family (`off_by_one`, ...) for generated instances; None for loaded ones"""
    checks: dict[str, ValueTest] | None = None
    """every FAIL_TO_PASS and PASS_TO_PASS test as a value test (`agentrl.tasks.repos.checks`), with the outcomes the
    original package gave: then grading runs them out of the package's reach, not in pytest. Generated instances
    have them; None (loaded instances): graded by pytest, inside the package's process"""

    @model_validator(mode="after")
    def _check(self) -> RepoInstance:
        bad = [n for n in self.FAIL_TO_PASS + self.PASS_TO_PASS if not NODE_ID.match(n)]
        if bad:
            raise ValueError(f"{self.instance_id}: not pytest node ids (`path.py::test_name`): {bad[:3]}")
        both = sorted(set(self.FAIL_TO_PASS) & set(self.PASS_TO_PASS))
        if both:
            raise ValueError(f"{self.instance_id}: tests in both FAIL_TO_PASS and PASS_TO_PASS: {both[:3]}")
        if not self.FAIL_TO_PASS:
            raise ValueError(f"{self.instance_id}: FAIL_TO_PASS is empty; an instance needs a test that shows the bug")
        if self.checks is not None and set(self.checks) != {*self.FAIL_TO_PASS, *self.PASS_TO_PASS}:
            raise ValueError(f"{self.instance_id}: `checks` must hold exactly the FAIL_TO_PASS and PASS_TO_PASS tests")
        return self


def content_hash(files: Mapping[str, str]) -> str:
    """A stable hash of a file tree (sorted paths and texts): the `base_commit` of a generated repository."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(f"{len(path)}:{path}{len(files[path])}:".encode())
        h.update(files[path].encode())
    return h.hexdigest()[:40]


# ----------------------------------------------------------------------------------------------------------------
# Unified diffs. We apply them in pure Python rather than with `patch` or `git apply`: the grader applies patches
# inside a sandbox that has no git (and `patch`'s fuzz would accept a diff that does not match), and a pure
# function is testable without a shell.

_NO_EOL = "\\ No newline at end of file"


class PatchError(ValueError):
    """A diff that does not apply: names the file and the hunk."""


def make_patch(before: Mapping[str, str], after: Mapping[str, str], *, context: int = 3) -> str:
    """The unified diff taking `before` to `after` (files created, deleted and changed), git-style headers."""
    out: list[str] = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        out.append(f"diff --git a/{path} b/{path}\n")
        if old is None:
            out.append("new file mode 100644\n")
        elif new is None:
            out.append("deleted file mode 100644\n")
        a = "/dev/null" if old is None else f"a/{path}"
        b = "/dev/null" if new is None else f"b/{path}"
        lines = list(difflib.unified_diff(git_lines(old or ""), git_lines(new or ""), a, b, n=context))
        if not lines:  # an empty file created or deleted: headers without hunks
            lines = [f"--- {a}\n", f"+++ {b}\n"]
        for line in lines:
            # difflib ends header lines with "\n" but a last line without one stays bare: git marks it.
            out.append(line if line.endswith("\n") else f"{line}\n{_NO_EOL}\n")
    return "".join(out)


def git_lines(text: str) -> list[str]:
    """The lines as git and diff count them (and grep, sed and tracebacks number them), each with its "\n" (the
    last may have none): str.splitlines would also break at a form feed, a lone "\r", "\u2028" and the like, which a
    source file may hold within a line."""
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def apply_patch(files: Mapping[str, str], diff: str) -> dict[str, str]:
    """`files` with the unified diff applied (a new dict; `files` is left as it was).

    Each hunk's removed and context lines must match the file exactly: first where the header says, else at
    the one place after the previous hunk where they do (a header counts lines of the file before the diff).
    Otherwise PatchError names the file, the hunk and the first line that differs.
    """
    result = dict(files)
    for old_path, new_path, hunks in _parse(diff):
        path = new_path or old_path
        assert path is not None, "a file section names at least one side"
        if old_path is None:
            if path in result:
                raise PatchError(f"{path}: the diff creates it, but it already exists")
            source: list[str] = []
        else:
            if old_path not in result:
                raise PatchError(f"{old_path}: the diff changes it, but there is no such file")
            source = git_lines(result[old_path])
        patched = "".join(_apply_hunks(path, source, hunks))
        if old_path is not None:
            del result[old_path]
        if new_path is not None:
            result[new_path] = patched
        elif patched:
            raise PatchError(f"{old_path}: the diff deletes it, but the file holds more than the diff removes")
    return result


class _Hunk:
    def __init__(self, header: str, start: int):
        self.header = header
        self.start = start
        """1-based line of the old file where the hunk begins (0 for an empty old side)"""
        self.old: list[str] = []
        self.new: list[str] = []


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _side(name: str) -> str | None:
    name = name.split("\t")[0].strip()
    if name == "/dev/null":
        return None
    return name[2:] if name[:2] in ("a/", "b/") else name


def _parse(diff: str) -> list[tuple[str | None, str | None, list[_Hunk]]]:
    """File sections of a diff: (old path or None when created, new path or None when deleted, hunks)."""
    sections: list[tuple[str | None, str | None, list[_Hunk]]] = []
    lines = git_lines(diff)
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- "):
            i += 1  # `diff --git`, `index`, mode lines and commentary carry nothing we need
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"line {i + 1} of the diff: `---` not followed by `+++`")
        old, new = _side(line[4:]), _side(lines[i + 1][4:])
        if old is None and new is None:
            raise PatchError(f"line {i + 1} of the diff: both sides are /dev/null")
        i += 2
        hunks: list[_Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _read_hunk(lines, i, old or new or "")
            hunks.append(hunk)
        sections.append((old, new, hunks))
    return sections


def _read_hunk(lines: list[str], i: int, path: str) -> tuple[_Hunk, int]:
    m = _HUNK.match(lines[i])
    if not m:
        raise PatchError(f"{path}: malformed hunk header {lines[i].strip()!r}")
    n_old = 1 if m[2] is None else int(m[2])
    n_new = 1 if m[4] is None else int(m[4])
    hunk = _Hunk(lines[i].strip(), int(m[1]))
    i += 1
    last_tag = ""
    while len(hunk.old) < n_old or len(hunk.new) < n_new or (i < len(lines) and lines[i].startswith("\\")):
        if i >= len(lines):
            raise PatchError(f"{path}: hunk {hunk.header} ends early (the diff is cut short)")
        line = lines[i]
        tag, body = line[:1], line[1:]
        if line == "\n":  # a context line of an empty line whose space a tool stripped
            tag, body = " ", "\n"
        i += 1
        if tag == "\\":  # `\ No newline at end of file`: the line before it had no newline
            for side, tags in ((hunk.old, " -"), (hunk.new, " +")):
                if last_tag in tags and side:
                    side[-1] = side[-1].removesuffix("\n")
            continue
        if tag not in " -+":
            raise PatchError(f"{path}: hunk {hunk.header}: unexpected line {line.rstrip()!r}")
        if tag in " -":
            hunk.old.append(body)
        if tag in " +":
            hunk.new.append(body)
        last_tag = tag
    return hunk, i


def _apply_hunks(path: str, source: list[str], hunks: list[_Hunk]) -> list[str]:
    out: list[str] = []
    pos = 0  # next unconsumed line of source (0-based); hunk headers number the old file, so no shift is kept
    for k, hunk in enumerate(hunks, 1):
        want = hunk.start - 1 if hunk.old else hunk.start  # an empty old side inserts after line `start`
        at = want if _matches(source, want, hunk.old) and want >= pos else _find(source, pos, hunk.old)
        if at is None:
            raise PatchError(f"{path}: hunk #{k} ({hunk.header}) does not apply: {_mismatch(source, want, hunk.old)}")
        out += source[pos:at] + hunk.new
        pos = at + len(hunk.old)
    return out + source[pos:]


def _matches(source: list[str], at: int, block: list[str]) -> bool:
    return source[at : at + len(block)] == block


def _find(source: list[str], start: int, block: list[str]) -> int | None:
    """The one place at or after `start` where `block` matches exactly; None when none or several do."""
    hits = [at for at in range(start, len(source) - len(block) + 1) if _matches(source, at, block)]
    return hits[0] if len(hits) == 1 else None


def _mismatch(source: list[str], at: int, block: list[str]) -> str:
    for j, expected in enumerate(block):
        found = source[at + j] if at + j < len(source) else None
        if found != expected:
            where = f"line {at + j + 1}"
            return f"expected {where} to read {expected!r}, found {'end of file' if found is None else repr(found)}"
    return "its lines match at several places but not where the header says"
