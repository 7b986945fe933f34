"""Generated task sets: procedural code tasks and arithmetic questions.

Code tasks are checked end to end: the reference source (not the generator's callables) must
pass every case, wrong solutions must fail, and splits must never share content.
Arithmetic answers are recomputed here from the prompt text, independently of the generator.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from itertools import islice
from typing import Any

import numpy as np
import pytest

from agentrl.tasks import CallTests, Task, in_test_split
from agentrl.tasks._generated import GeneratedTaskSet
from agentrl.tasks.procedural import ProceduralCodeTasks
from agentrl.tasks.questions import ArithmeticQuestions

# Untraced by scripts/test.sh's coverage (pytest-cov's no_cover): these tests generate thousands of tasks in pure
# Python, which line tracing slows 2.6x (test_procedural.py and test_repo_tasksets.py together, fast tier, one
# process: 107 s traced, 41 s untraced, 40 s without coverage); the modules they run are imported and run by other
# tests too, so the every-module check is unchanged.
pytestmark = pytest.mark.no_cover

CODE = ProceduralCodeTasks()
QUESTIONS = ArithmeticQuestions()
PER_CELL = 20
"""tasks per (family, level): 5 x 3 x 20 = 300 code tasks"""


@pytest.fixture(scope="module")
def code_tasks() -> list[Task]:
    return [CODE.generate(f, level, n) for f in CODE.FAMILIES for level in CODE.LEVELS for n in range(PER_CELL)]


def _load(source: str, entry_point: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    return namespace[entry_point]


def _passed(fn: Callable[..., Any], tests: CallTests) -> list[bool]:
    """Per case, whether fn returns the expected value (on a JSON copy of the arguments, as a grader would)."""
    out = []
    for case in tests.cases:
        try:
            out.append(fn(*json.loads(json.dumps(case.args))) == case.expected)
        except Exception:
            out.append(False)
    return out


def _round_trips(value: Any) -> bool:
    """JSON gives back an equal value (a tuple would come back as an unequal list)."""
    return json.loads(json.dumps(value)) == value


def _small(arg: Any) -> bool:
    """Inputs stay small, so prompts stay short."""
    if isinstance(arg, str):
        return len(arg) < 60
    if isinstance(arg, list):
        return len(arg) < 20
    return abs(arg) < 1000


# ---- determinism and ids ----


def test_same_id_same_task_in_a_fresh_set_and_process():
    ids = [f"procedural/{f}/{level}/{n}" for f in CODE.FAMILIES for level in CODE.LEVELS for n in (0, 7, 2**31 - 1)]
    ids += [f"arithmetic/{f}/{level}/5" for f in QUESTIONS.FAMILIES for level in QUESTIONS.LEVELS]
    here = {i: (CODE if i.startswith("procedural") else QUESTIONS).get(i) for i in ids}
    for i, task in here.items():
        fresh = ProceduralCodeTasks() if i.startswith("procedural") else ArithmeticQuestions()
        assert fresh.get(i) == task and task.id == i
    # Another process with another string-hash salt regenerates the same content.
    script = (
        "import sys, json\n"
        "from agentrl.tasks.procedural import ProceduralCodeTasks\n"
        "from agentrl.tasks.questions import ArithmeticQuestions\n"
        "sets = {'procedural': ProceduralCodeTasks(), 'arithmetic': ArithmeticQuestions()}\n"
        "ids = json.loads(sys.stdin.read())\n"
        "print(json.dumps({i: sets[i.split('/')[0]].get(i).content_hash() for i in ids}))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(ids),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert json.loads(run.stdout) == {i: t.content_hash() for i, t in here.items()}


PINNED = {
    "strings": "8df2922a08499095",
    "lists": "2907e8a8e1dd0c16",
    "numbers": "21352496ba0fae4e",
    "counting": "bfe2f87d290669f6",
    "sequences": "87b1ee80f7b5f2ec",
}
"""per family, the start of a SHA-256 of tasks 0-29 of each level: each task's JSON, its reference solution
and a sloppy one (misread 0.5, rng seeded with n). Change it only on purpose: saved ids then name other tasks."""


def test_task_content_is_pinned():
    """A refactor of the generators keeps every id's task and solutions byte for byte."""
    got = {}
    for family in CODE.FAMILIES:
        h = hashlib.sha256()
        for level in CODE.LEVELS:
            for n in range(30):
                t = CODE.generate(family, level, n)
                h.update(t.model_dump_json().encode())
                h.update(CODE.reference_solution(t).encode())
                h.update(CODE.sloppy_solution(t, random.Random(n), 0.5).encode())
        got[family] = h.hexdigest()[:16]
    assert got == PINNED


