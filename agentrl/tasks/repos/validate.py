"""Check that an instance grades what it claims: the base fails every FAIL_TO_PASS test and passes every
PASS_TO_PASS one; the base with the gold patch passes them all (both with the hidden tests added).

A *runner* runs pytest node ids against a file tree and says how each ended. `LocalRunner` does it in a
temporary folder on this machine (for tests and the CLI); the env runs the same in a sandbox.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

from agentrl.tasks.repos.instance import RepoInstance, apply_patch

TestOutcome = Literal["passed", "failed", "error", "skipped", "missing"]
"""missing: pytest did not report the node (a collection error, a file gone, a timeout)"""


class Runner(Protocol):
    def __call__(self, files: Mapping[str, str], node_ids: Sequence[str]) -> dict[str, TestOutcome]:
        """Run `node_ids` against the tree `files`; an outcome for each of them."""
        ...


@dataclass(frozen=True)
class LocalRunner:
    """Runs pytest in a fresh temporary folder with this interpreter.

    Plugins are not autoloaded (the repository's tests need pytest alone, and a plugin of this venv must
    not change their outcome) and no config file outside the folder is read (`-c` names an empty one).
    Whole files run and the wanted nodes are picked from the report, so a missing test is `missing`
    instead of failing the whole run.
    """

    timeout_s: float = 60.0
    """wall-clock limit of one pytest run; past it, every node is `missing`"""

    def __call__(self, files: Mapping[str, str], node_ids: Sequence[str]) -> dict[str, TestOutcome]:
        outcomes: dict[str, TestOutcome] = dict.fromkeys(node_ids, "missing")
        test_files = sorted({n.split("::")[0] for n in node_ids} & set(files))
        if not test_files:
            return outcomes
        with tempfile.TemporaryDirectory(prefix="agentrl-repo-") as tmp:
            root = Path(tmp) / "repo"
            for path, text in files.items():
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                (root / path).write_text(text)
            report, ini = Path(tmp) / "report.xml", Path(tmp) / "pytest.ini"
            ini.write_text("[pytest]\n")
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ini)]
            cmd += ["--continue-on-collection-errors"]  # a test file that fails to import fails its tests only
            cmd += ["--rootdir", str(root), f"--junitxml={report}", *test_files]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHON"))}
            env |= {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
            try:
                subprocess.run(cmd, cwd=root, env=env, capture_output=True, timeout=self.timeout_s, check=False)
            except subprocess.TimeoutExpired:
                return outcomes
            if report.exists():
                for node, outcome in parse_junit(report.read_text(), files).items():
                    if node in outcomes:
                        outcomes[node] = outcome
        return outcomes


_TAGS: tuple[tuple[str, TestOutcome], ...] = (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))


def parse_junit(xml: str, files: Mapping[str, str]) -> dict[str, TestOutcome]:
    """Outcomes by node id from a pytest JUnit XML report. A testcase's `classname` is the test file's dotted
    path and then any classes (`tests.test_x.TestY`); `files` tells where the path ends."""
    outcomes: dict[str, TestOutcome] = {}
    for case in ET.fromstring(xml).iter("testcase"):
        parts = case.get("classname", "").split(".")
        for k in range(len(parts), 0, -1):
            path = "/".join(parts[:k]) + ".py"
            if path in files:
                node = "::".join([path, *parts[k:], case.get("name", "")])
                break
        else:
            continue  # a collection error reports a file, not a test
        tags = {child.tag for child in case}
        outcomes[node] = next((o for tag, o in _TAGS if tag in tags), "passed")
    return outcomes


class ValidationReport(BaseModel):
    """How an instance's tests ended on the base and with the gold patch (both with `test_patch` applied)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instance_id: str
    base: dict[str, TestOutcome]
    gold: dict[str, TestOutcome]
    problems: list[str]
    """one line per test that ended otherwise than the instance says; empty when valid"""

    @property
    def ok(self) -> bool:
        return not self.problems


def validation_trees(instance: RepoInstance) -> tuple[dict[str, str], dict[str, str]]:
    """The two trees validation runs the tests on: the base and the base with the gold patch, both with the hidden
    tests added. PatchError (a ValueError) when a patch does not apply."""
    base = apply_patch(instance.repo, instance.test_patch)
    gold = apply_patch(apply_patch(instance.repo, instance.patch), instance.test_patch)
    return base, gold


def judge(
    instance: RepoInstance, on_base: Mapping[str, TestOutcome], on_gold: Mapping[str, TestOutcome]
) -> ValidationReport:
    """The report on how the tests ended on the two trees."""
    nodes = [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]
    problems = [f"FAIL_TO_PASS {n} {on_base[n]} on the base" for n in instance.FAIL_TO_PASS if on_base[n] == "passed"]
    problems += [f"PASS_TO_PASS {n} {on_base[n]} on the base" for n in instance.PASS_TO_PASS if on_base[n] != "passed"]
    problems += [f"{n} {on_gold[n]} with the gold patch" for n in nodes if on_gold[n] != "passed"]
    return ValidationReport(instance_id=instance.instance_id, base=dict(on_base), gold=dict(on_gold), problems=problems)


def patch_problem(instance: RepoInstance, error: ValueError) -> ValidationReport:
    return ValidationReport(instance_id=instance.instance_id, base={}, gold={}, problems=[f"patch: {error}"])


def validate(instance: RepoInstance, runner: Runner) -> ValidationReport:
    """Run FAIL_TO_PASS and PASS_TO_PASS on the base and on the base with the gold patch; a patch that does not
    apply is a problem too (reported, not raised)."""
    try:
        base, gold = validation_trees(instance)
    except ValueError as e:
        return patch_problem(instance, e)
    nodes = [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]
    return judge(instance, runner(base, nodes), runner(gold, nodes))
