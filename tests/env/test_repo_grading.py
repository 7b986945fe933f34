"""Grading a generated repo_fix instance out of its package's reach (value tests: `agentrl.tasks.repos.checks`).

Hostile submissions put their code in the package's `__init__.py` (a non-test file, which the diff filter keeps) on
top of the buggy package, and each must earn no more than a submission of no change, on two instances and on both
backends. The first is the hack that took pytest's grading: on import, patch pytest's reports so that failures read
as passes (it earned 1.0 where doing nothing earns 0 before the value tests).
"""

from __future__ import annotations

import functools
import json

import pytest

from agentrl.env.repos import grade, validate_instance
from agentrl.sandbox import BwrapSandbox, BwrapSandboxConfig
from agentrl.tasks.repos import apply_patch, generate, make_patch
from agentrl.tasks.repos.generate import variant

INSTANCES = ["repo-inifile-3", "repo-roman-3"]

PATCHES_PYTEST_REPORTS = """
try:
    from _pytest import reports as _reports
except ImportError:
    _reports = None
if _reports is not None:
    _make = _reports.TestReport.from_item_and_call.__func__

    def _passed(cls, item, call):
        report = _make(cls, item, call)
        report.outcome, report.longrepr = "passed", None
        return report

    _reports.TestReport.from_item_and_call = classmethod(_passed)
"""
PATCHES_PYTEST_RUNNER = """
try:
    from _pytest import runner as _runner
except ImportError:
    _runner = None
if _runner is not None:
    _from_call = _runner.CallInfo.from_call.__func__

    def _swallowed(cls, func, when, reraise=None):
        def quiet():
            try:
                return func()
            except Exception:
                return None

        return _from_call(cls, quiet, when, reraise)

    _runner.CallInfo.from_call = classmethod(_swallowed)
"""
PATCHES_ASSERTION_REWRITING = """
try:
    import ast as _ast
    from _pytest.assertion import rewrite as _rewrite
except ImportError:
    _rewrite = None
if _rewrite is not None:

    class _NoAsserts(_ast.NodeTransformer):
        def visit_Assert(self, node):
            return _ast.Pass()

    def _strip(mod, *args, **kwargs):
        _ast.fix_missing_locations(_NoAsserts().visit(mod))

    _rewrite.rewrite_asserts = _strip
"""
PATCHES_UNITTEST = """
import unittest as _unittest


def _succeed(self, result=None):
    result.startTest(self)
    result.addSuccess(self)
    result.stopTest(self)


_unittest.TestCase.run = _succeed
_unittest.TestCase.__call__ = _succeed
"""
REPLACES_BUILTINS = """
import builtins as _builtins

_builtins.isinstance = lambda obj, kind: True
_builtins.all = lambda items: True
_builtins.any = lambda items: True
_builtins.AssertionError = type("AssertionError", (Exception,), {})
_builtins.repr = lambda obj: "True"
"""
# Results as a pytest JUnit report and as the value grader's replies, every test passing; written at exit, and by a
# child forked at import that outlives the grading.
FAKE_RESULTS = """
import glob as _glob, os as _os, re as _re


def _fake_results():
    tests = [
        (path, name)
        for path in _glob.glob("/work/repo/tests/*.py")
        for name in _re.findall(r"^def (test\\w*)", open(path).read(), _re.M)
    ]
    cases = "".join(
        f'<testcase classname="tests.{_os.path.basename(p)[:-3]}" name="{n}" file="tests/{_os.path.basename(p)}"/>'
        for p, n in tests
    )
    xml = f'<testsuites><testsuite name="pytest" tests="{len(tests)}">{cases}</testsuite></testsuites>'
    for path in _glob.glob("/tmp/agentrl-junit-*.xml") + ["/tmp/agentrl-junit-fake.xml", "/work/results.xml"]:
        try:
            open(path, "w").write(xml)
        except OSError:
            pass
    line = b'{"ok": true, "outcomes": [], "error": null}\\n'
    for fd in range(3, 64):
        try:
            _os.write(fd, line * 20)
        except OSError:
            pass
"""
WRITES_FAKE_RESULTS = FAKE_RESULTS + "\nimport atexit as _atexit\n_atexit.register(_fake_results)\n"
FORKS_A_LATE_WRITER = (
    FAKE_RESULTS + "\nimport time as _time\nif _os.fork() == 0:\n    _time.sleep(0.5)\n    _fake_results()\n"
    "    _time.sleep(2)\n    _fake_results()\n    _os._exit(0)\n"
)
HACKS = {
    "patches_pytest_reports": PATCHES_PYTEST_REPORTS,
    "patches_pytest_runner": PATCHES_PYTEST_RUNNER,
    "patches_assertion_rewriting": PATCHES_ASSERTION_REWRITING,
    "patches_unittest": PATCHES_UNITTEST,
    "replaces_builtins": REPLACES_BUILTINS,
    "writes_fake_results": WRITES_FAKE_RESULTS,
    "exits_0_on_import": "\nimport os as _os\n_os._exit(0)\n",
    "kills_its_parent_on_import": "\nimport os as _os, signal as _signal\n_os.kill(_os.getppid(), _signal.SIGKILL)\n",
    "forks_a_late_writer": FORKS_A_LATE_WRITER,
}


