"""Value tests from pytest tests (`agentrl.tasks.repos.checks`): each shape of assert becomes the checks it stands
for, with the original package's outcomes; the verdict follows the package's behaviour, and what a worker reports
is judged strictly."""

from __future__ import annotations

import pytest

from agentrl.tasks.repos import TEMPLATES, apply_patch, generate, instance_id
from agentrl.tasks.repos.checks import grader, judge, value_tests

PACKAGE = {
    "pkg/__init__.py": ("from .core import Box, inc, pair, parse\n"),
    "pkg/core.py": (
        "def inc(x):\n    return x + 1\n\n\n"
        "def pair(x):\n    return (x, x)\n\n\n"
        "def parse(text):\n    if not text.isdigit():\n        raise ValueError(text)\n    return int(text)\n\n\n"
        "class Box:\n    def __init__(self):\n        self.items = []\n\n"
        "    def put(self, x):\n        self.items.append(x)\n        return len(self.items)\n"
    ),
}
TESTS = {
    "tests/test_pkg.py": """import pytest
from pkg import Box, inc, pair, parse

LIMIT = 3


def helper():
    return Box()


def test_eq():
    assert inc(1) == 2


def test_literal_first():
    assert 3 == inc(2)


def test_is():
    assert (inc(0) == 1) is True


def test_truth_and_not():
    assert inc(1) and not inc(-1)


def test_all():
    assert all(inc(n) == n + 1 for n in range(LIMIT))


def test_loop_and_setup():
    box = helper()
    for n in range(LIMIT):
        assert box.put(n) == n + 1
    assert box.items == [0, 1, 2]


def test_raises():
    with pytest.raises(ValueError):
        parse("x")


def test_try_except():
    try:
        parse("y")
    except ValueError:
        return
    raise AssertionError("no ValueError")


def test_tuple():
    assert pair(1) == (1, 1)
""",
}


def value_tests_of(names: list[str]) -> dict:
    return value_tests({**PACKAGE, **TESTS}, [f"tests/test_pkg.py::{n}" for n in names], PACKAGE, "pkg")


def broken(**changes: str) -> dict:
    core = PACKAGE["pkg/core.py"]
    for old, new in changes.items():
        assert old in core
        core = core.replace(old, new)
    return {**PACKAGE, "pkg/core.py": core}


def test_each_assert_shape_becomes_its_checks_with_the_originals_outcomes():
    tests = value_tests_of(["test_eq", "test_literal_first", "test_is", "test_truth_and_not", "test_all"])
    checks = {node.split("::")[1]: [c.model_dump(exclude_defaults=True) for c in t.checks] for node, t in tests.items()}
    assert checks == {
        "test_eq": [{"value": 2}],
        "test_literal_first": [{"value": 3}],
        "test_is": [{"compare": "is", "value": True}],
        "test_truth_and_not": [{"compare": "truth", "value": True}, {"compare": "truth", "value": False}],
        "test_all": [{"value": [1, 2, 3]}],
    }
    code = tests["tests/test_pkg.py::test_all"].code
    assert "import pytest" not in code and "def test():" in code and "__agentrl_check__" in code


def test_loops_raises_and_tuples():
    tests = value_tests_of(["test_loop_and_setup", "test_raises", "test_try_except", "test_tuple"])
    checks = {node.split("::")[1]: [c.model_dump(exclude_defaults=True) for c in t.checks] for node, t in tests.items()}
    assert checks == {
        "test_loop_and_setup": [{"value": 1}, {"value": 2}, {"value": 3}, {"value": [0, 1, 2]}],
        "test_raises": [{"raised": "ValueError"}],
        "test_try_except": [{"raised": "ValueError"}],
        "test_tuple": [{"value": {"$t": [1, 1]}}],  # the grader's tagged encoding: a tuple is not a list
    }


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("test_eq", {"return x + 1": "return x + 2"}),
        ("test_all", {"return x + 1": "return x + 1 if x < 2 else 0"}),
        ("test_loop_and_setup", {"return len(self.items)": "return len(self.items) - 1"}),
        ("test_raises", {"raise ValueError(text)": "raise KeyError(text)"}),
        ("test_try_except", {"raise ValueError(text)": "return 0"}),
        ("test_tuple", {"return (x, x)": "return [x, x]"}),
        ("test_truth_and_not", {"return x + 1": "return 1"}),
    ],
)
def test_a_test_passes_on_the_original_and_fails_where_the_behaviour_changed(name, change):
    (test,) = value_tests_of([name]).values()
    assert judge(test, PACKAGE, "pkg")
    assert not judge(test, broken(**change), "pkg")