def test_sample_is_a_function_of_the_rng():
    for make in (ProceduralCodeTasks, ArithmeticQuestions):
        a = [make().sample(np.random.default_rng(s)) for s in range(10)]
        b = [make().sample(np.random.default_rng(s)) for s in range(10)]
        assert a == b
        assert len({t.id for t in a}) == 10


def test_iter_goes_round_robin_then_to_the_next_n():
    ids = [t.id for t in islice(iter(CODE), 2 * 15)]
    cells = [(f, level) for f in CODE.FAMILIES for level in CODE.LEVELS]
    assert ids == [f"procedural/{f}/{level}/{n}" for n in (0, 1) for f, level in cells]


def test_restricted_families_and_levels():
    ts = ProceduralCodeTasks(families=["lists"], levels=[3])
    rng = np.random.default_rng(0)
    assert {t.id.rsplit("/", 1)[0] for t in (ts.sample(rng) for _ in range(20))} == {"procedural/lists/3"}
    with pytest.raises(KeyError):
        ts.get("procedural/strings/3/0")


@pytest.mark.parametrize(
    "task_id",
    [
        "procedural/strings/1",
        "procedural/strings/1/01",
        "procedural/strings/1/-1",
        "procedural/strings/4/0",
        "procedural/nope/1/0",
        "arithmetic/product/1/0",
        "procedural/strings/1/0/",
        "procedural/strings/01/0",  # one task, one id: no leading zero in the level either
        "procedural/strings/1/1\u0663",  # ASCII digits only (ARABIC-INDIC THREE would read as 13)
    ],
)
def test_get_rejects_ids_that_are_not_its_own(task_id: str):
    with pytest.raises(KeyError):
        CODE.get(task_id)


def test_invalid_arguments_name_the_choices():
    with pytest.raises(ValueError, match="strings"):
        ProceduralCodeTasks(families=["string"])
    with pytest.raises(ValueError, match=r"\[1, 2, 3\]"):
        ArithmeticQuestions(levels=[0])
    with pytest.raises(ValueError, match="choose among"):
        ProceduralCodeTasks(families=[])
    with pytest.raises(ValueError, match="n_hidden"):
        ProceduralCodeTasks(n_hidden=0)
    with pytest.raises(ValueError, match="n_hidden"):
        ProceduralCodeTasks(n_hidden=15, n_public=6)
    with pytest.raises(ValueError, match="split"):
        CODE.split("validation")  # type: ignore[arg-type]
    # sides at one seed that keep no task are refused, rather than sampled forever
    with pytest.raises(ValueError, match="holds no task"):
        CODE.split("test", seed=1).split("train", seed=1)
    assert next(iter(CODE.split("test", seed=1).split("train", seed=2))).id  # another seed: a side of its own


# ---- code tasks: shape, correctness, strictness ----