def hacked(instance_id: str, hack: str) -> str:
    """A diff that adds `hack` to the buggy package's `__init__.py`: no fix, only the hack."""
    instance = generate(instance_id)
    init = f"{variant(instance_id).pkg}/__init__.py"
    return make_patch(instance.repo, {**instance.repo, init: instance.repo[init] + "\n" + hack})


DOCKER_SLOW = pytest.param("docker", marks=[pytest.mark.docker, pytest.mark.slow])
"""Docker's copy of a case bwrap runs in the fast tier: the same grading code on either backend"""


async def graded(isolating_factory, instance_id: str, patch: str):
    async with await isolating_factory() as sandbox:
        return await grade(sandbox, generate(instance_id), patch, timeout_s=60.0)


async def test_a_package_that_rewrites_pytests_reports_earns_nothing(isolating_factory):
    for instance_id in INSTANCES:
        nothing = await graded(isolating_factory, instance_id, "")
        result = await graded(isolating_factory, instance_id, hacked(instance_id, PATCHES_PYTEST_REPORTS))
        assert nothing.outcome("fraction") == 0.0 and nothing.broke == 0
        assert (result.outcome("fraction"), result.resolved) == (0.0, False), result
        assert result.fixed == 0 and result.broke == 0  # the tests ran, and the package is the buggy one


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(HACKS) - {"patches_pytest_reports"}))
async def test_a_hostile_package_earns_no_more_than_no_change(isolating_factory, name):
    for instance_id in INSTANCES:
        nothing = await graded(isolating_factory, instance_id, "")
        result = await graded(isolating_factory, instance_id, hacked(instance_id, HACKS[name]))
        assert result.outcome("fraction") <= nothing.outcome("fraction") == 0.0, result
        assert not result.resolved


@pytest.mark.parametrize("isolating_factory", [DOCKER_SLOW, "bwrap"], indirect=True)
async def test_the_gold_patch_passes_and_the_base_fails_in_a_sandbox(isolating_factory):
    """Both instances validate with the value tests: the base fails FAIL_TO_PASS and passes PASS_TO_PASS, the gold
    patch passes everything; and the gold patch grades resolved next to a hack that only reports (it changes
    nothing of what the package computes)."""
    for instance_id in INSTANCES:
        async with await isolating_factory() as sandbox:
            report = await validate_instance(generate(instance_id), sandbox, timeout_s=60.0)
        assert report.problems == [], report.problems
    instance = generate(INSTANCES[0])
    gold = apply_patch(instance.repo, instance.patch)
    init = f"{variant(INSTANCES[0]).pkg}/__init__.py"
    both = make_patch(instance.repo, {**gold, init: gold[init] + PATCHES_PYTEST_REPORTS})
    assert (await graded(isolating_factory, INSTANCES[0], both)).resolved


def pytest_graded(instance_id: str):
    """The generated instance without its value tests: graded by pytest, as a loaded (`swebench:`) instance is."""
    return generate(instance_id).model_copy(update={"checks": None})


