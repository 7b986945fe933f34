"""Repositories in sandboxes: placing one, running pytest on it, taking the agent's diff, and grading a fix as
SWE-bench does (docs/design.md, "Repository tasks").

Grading never happens where the agent worked. The agent's diff is taken from its sandbox, filtered (test files,
`conftest.py`, `.pth` files, `sitecustomize`/`usercustomize`, pytest and packaging config and package metadata are
left out: changing how tests run is not a fix), applied to a clean checkout in a fresh sandbox, and graded there.
The hidden tests never enter the agent's sandbox.

Two ways to grade, by what the instance holds:

- value tests (`RepoInstance.checks`: every generated instance): each FAIL_TO_PASS and PASS_TO_PASS test's code runs
  in the grader's worker beside the package and reports only the plain values of its checked expressions; the
  grader, a separate non-dumpable process that never imports the repository, holds the expected values and judges
  (`run_value_tests`, `sandboxes/programs/grader.py`). The hidden tests are sent to it, never written to a file. The
  package can change what its own process reports, but passing takes the expected values, which it can only learn
  by computing them.
- pytest (loaded, `swebench:` instances): the base, the diff and the hidden tests placed, pytest run on them. The
  package runs inside the pytest process that grades it, so this is best effort, with its limits in the README:
  every test file must still hold what was placed after the run (a fix that rewrites its tests scores 0), and a
  test pytest did not report counts as failed (a fix that exits the process or stops collection scores 0).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import io
import json
import posixpath
import re
import secrets
import tarfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from agentrl.env import tamper
from agentrl.env.grading import run_tests
from agentrl.sandbox import BwrapSandbox, BwrapSandboxConfig, DockerSandbox, Sandbox, SandboxConfig, SandboxError
from agentrl.sandbox.docker_sandbox import DockerSandboxConfig, docker_client
from agentrl.sandbox.image import instance_image, sandboxes_dir, saved_image_rootfs
from agentrl.tasks import ValueTests
from agentrl.tasks.repos.instance import PatchError, RepoInstance, apply_patch, make_patch
from agentrl.tasks.repos.validate import (
    TestOutcome,
    ValidationReport,
    judge,
    parse_junit,
    patch_problem,
    validation_trees,
)

WORK = "/work"
REPO = "repo"
"""the repository's folder, relative to the sandbox's work dir (`/work/repo`)"""
STATE = ".agentrl"
"""the episode's own files beside it (the bash tool's shell state), relative to the work dir"""

_TEST_DIRS = {"tests", "test", "testing"}
_CONFIG = {"pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "setup.py", "noxfile.py"}


def is_test_path(path: str) -> bool:
    """A test file, as SWE-bench's harness tells them: in a tests/ folder, `test_*.py`, `*_test.py`, `conftest.py`."""
    *dirs, name = path.split("/")
    return bool(_TEST_DIRS & set(dirs)) or bool(re.fullmatch(r"test_.*\.py|.*_test\.py|conftest\.py", name))


def excluded(path: str) -> str | None:
    """Why a changed path is left out of the agent's diff, or None when it is part of the fix."""
    *dirs, name = path.split("/")
    if name == "conftest.py":
        return "conftest.py"
    if is_test_path(path):
        return "a test file"
    if name.endswith(".pth"):
        return "a .pth file"
    if name in ("sitecustomize.py", "usercustomize.py"):
        return name
    if name in _CONFIG:
        return "pytest or packaging config"
    if any(d.endswith((".dist-info", ".egg-info")) for d in dirs) or name.endswith((".dist-info", ".egg-info")):
        return "package metadata (plugins are declared there)"
    return None


def repo_path(path: str) -> str:
    """A path the agent gave, relative to the repository (`/work/repo/x`, `./x` and `x` alike); ValueError when it
    leaves the repository or holds a NUL byte."""
    if "\0" in path:  # no name of a file can hold one (open() refuses it)
        raise ValueError(f"{path!r} holds a NUL byte, which no path can; give the path without it")
    if path.startswith(f"{WORK}/{REPO}/") or path == f"{WORK}/{REPO}":
        path = path[len(f"{WORK}/{REPO}/") :]
    elif path.startswith("/"):
        raise ValueError(f"{path} is outside the repository ({WORK}/{REPO}); give a path inside it")
    norm = posixpath.normpath(path or ".")
    if norm == ".." or norm.startswith("../"):
        raise ValueError(f"{path} is outside the repository")
    return norm