def test_tasks_are_well_formed(code_tasks: list[Task]):
    for t in code_tasks:
        assert t.tests is not None and t.public_tests is not None and t.answer is None
        entry = t.tests.entry_point
        assert t.metadata == {"family": t.id.split("/")[1], "level": int(t.id.split("/")[2]), "source": "procedural"}
        (fn,) = ast.parse(t.starter_code).body
        assert isinstance(fn, ast.FunctionDef) and fn.name == entry and ast.get_docstring(fn)
        assert t.starter_code in t.prompt
        for case in t.public_tests.cases:
            assert f"{entry}({', '.join(map(repr, case.args))}) == {case.expected!r}" in t.prompt
        assert (len(t.tests.cases), len(t.public_tests.cases)) == (10, 2)
        hidden = [json.dumps(c.args) for c in t.tests.cases]
        public = [json.dumps(c.args) for c in t.public_tests.cases]
        assert len(set(hidden)) == len(hidden) and len(set(public)) == len(public)
        assert not set(hidden) & set(public)
        for case in t.tests.cases + t.public_tests.cases:
            assert _round_trips(case.args) and _round_trips(case.expected)
            assert all(map(_small, case.args)), case.args


def test_reference_solution_passes_every_case(code_tasks: list[Task]):
    for t in code_tasks:
        source = CODE.reference_solution(t)
        ast.parse(source)
        fn = _load(source, t.tests.entry_point)
        assert all(_passed(fn, t.tests)) and all(_passed(fn, t.public_tests)), (t.id, source)


def _results(f: Callable[..., Any], inputs: list[list[Any]]) -> list[Any]:
    """f on each input; an exception's name where it raises (a misreading may raise where the statement does not)."""
    out = []
    for a in inputs:
        try:
            out.append(f(*a))
        except Exception as e:
            out.append(type(e).__name__)
    return out


def test_misreadings_are_code_for_the_near_misses_and_the_hidden_tests_catch_them(code_tasks: list[Task]):
    """Each misreading's source computes exactly its near-miss callable, and a sloppy solution (everything
    misread) fails the hidden tests wherever the misreading changes some hidden case."""
    from agentrl.tasks.procedural import _program

    checked = caught = 0
    for t in code_tasks:
        program = _program(t)
        if t.metadata["family"] == "sequences":
            assert not program.misread_bodies  # a recurrence has no step to misread
            continue
        inputs = [c.args for c in t.tests.cases + t.public_tests.cases]
        for source, near_miss in zip(program.misread_sources(), program.near_misses, strict=True):
            fn = _load(source, t.tests.entry_point)
            assert _results(fn, inputs) == _results(near_miss, inputs), (t.id, source)
            differs = _results(near_miss, inputs)[: len(t.tests.cases)] != [c.expected for c in t.tests.cases]
            caught += differs and not all(_passed(fn, t.tests))
            checked += differs
        assert CODE.sloppy_solution(t, random.Random(0), 0.0) == CODE.reference_solution(t)
    assert checked > 50 and caught == checked


def test_a_solution_is_read_as_the_reference_a_misreading_or_neither(code_tasks: list[Task]):
    """`reading` (what benchmarks/failure_modes.py counts): the reference however it is spaced, any mix of
    misread steps, either with its result printed, and anything else, such as another task's solution, as "other"."""
    from agentrl.tasks.procedural import _program, reading
    from agentrl.tasks.solutions import printing

    misreadable = [
        t
        for t in code_tasks
        if _program(t).misread_bodies and any(len(lines) > 1 for lines in _program(t).misread_bodies)
    ]
    assert len(misreadable) > 20
    for i, t in enumerate(misreadable):
        ref, sloppy = CODE.reference_solution(t), CODE.sloppy_solution(t, random.Random(i), 1.0)
        assert reading(t, ref) == "reference"
        assert reading(t, ref.replace("    ", "\t") + "\n\n") == "reference"
        assert reading(t, sloppy) == "misread"
        other = CODE.reference_solution(misreadable[i - 1])
        assert reading(t, other) == ("reference" if other == ref else "other")
        assert reading(t, ref.replace("return", "return 1 +", 1)) == "other"
        assert reading(t, printing(ref)) == reading(t, printing(sloppy)) == "printed"