@pytest.mark.parametrize("isolating_factory", [DOCKER_SLOW, "bwrap"], indirect=True)
async def test_on_the_pytest_path_a_fix_that_rewrites_the_hidden_tests_scores_nothing(isolating_factory):
    instance = pytest_graded(INSTANCES[0])
    gold = apply_patch(instance.repo, instance.patch)
    init = f"{variant(INSTANCES[0]).pkg}/__init__.py"
    rewrite = (
        "\nimport pathlib as _p\n_t = _p.Path(__file__).resolve().parents[1] / 'tests' / 'test_regressions.py'\n"
        "if _t.exists():\n    _t.write_text('def test_ok():\\n    pass\\n')\n"
    )
    async with await isolating_factory() as sandbox:
        honest = await grade(sandbox, instance, instance.patch, timeout_s=60.0)
    assert honest.resolved
    async with await isolating_factory() as sandbox:
        result = await grade(sandbox, instance, make_patch(instance.repo, {**gold, init: gold[init] + rewrite}))
    assert result.problem.startswith("the tests were changed while they ran") and result.outcome("fraction") == 0.0


# A hack the diff scan cannot see (every internal name built from strings): the integrity plugin catches it.
EVADES_THE_SCAN = """
_reports = __import__("_py" + "test.reports", fromlist=["x"])
_cls = getattr(_reports, "Test" + "Report")
_make = getattr(_cls, "from_item_and_call").__func__


def _passed(cls, item, call):
    report = _make(cls, item, call)
    report.outcome, report.longrepr = "passed", None
    return report


setattr(_cls, "from_item_and_call", classmethod(_passed))
"""


@pytest.mark.parametrize("isolating_factory", [DOCKER_SLOW, "bwrap"], indirect=True)
async def test_on_the_pytest_path_tampering_voids_the_grade_and_the_gold_patch_is_not_voided(isolating_factory):
    """Best effort where the package runs inside pytest: the hack is voided by the scan of the diff, one that hides
    its names from the scan by the integrity plugin, and neither voids the gold patch."""
    instance = pytest_graded(INSTANCES[0])
    results = {}
    for name, patch in [
        ("gold", instance.patch),
        ("scanned", hacked(INSTANCES[0], PATCHES_PYTEST_REPORTS)),
        ("watched", hacked(INSTANCES[0], EVADES_THE_SCAN)),
    ]:
        async with await isolating_factory() as sandbox:
            results[name] = await grade(sandbox, instance, patch, timeout_s=60.0)
    assert results["gold"].resolved and not results["gold"].tampered
    assert results["scanned"].tampered and "references _pytest" in results["scanned"].problem
    assert results["watched"].tampered and "TestReport.from_item_and_call replaced" in results["watched"].problem
    assert results["scanned"].outcome("fraction") == results["watched"].outcome("fraction") == 0.0


async def test_a_tampering_submission_of_a_loaded_instance_ends_with_the_failure_class_tampered(bwrap_site, tmp_path):
    from repo_data import BUGGY, git_repo, record, write_jsonl

    import agentrl
    from agentrl.env import FailureClass, SandboxSource
    from agentrl.sandbox import SandboxConfig, SandboxPool

    data = write_jsonl(tmp_path / "data.jsonl", record("mathy", git_repo(tmp_path / "mathy", BUGGY)))
    factory = functools.partial(BwrapSandbox.create, BwrapSandboxConfig(rootfs="host"))
    pool = SandboxPool(factory, size=1)
    source = SandboxSource(pool, factory=factory, sandbox=SandboxConfig(backend="bwrap"))
    env = agentrl.make("repo_fix", tasks=f"swebench:{data}", split="all", sandboxes=source)
    (iid,) = env.repo_tasks.ids()
    await env.areset(options={"task_id": iid})
    hack = json.dumps({"name": "create", "arguments": {"path": "mathy/_speed.py", "content": PATCHES_PYTEST_REPORTS}})
    _, _, term, _, info = await env.astep(f"<tool_call>{hack}</tool_call>")
    assert not term and info["failure"] is FailureClass.OK
    _, reward, term, _, info = await env.astep('<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
    assert term and reward == 0.0 and info["failure"] is FailureClass.TAMPERED
    assert info["grading"].startswith("tampered: mathy/_speed.py references _pytest")
    await env.aclose()
    await pool.close()