@functools.cache
def program(name: str) -> str:
    """The text of a program of sandboxes/programs/ (read once)."""
    return (sandboxes_dir() / "programs" / name).read_text()


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def _tree(sandbox: Sandbox, request: dict, timeout_s: float = 60.0) -> dict:
    # The answer comes back by a file, read whole: a diff's texts pass the executor's cap on a program's output
    # (1 MiB) with one large new file, which would leave the fix beside it ungraded. A new name each time, so that
    # nothing the agent left can stand in for it.
    answer = f"/tmp/agentrl-tree-{secrets.token_hex(8)}.json"
    r = await sandbox.run_python(
        program("tree.py"), stdin=json.dumps(request | {"answer": answer}), timeout_s=timeout_s
    )
    if not r.ok:
        raise RepoError(f"{request['op']} in the sandbox ended with {r.status}: {r.stderr[-500:]}")
    try:
        return json.loads(await sandbox.read_file(answer))
    except (OSError, ValueError) as e:  # refused or garbled: the agent's code ran there (ValueError: bad JSON too)
        raise RepoError(f"{request['op']} in the sandbox left no answer: {e}") from None


_image_lock = threading.Lock()


@functools.cache
def _image_tag(tarball: str) -> str:
    with _image_lock:  # one build per image, however many episodes ask at once
        return instance_image(docker_client(), Path(tarball), log=lambda m: None)


@functools.cache
def _image_rootfs(tarball: str) -> Path:
    with _image_lock:  # one unpacking per image, however many episodes ask at once
        return saved_image_rootfs(Path(tarball), log=lambda m: None)


async def image_sandbox(tarball: str, config: SandboxConfig) -> Sandbox:
    """A sandbox of `config`'s backend running an instance's own image (`RepoInstance.image`), made ready on first
    use in this process: on docker the sandbox image built on it, on bwrap its root filesystem unpacked from the
    tarball (no Docker needed). Every other setting is the backend's default sandbox's: the same lockdown. Local
    sandboxes run on the host, not in an image, so they refuse it; SandboxError too for an image that cannot be used."""
    if config.backend == "local":
        raise SandboxError(
            f"the instance's image {tarball} needs a docker or bwrap sandbox: local ones run on the host, not in it"
        )
    try:
        if config.backend == "bwrap":
            rootfs = await asyncio.to_thread(_image_rootfs, tarball)
        else:
            tag = await asyncio.to_thread(_image_tag, tarball)
    except (OSError, RuntimeError, ValueError) as e:
        raise SandboxError(f"the instance's image {tarball} cannot be used: {e}") from e
    if config.backend == "bwrap":
        return await BwrapSandbox.create(BwrapSandboxConfig(rootfs=rootfs))
    return await DockerSandbox.create(DockerSandboxConfig(image=tag))


class RepoError(RuntimeError):
    """The repository could not be read from the sandbox (the agent's own doing: a tree too big, a walk cut short)."""