def test_another_tasks_solution_fails(code_tasks: list[Task]):
    """The reference for task n + 1000 of the same family and level fails task n."""
    fails = []
    for t in code_tasks:
        other = CODE.generate(t.metadata["family"], t.metadata["level"], int(t.id.rsplit("/", 1)[1]) + 1000)
        fails.append(not all(_passed(_load(CODE.reference_solution(other), t.tests.entry_point), t.tests)))
    assert sum(fails) / len(fails) >= 0.95


def test_leaving_out_any_step_fails(code_tasks: list[Task]):
    """Every step a statement lists matters on the hidden cases: dropping one line of the reference fails."""
    dropped = 0
    for t in code_tasks:
        if t.metadata["family"] == "sequences":  # a loop, not a list of steps
            continue
        lines = CODE.reference_solution(t).splitlines()
        for i in [i for i, line in enumerate(lines) if re.match(r"    \w+ = ", line)]:
            fn = _load("\n".join(lines[:i] + lines[i + 1 :]), t.tests.entry_point)
            assert not all(_passed(fn, t.tests)), (t.id, i)
            dropped += 1
    assert dropped >= 150


def test_no_constant_passes_more_than_half(code_tasks: list[Task]):
    for t in code_tasks:
        commonest = Counter(json.dumps(c.expected) for c in t.tests.cases).most_common(1)[0][1]
        assert commonest <= len(t.tests.cases) / 2, t.id


def test_case_counts_follow_the_arguments():
    t = ProceduralCodeTasks(n_hidden=5, n_public=0).generate("counting", 2, 3)
    assert len(t.tests.cases) == 5 and t.public_tests is None and "Examples" not in t.prompt
    t = ProceduralCodeTasks(n_hidden=12, n_public=8).generate("sequences", 3, 3)
    assert len(t.tests.cases) == 12 and len(t.public_tests.cases) == 8
    # The function does not depend on the case counts: one reference solves both.
    assert CODE.reference_solution(t) == CODE.reference_solution(CODE.generate("sequences", 3, 3))


def test_sampled_tasks_are_distinct():
    rng = np.random.default_rng(1)
    tasks = [CODE.sample(rng) for _ in range(1000)]
    assert len({t.content_hash() for t in tasks}) >= 995
    # Statements (not just test inputs) differ too; level 1 has only dozens per family.
    assert len({t.starter_code for t in tasks}) >= 800


# ---- splits ----


@pytest.mark.parametrize("make, draws", [(ProceduralCodeTasks, 200), (ArithmeticQuestions, 2000)])
def test_split_sides_never_share_content(make: type[GeneratedTaskSet], draws: int):
    whole = make()
    train, test = whole.split("train", seed=3), whole.split("test", seed=3)
    rng = np.random.default_rng(0)
    train_tasks = [train.sample(rng) for _ in range(draws)]
    test_tasks = [test.sample(rng) for _ in range(draws)]
    assert not {t.content_hash() for t in train_tasks} & {t.content_hash() for t in test_tasks}
    # Sides are decided by the split key (procedural: the statement, so no problem is on both sides).
    train_keys = {whole.split_key(t) for t in train_tasks}
    test_keys = {whole.split_key(t) for t in test_tasks}
    assert not train_keys & test_keys
    assert not any(in_test_split(k, 3, 0.2) for k in train_keys)
    assert all(in_test_split(k, 3, 0.2) for k in test_keys)
    assert all(not in_test_split(whole.split_key(t), 3, 0.2) for t in islice(iter(train), 50))
    with pytest.raises(KeyError):
        train.get(test_tasks[0].id)
    assert test.get(test_tasks[0].id) == test_tasks[0]
    assert train.name == f"{make.name}[train]" and train_tasks[0].id.startswith(f"{make.name}/")
    # A split of a split stays inside it.
    inner = train.split("test", seed=4)
    assert not any(in_test_split(whole.split_key(inner.sample(rng)), 3, 0.2) for _ in range(20))
    # The unsplit set puts about test_fraction of its tasks on the test side.
    fraction = sum(in_test_split(whole.split_key(whole.sample(rng)), 3, 0.2) for _ in range(draws)) / draws
    assert abs(fraction - 0.2) < 4 * (0.2 * 0.8 / draws) ** 0.5