def test_a_subclass_of_the_expected_exception_passes_as_with_pytest_raises():
    (test,) = value_tests_of(["test_raises"]).values()
    subclass = broken(**{"raise ValueError(text)": "raise UnicodeError(text)"})  # UnicodeError < ValueError
    assert judge(test, subclass, "pkg")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("def test_x(tmp_path):\n    assert inc(1) == 2\n", "fixtures or markers"),
        ("@pytest.mark.skip\ndef test_x():\n    assert inc(1) == 2\n", "fixtures or markers"),
        ("def test_x():\n    def check():\n        assert inc(1) == 2\n    check()\n", "an assert in a function"),
        ("def test_x():\n    assert inc(None) == 2\n", "an assert raises TypeError on the original"),
        ("def test_x():\n    assert pytest.approx(inc(1)) == 2\n", "raises NameError"),  # only pytest.raises
        ("def test_x():\n    inc(None)\n", "does not pass on the original"),
        ("class TestX:\n    def test_x(self):\n        assert inc(1) == 2\n", "only top-level test functions"),
    ],
)
def test_shapes_it_cannot_check_are_refused_when_generated(body, why):
    files = {**PACKAGE, "tests/test_x.py": f"import pytest\nfrom pkg import inc\n\n\n{body}"}
    node = "tests/test_x.py::TestX::test_x" if body.startswith("class") else "tests/test_x.py::test_x"
    with pytest.raises(ValueError, match=why):
        value_tests(files, [node], PACKAGE, "pkg")


def test_the_grader_judges_a_report_strictly():
    judge_values = grader().judge_values
    checks = [{"compare": "==", "value": 2, "raised": None}, {"compare": "==", "value": None, "raised": "KeyError"}]
    good = {"outcomes": [{"value": 2}, {"raised": ["KeyError", "LookupError", "Exception"]}], "error": None}
    judge_values(checks, good)
    bad = [
        {"outcomes": good["outcomes"][:1], "error": None},  # a check never ran
        {"outcomes": [*good["outcomes"], {"value": 1}], "error": None},  # one more than the test has
        {"outcomes": good["outcomes"], "error": "RuntimeError after the checks"},
        {"outcomes": [{"value": 2.5}, good["outcomes"][1]], "error": None},
        {"outcomes": [{"value": 2}, {"raised": "KeyErrorLookupError"}], "error": None},  # names come as a list
        {"outcomes": [{"unplain": "an object"}, good["outcomes"][1]], "error": None},
    ]
    for report in bad:
        with pytest.raises(AssertionError):
            judge_values(checks, report)


def test_one_instance_of_every_template_validates_with_its_value_tests():
    """On this machine, judged as the grader judges: FAIL_TO_PASS fails and PASS_TO_PASS passes on the base, and
    everything passes with the gold patch (every bug site of every template: tests/env/test_repo_grading.py and
    the slow test_every_bug_site_validates, with pytest)."""
    for name in sorted(TEMPLATES):
        instance = generate(instance_id(name, 0))
        pkg = next(p.split("/")[0] for p in instance.repo if p.endswith("/__init__.py") and "tests" not in p)
        gold = apply_patch(instance.repo, instance.patch)
        for node, test in instance.checks.items():
            assert judge(test, instance.repo, pkg) is (node in instance.PASS_TO_PASS), node
            assert judge(test, gold, pkg), node