async def place(sandbox: Sandbox, files: Mapping[str, str], root: str = REPO) -> None:
    """Put `files` at `root` (relative to the work dir), removing what was there and the episode's state: one tar
    written into the sandbox and unpacked there, whatever the number of files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(files):
            data = files[path].encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    tar_path = f"/tmp/agentrl-place-{secrets.token_hex(4)}.tar"
    await sandbox.write_file(tar_path, buf.getvalue())
    request = {"op": "place", "root": f"{WORK}/{root}", "clear": [f"{WORK}/{root}", f"{WORK}/{STATE}"], "tar": tar_path}
    try:
        await _tree(sandbox, request)
    except RepoError as e:
        raise SandboxError(f"placing the repository failed: {e}") from e  # nothing of the agent's ran yet


class Changes(BaseModel):
    """How the repository in a sandbox differs from the files placed there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    changed: dict[str, str]
    """new or changed files, path -> text"""
    deleted: list[str]
    skipped: dict[str, str]
    """paths not read, and why (a symlink, binary, too large)"""

    def tree(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` with these changes."""
        out = {p: t for p, t in base.items() if p not in set(self.deleted)}
        return out | self.changed


async def changes(
    sandbox: Sandbox,
    base: Mapping[str, str],
    root: str = REPO,
    *,
    max_file_bytes: int = 1 << 20,
    max_total_bytes: int = 8 << 20,
    timeout_s: float = 60.0,
) -> Changes:
    """What changed at `root` since `base` was placed there; RepoError when the sandbox cannot say. The texts' total
    is bounded so that their JSON (up to 6 characters a byte) fits the 64 MiB a sandbox's program may write."""
    request = {
        "op": "diff",
        "root": f"{WORK}/{root}",
        "known": {p: _sha(t) for p, t in base.items()},
        "max_file_bytes": max_file_bytes,
        "max_total_bytes": max_total_bytes,
    }
    return Changes(**await _tree(sandbox, request, timeout_s))


class AgentDiff(BaseModel):
    """The agent's diff: what grading applies, and what it left out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    patch: str
    """a unified diff of the kept changes, against the base"""
    files: list[str]
    """the files it changes"""
    left_out: dict[str, str]
    """changed paths not in the patch, and why (test files, config, ... and what could not be read)"""


def agent_diff(base: Mapping[str, str], found: Changes) -> AgentDiff:
    """Split the changes into the fix (`patch`) and what is left out of it."""
    left_out = dict(found.skipped)
    after = dict(base)
    for path in found.deleted:
        if (why := excluded(path)) is not None:
            left_out[path] = why
        else:
            after.pop(path, None)
    for path, text in found.changed.items():
        if (why := excluded(path)) is not None:
            left_out[path] = why
        else:
            after[path] = text
    files = sorted(p for p in set(base) | set(after) if base.get(p) != after.get(p))
    return AgentDiff(patch=make_patch(base, after), files=files, left_out=dict(sorted(left_out.items())))


def bash_argv(command: str) -> list[str]:
    """bash running `command` with the episode's shell state (cwd, exported variables) restored before and saved
    after (`sandboxes/programs/shell.sh`)."""
    return ["bash", "-c", program("shell.sh"), "agentrl-bash", command]


def pytest_argv(args: Sequence[str], *, plugin_dir: str | None = None) -> list[str]:
    """python3 running pytest on `args` in the repository's folder: pytest is imported before the repository joins
    the path, so no file of the repository can stand in for it; isolated mode ignores PYTHON* variables. Among them
    is the PYTHONPATH a bwrap sandbox's executor gives every program, with the test tools bound in from the host:
    it is appended after the interpreter's own path, where a Docker sandbox image's .pth file puts them. With a
    `plugin_dir`, the integrity plugin there is imported with pytest, before the repository joins the path (so no
    file of it stands in for the plugin either, and the plugin takes its token from the environment first), and
    loaded (`-p`)."""
    imports = "pytest"
    if plugin_dir:
        imports += f"; sys.path.append({plugin_dir!r}); import {tamper.PLUGIN}; sys.path.remove({plugin_dir!r})"
        args = ["-p", tamper.PLUGIN, *args]
    code = (
        "import os, sys; sys.path += [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]; "
        f"import {imports}; sys.path.insert(0, '.'); sys.exit(pytest.main(sys.argv[1:]))"
    )
    return ["python3", "-I", "-c", code, "-p", "no:cacheprovider", *args]


class PytestRun(NamedTuple):
    outcomes: dict[str, TestOutcome]
    tampered: str | None
    """why the run does not count (the integrity plugin's verdict: `agentrl.env.tamper`), None when it does"""


async def run_pytest(
    sandbox: Sandbox, node_ids: Sequence[str], *, root: str = REPO, timeout_s: float = 60.0, plugins: bool = False
) -> PytestRun:
    """Run the files of `node_ids` at `root` and say how each node ended; `missing` when pytest did not report it
    (a collection error, a time-out, a process that died). Plugins installed in the image load only if `plugins`.

    The integrity plugin (`sandboxes/programs/pytest_integrity.py`, written to a folder of its own with a fresh
    token) watches pytest's reporting machinery from inside the run; a run whose verdict is not `clean` is
    `tampered`, whatever the report says (best effort: the package runs in that process too)."""
    outcomes: dict[str, TestOutcome] = dict.fromkeys(node_ids, "missing")
    files = sorted({n.split("::")[0] for n in node_ids})
    token = secrets.token_hex(16)  # the files' names are other random words: the junit path is in pytest's argv
    report, verdict = (f"/tmp/agentrl-{kind}-{secrets.token_hex(8)}" for kind in ("junit", "integrity"))
    plugin_dir = f"/tmp/agentrl-plugin-{secrets.token_hex(8)}"
    await sandbox.write_file(f"{plugin_dir}/{tamper.PLUGIN}.py", program(f"{tamper.PLUGIN}.py"))
    args = ["-q", "--continue-on-collection-errors", f"--rootdir={WORK}/{root}", f"--junitxml={report}.xml", *files]
    env = tamper.integrity_env(token, verdict) | ({} if plugins else {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    r = await sandbox.run(pytest_argv(args, plugin_dir=plugin_dir), cwd=root, env=env, timeout_s=timeout_s)
    if r.status == "timeout":
        return PytestRun(outcomes, None)
    try:
        said = (await sandbox.read_file(verdict)).decode(errors="replace")
    except (OSError, ValueError):  # none, or one the sandbox refused (the run's code made a FIFO, ...)
        said = None
    # No verdict (pytest's session never ended: an exit on import) voids the run too: nothing it reported counts.
    if (tampered := tamper.integrity_verdict(said, token)) is not None:
        return PytestRun(outcomes, tampered)
    try:
        xml = (await sandbox.read_file(f"{report}.xml")).decode(errors="replace")
    except (OSError, ValueError):  # no report (pytest never got to write it), or one refused: a FIFO, too big
        return PytestRun(outcomes, None)
    try:
        for node, outcome in parse_junit(xml, dict.fromkeys(files, "")).items():
            if node in outcomes:
                outcomes[node] = outcome
    except Exception:  # a report the agent's code garbled: nothing in it counts
        return PytestRun(dict.fromkeys(node_ids, "missing"), None)
    return PytestRun(outcomes, None)


class RepoGrade(BaseModel):
    """How a fix fared on the hidden tests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fail_to_pass: dict[str, TestOutcome]
    pass_to_pass: dict[str, TestOutcome]
    problem: str | None = None
    """why nothing ran or nothing counts: the diff did not apply, or the tests were tampered with"""
    tampered: bool = False
    """the grade is void because the diff or the run tampered with pytest's grading (pytest path only: the scan of
    the diff, or the integrity plugin); the problem says how"""

    @property
    def broke(self) -> int:
        return sum(o != "passed" for o in self.pass_to_pass.values())

    @property
    def missing(self) -> bool:
        """Some test has no outcome: it never ran, or ran out of time."""
        return any(o == "missing" for o in (*self.fail_to_pass.values(), *self.pass_to_pass.values()))

    @property
    def fixed(self) -> int:
        return sum(o == "passed" for o in self.fail_to_pass.values())

    @property
    def resolved(self) -> bool:
        """SWE-bench's verdict: every FAIL_TO_PASS test passes, and every PASS_TO_PASS test still does."""
        return self.problem is None and self.fixed == len(self.fail_to_pass) and self.broke == 0

    def outcome(self, rule: Literal["fraction", "all"]) -> float:
        """`all`: 1 when resolved, else 0. `fraction`: the share of FAIL_TO_PASS tests that pass, and 0 if any
        PASS_TO_PASS test broke (a fix that breaks what worked is no fix)."""
        if rule == "all" or self.problem is not None or self.broke:
            return float(self.resolved)
        return self.fixed / len(self.fail_to_pass)

    def summary(self) -> str:
        """What the agent may read: counts only, no test names or contents."""
        if self.problem is not None:
            return f"Not graded: {self.problem}."
        verdict = "Resolved." if self.resolved else "Not resolved."
        kept = len(self.pass_to_pass) - self.broke
        return (
            f"{verdict} {self.fixed}/{len(self.fail_to_pass)} of the tests that showed the issue pass; "
            f"{kept}/{len(self.pass_to_pass)} of the tests that passed before still do."
        )


VALUE_TEST_TIMEOUT_S = 10.0
"""one value test's limit, its package's import included (a test that outruns it fails, `missing`)"""


async def run_value_tests(
    sandbox: Sandbox, instance: RepoInstance, tree: Mapping[str, str], *, timeout_s: float = 120.0
) -> dict[str, TestOutcome]:
    """Place `tree` (a repository without the hidden tests: they travel to the grader, never to a file) and run the
    instance's value tests on it (`RepoInstance.checks`): the package runs in the grader's worker, which reports
    only plain values, and the grader, out of its reach, judges each test (`sandboxes/programs/grader.py`). A test
    cut short by a time-out or a dead worker is `missing`; a killed grader leaves every test `missing`."""
    nodes = [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]
    await place(sandbox, tree)
    root = f"{WORK}/{REPO}"
    tests = ValueTests(tests=[instance.checks[n] for n in nodes])
    prelude = f"import os, sys\nos.chdir({root!r})\nsys.path.insert(0, {root!r})\n"  # the worker's load: where from
    result = await run_tests(sandbox, tests, prelude, test_timeout_s=VALUE_TEST_TIMEOUT_S, max_total_s=timeout_s)
    ended: dict[str | None, TestOutcome] = {None: "passed", "timeout": "missing", "crash": "missing"}
    return {
        n: "passed" if o.passed else ended.get(o.where, "failed") for n, o in zip(nodes, result.outcomes, strict=True)
    }


async def grade(
    sandbox: Sandbox, instance: RepoInstance, patch: str, *, timeout_s: float = 120.0, plugins: bool = False
) -> RepoGrade:
    """Grade `patch` (the agent's diff) on `instance` in `sandbox`, a fresh one. With value tests (generated
    instances): the base with the patch, graded out of the package's reach (`run_value_tests`). Otherwise the base
    with the patch and the hidden tests applied, the instance's tests run by pytest, and the test files checked
    afterwards."""
    failed = {
        "fail_to_pass": dict.fromkeys(instance.FAIL_TO_PASS, "missing"),
        "pass_to_pass": dict.fromkeys(instance.PASS_TO_PASS, "missing"),
    }
    try:
        fixed = apply_patch(instance.repo, patch)
        files = apply_patch(fixed, instance.test_patch)
    except PatchError as e:
        return RepoGrade(**failed, problem=f"the change and the hidden tests conflict ({e})")
    if instance.checks is not None:
        outcomes = await run_value_tests(sandbox, instance, fixed, timeout_s=timeout_s)
    else:
        if (reason := tamper.tampering(patch)) is not None:
            return RepoGrade(**failed, problem=f"tampered: {reason}", tampered=True)
        await place(sandbox, files)
        run = await run_pytest(
            sandbox, [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS], timeout_s=timeout_s, plugins=plugins
        )
        if run.tampered is not None:
            return RepoGrade(**failed, problem=f"tampered: {run.tampered}", tampered=True)
        outcomes = run.outcomes
        try:
            after = await changes(sandbox, files)
        except RepoError:
            return RepoGrade(**failed, problem="the test files could not be checked after the run")
        touched = [p for p in [*after.changed, *after.deleted] if p in files and is_test_path(p)]
        if touched:
            touched_list = ", ".join(sorted(touched)[:3])
            return RepoGrade(**failed, problem=f"the tests were changed while they ran ({touched_list})")
    return RepoGrade(
        fail_to_pass={n: outcomes[n] for n in instance.FAIL_TO_PASS},
        pass_to_pass={n: outcomes[n] for n in instance.PASS_TO_PASS},
    )


async def validate_instance(
    instance: RepoInstance, sandbox: Sandbox, *, timeout_s: float = 120.0, plugins: bool = False
) -> ValidationReport:
    """`agentrl.tasks.repos.validate` in a sandbox (the instance's own image, for a loaded one): FAIL_TO_PASS fails
    and PASS_TO_PASS passes on the base, and everything passes with the gold patch, graded as a fix is: by the value
    tests where the instance has them, else by pytest with the hidden tests added to both trees."""
    try:
        base, gold = validation_trees(instance)
    except ValueError as e:
        return patch_problem(instance, e)
    nodes = [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]
    outcomes = []
    if instance.checks is not None:
        for tree in (instance.repo, apply_patch(instance.repo, instance.patch)):
            outcomes.append(await run_value_tests(sandbox, instance, tree, timeout_s=timeout_s))
        return judge(instance, *outcomes)
    tampered = []
    for name, tree in (("base", base), ("gold patch", gold)):
        await place(sandbox, tree)
        run = await run_pytest(sandbox, nodes, timeout_s=timeout_s, plugins=plugins)
        outcomes.append(run.outcomes)
        if run.tampered is not None:  # a false alarm of the integrity plugin, on the instance's own code
            tampered.append(f"the integrity check voids the run on the {name}: {run.tampered}")
    report = judge(instance, *outcomes)
    return report.model_copy(update={"problems": [*tampered, *report.problems]}) if tampered else report