# ---- arithmetic questions ----


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def _recompute(family: str, prompt: str) -> str:
    """The answer, from the question text alone."""
    question = prompt.split("\n")
    match family:
        case "product":
            a, b = _ints(question[0])
            return str(a * b)
        case "sum":
            count = _ints(question[0])[0]
            numbers = _ints(question[1])
            assert len(numbers) == count
            return str(sum(numbers))
        case "powmod":
            a, b, m = _ints(question[0].split(":")[0])
            return str(pow(a, b, m))
        case "count":
            pattern = re.match(r'How many times does "(\w+)"', prompt)[1]
            text = question[2]
            return str(len(re.findall(f"(?={pattern})", text)))
        case "strings":
            text = question[2]
            k = _ints(question[0])[0]
            gone = re.search(r'delete every "(\w)"', question[0])
            text = text.replace(gone[1], "") if gone else text
            return "".join(c.upper() if i % k == k - 1 else c for i, c in enumerate(reversed(text)))
        case "fractions":
            expr = re.match(r"Compute (.*) exactly\.", question[0])[1]
            value = eval(re.sub(r"\((\d+)/(\d+)\)", r"Fraction(\1, \2)", expr), {"Fraction": Fraction})
            return f"{value.numerator}/{value.denominator}"
        case "digitsum":
            return str(sum(int(d) for d in str(2 ** _ints(question[0])[1])))
    raise AssertionError(family)


ANSWER_FORMAT = {"fractions": r"-?[1-9]\d*/[1-9]\d*|0/1", "strings": r"[a-zA-Z]+"}
CALCULATOR_OK = {"product", "sum", "fractions"}


@pytest.mark.parametrize("family", ArithmeticQuestions.FAMILIES)
def test_arithmetic_answers_recomputed_from_the_prompt(family: str):
    for level in QUESTIONS.LEVELS:
        for n in range(10):
            t = QUESTIONS.generate(family, level, n)
            assert t.tests is None and t.answer == t.answer.strip()
            assert re.fullmatch(ANSWER_FORMAT.get(family, r"-?\d+"), t.answer), t.answer
            assert t.answer == _recompute(family, t.prompt), t.id
            assert t.metadata == {
                "family": family,
                "level": level,
                "source": "arithmetic",
                "calculator_ok": family in CALCULATOR_OK,
            }
            assert "Answer with" in t.prompt


def test_arithmetic_levels_scale():
    """Higher levels ask about larger numbers or longer strings."""
    for family in QUESTIONS.FAMILIES:
        sizes = [sum(len(QUESTIONS.generate(family, level, n).prompt) for n in range(20)) for level in (1, 2, 3)]
        assert sizes[0] < sizes[1] < sizes[2], family


def test_spec_options_restrict_levels_and_families():
    from agentrl.tasks.registry import load_tasks

    tasks = load_tasks("procedural:levels=1,2;families=lists,numbers").split("test")
    drawn = [tasks.sample(np.random.default_rng(i)) for i in range(20)]
    assert {(t.metadata["family"], t.metadata["level"]) for t in drawn} <= {
        (f, lv) for f in ("lists", "numbers") for lv in (1, 2)
    }
    bad_specs = {
        "procedural:level=1": "not one of levels=..., families=...",
        "procedural:levels=one": "takes ints",
        "procedural:levels=4": "choose among",
    }
    for bad, match in bad_specs.items():
        with pytest.raises(ValueError, match=match):
            load_tasks(bad)
