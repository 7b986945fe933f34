"""Grade a solution against hidden tests it can neither see nor alter. Standard library only.

The host runs this file with `Sandbox.run_python` and sends one JSON request on stdin:
{"solution": str, "tests": <a CallTests / AssertTests / CheckTests / ValueTests dump>, "test_timeout_s": float}.
It prints one JSON report on stdout: {"load_error": str | null, "tests": [{"passed": bool,
"error": str | null, "where": "solution" | "test" | "timeout" | "crash" | null}], "output": str}.

Two processes, so that no trick of the solution can turn a failing test into a pass:

- this *grader* holds the tests (read from stdin, never written to a file), runs them,
  and judges. It makes itself non-dumpable first, so a process of the same user can
  neither read its memory nor its file descriptors (no ptrace, no /proc/PID/mem or fd).
- a *worker* (this file with `--worker`, a fresh exec so it inherits no memory) loads the
  solution and answers calls. Only plain data crosses the pipe between them, encoded as
  tagged JSON, so the solution cannot return an object whose `__eq__` always says yes.

So a solution that prints "PASS", calls exit() or os._exit(), raises, monkeypatches
`assert` helpers or the builtins, deletes files, or kills its parent (this grader) fails
its tests: its prints go to a captured pipe, its patches live in the worker only, and a
dead grader reports nothing, which the host scores as all tests failed.

Value tests (a repository's: `ValueTests`) run the other way round: the test's own code has
to build the package's objects, so it runs in the worker (`run_checks`), and what crosses
is the plain value of each checked expression; this grader, which alone holds the values
the original package gave, judges them (`judge_values`). The package can change what the
worker reports, as it can change anything in that process, but to pass a test it must
report the expected values, which it can learn only by computing them: except a truth
check's (a bare `assert X`), always True. A package that rewrites the worker's reports
passes those; only a test's value checks hold it to computing the answer.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import sys

# The worker is a fresh interpreter per graded program and its start is most of a grade's cost:
# it imports only the above. The grader's own modules (and the rare paths' base64, traceback) load
# where used or here, in the grader, which is forked from the sandbox's warm executor.
if __name__ == "__main__" and sys.argv[1:] != ["--worker"]:
    import contextlib
    import ctypes
    import functools
    import select
    import signal
    import subprocess
    import threading
    import time
    import traceback

MAX_OUTPUT = 8192  # bytes of the solution's own output kept for feedback
PR_SET_DUMPABLE = 4


# ---------------------------------------------------------------- plain-data codec


def enc(v):
    """Python value -> JSON value. Only exact builtin types: a subclass could lie in __eq__."""
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return v if math.isfinite(v) else {"$f": repr(v)}
    if t is list:
        return [enc(x) for x in v]
    if t is tuple:
        return {"$t": [enc(x) for x in v]}
    if t is dict:
        return {"$d": [[enc(k), enc(x)] for k, x in v.items()]}
    if t in (set, frozenset):
        return {"$s" if t is set else "$fs": [enc(x) for x in v]}
    if t is bytes:
        import base64

        return {"$b": base64.b64encode(v).decode()}
    if t is complex:
        return {"$c": [enc(v.real), enc(v.imag)]}
    raise TypeError(f"a {t.__module__}.{t.__qualname__}, which is not plain data")


def dec(v):
    if isinstance(v, list):
        return [dec(x) for x in v]
    if not isinstance(v, dict):
        return v
    ((tag, x),) = v.items()
    if tag == "$f":
        return float(x)
    if tag == "$t":
        return tuple(dec(y) for y in x)
    if tag == "$d":
        return {dec(k): dec(y) for k, y in x}
    if tag in ("$s", "$fs"):
        return (set if tag == "$s" else frozenset)(dec(y) for y in x)
    if tag == "$b":
        import base64

        return base64.b64decode(x)
    if tag == "$c":
        return complex(dec(x[0]), dec(x[1]))
    raise ValueError(f"bad tag {tag!r}")


# ---------------------------------------------------------------- worker side


def worker_main() -> None:
    """Load the solution, then answer {"fn", "args"} requests until EOF.

    The protocol moves to private descriptors and fds 0/1 become /dev/null and stderr,
    so the solution's input() and print() cannot touch it.
    """
    rx = os.fdopen(os.dup(0), "rb")
    tx = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**msg) -> None:
        tx.write(json.dumps(msg).encode() + b"\n")
        tx.flush()

    ns: dict = {"__name__": "solution", "__builtins__": builtins}
    for line in rx:
        req = json.loads(line)
        try:
            if "load" in req:
                exec(compile(req["load"], "solution.py", "exec"), ns)
                reply(ok=True)
                continue
            if "run" in req:
                reply(ok=True, **run_checks(req["run"]))
                continue
            fn = resolve(ns, req["fn"])
            value = fn(*dec(req["args"]), **{k: dec(x) for k, x in req["kwargs"].items()})
        except BaseException as e:  # SystemExit included: exiting is a failure, not a verdict
            reply(ok=False, error=describe(e), type=type(e).__name__)
            continue
        try:
            reply(ok=True, value=enc(value))
        except (TypeError, ValueError) as e:
            reply(ok=False, error=f"the solution returned {e}", type="TypeError")


CHECK = "__agentrl_check__"
"""what a value test's code calls with each checked expression: CHECK(thunk, compare)"""


class _Stop(BaseException):
    """Ends a value test at its first checked expression that raised, as the failed assert or the
    `pytest.raises` block it stands for would."""


def run_checks(code: str) -> dict:
    """Run one value test: `code` defines `test()`, which calls CHECK(thunk, compare) for each checked expression.

    Each outcome is {"value": plain data} (with compare "truth": the value's truth), {"raised": the names of the
    exception's class and its bases}, or {"unplain": what the value was}, each with its "compare"; "error" says how
    the test ended outside a check (its own code raised), None when it did not. The host runs this too, on the
    original package, for the expected outcomes: one definition of what a test reports."""
    outcomes: list[dict] = []

    def check(thunk, compare: str):
        try:
            value = thunk()
        except Exception as e:  # SystemExit and the like end the test instead (an `error`)
            outcomes.append({"compare": compare, "raised": [c.__name__ for c in type(e).__mro__]})
            raise _Stop from None
        try:
            outcomes.append({"compare": compare, "value": enc(bool(value) if compare == "truth" else value)})
        except (TypeError, ValueError) as e:
            outcomes.append({"compare": compare, "unplain": str(e)})

    namespace = {"__name__": "agentrl_value_test", "__builtins__": builtins, CHECK: check}
    error = None
    try:
        exec(compile(code, "test.py", "exec"), namespace)
        namespace["test"]()
    except _Stop:
        pass
    except BaseException as e:  # SystemExit included: exiting is a failure
        error = describe(e)
    return {"outcomes": outcomes, "error": error}


def resolve(ns: dict, name: str):
    """`f` or `Class.method` (called on a fresh `Class()`, as LiveCodeBench's Solution)."""
    head, _, method = name.partition(".")
    if head not in ns:
        raise NameError(f"the solution defines no {head!r}")
    return getattr(ns[head](), method) if method else ns[head]


def describe(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"the solution called exit({e.code!r})"
    import traceback

    lines = traceback.format_exception(type(e), e, e.__traceback__)
    return "".join(lines[-6:])[-2000:]


# ---------------------------------------------------------------- grader side


class SolutionBroke(BaseException):
    """The worker died, hung or returned something that is not plain data.

    A BaseException, so that a test's `except Exception` cannot swallow it.
    """


class Worker:
    """The solution in its own process, restarted after it dies or hangs in a call.

    A solution that fails to load (raises or exits at import) is not retried: `load_error`
    then fails every remaining test at once.
    """

    def __init__(self, solution: str, timeout_s: float, first: Forked):
        self.solution = solution
        self.timeout_s = timeout_s
        self.first: Forked | None = first
        self.proc: subprocess.Popen | Forked | None = None
        self.buf = b""
        self.output = bytearray()
        self._collectors: list[threading.Thread] = []  # one per worker process started, reading its prints
        self.load_error: str | None = None

    def ready(self) -> bool:
        """A live worker with the solution loaded (starting one if needed)."""
        if self.load_error is None and (self.proc is None or self.proc.poll() is not None):
            # The fork made before the tests were read serves first; a restart (after the
            # solution died or hung) is a fresh interpreter, since this process now holds the tests.
            self.proc, self.first = self.first, None
            if self.proc is None:
                self.proc = subprocess.Popen(
                    [sys.executable, "-I", os.path.abspath(__file__), "--worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            self.buf = b""
            collector = threading.Thread(target=self._collect, args=(self.proc.stderr,), daemon=True)
            collector.start()
            self._collectors.append(collector)
            try:
                reply = self._ask({"load": self.solution}, time.monotonic() + self.timeout_s)
                if not reply["ok"]:
                    self.load_error = reply["error"]
            except SolutionBroke as e:
                self.load_error = str(e)
        return self.load_error is None

    def _collect(self, stream) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            self.output += chunk[: max(0, MAX_OUTPUT - len(self.output))]

    def call(self, fn: str, args: tuple, kwargs: dict, deadline: float):
        if self.proc.poll() is not None:
            raise SolutionBroke("the solution's process is gone")
        try:
            req = {"fn": fn, "args": enc(list(args)), "kwargs": {k: enc(v) for k, v in kwargs.items()}}
        except TypeError as e:
            raise SolutionBroke(f"the test passed {e} to the solution") from None
        reply = self._ask(req, deadline)
        if reply["ok"]:
            return dec(reply["value"])
        # Re-raise builtin exception types as themselves, so tests that expect one work.
        exc = getattr(builtins, reply["type"], None)
        if isinstance(exc, type) and issubclass(exc, Exception):
            try:
                error = exc(reply["error"])
            except Exception:  # a constructor that wants other arguments
                raise SolutionBroke(reply["error"]) from None
            raise error
        raise SolutionBroke(reply["error"])

    def run(self, code: str, deadline: float) -> dict:
        """A value test's outcomes, as the worker reports them (see run_checks)."""
        if self.proc.poll() is not None:
            raise SolutionBroke("the solution's process is gone")
        return self._ask({"run": code}, deadline)

    def _ask(self, req: dict, deadline: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            raise SolutionBroke(self._death()) from None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:  # read with a deadline: a hung or half-written reply must not block us
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self.stop()
                raise SolutionBroke("timeout")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise SolutionBroke(self._death())
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            self.stop()
            raise SolutionBroke("the solution wrote garbage on the grader's channel") from None

    def _death(self) -> str:
        self.stop()
        return f"the solution's process died (exit code {self.proc.returncode})"

    def printed(self) -> str:
        """Everything the solution printed (its first MAX_OUTPUT bytes), once its processes are stopped. What was
        still in a pipe is read to its end: otherwise a grade would report some of the prints, a different part
        each time. At most 2 s per process, for a grandchild that escaped the kill and holds a pipe open."""
        self.stop()
        for collector in self._collectors:
            collector.join(timeout=2.0)
        return bytes(self.output).decode(errors="replace")

    def stop(self) -> None:
        for proc in (self.proc, self.first):
            if proc is not None and proc.poll() is None:
                # The group for what the solution started; the pid too, for a fork not yet in its own group.
                for kill in (os.killpg, os.kill):
                    with contextlib.suppress(ProcessLookupError):
                        kill(proc.pid, signal.SIGKILL)
                proc.wait()


class Forked:
    """A worker forked from this grader before it reads its request, in place of a fresh exec.

    A new interpreter is most of a grade's cost; a fork is ~1 ms. It is as blind as an exec:
    the tests are not in this process yet, and the child replaces fds 0-2 (fd 0 is where the
    tests will arrive) before any of the solution runs. It inherits this process's
    non-dumpable flag, set before the fork. Quacks like the Popen that `Worker` restarts with.
    """

    def __init__(self) -> None:
        (in_r, in_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # never returns into the grader
            try:
                os.setsid()  # its own group, which stop() kills whole
                for fd, target in ((in_r, 0), (out_w, 1), (err_w, 2)):
                    os.dup2(fd, target)
                os.closerange(3, 1 << 16)
                sys.path = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]  # as -I
                worker_main()
            finally:
                with contextlib.suppress(BaseException):
                    sys.stderr.flush()
                os._exit(0)
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        self.stdin, self.stdout, self.stderr = os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def same(actual, expected, tol: float) -> bool:
    """Equality for JSON-shaped expectations: tuples equal lists, floats within tol."""
    if isinstance(expected, float) or (isinstance(actual, float) and type(expected) is int):
        return type(actual) in (int, float) and math.isclose(actual, expected, rel_tol=tol, abs_tol=tol)
    if isinstance(expected, (list, tuple)):
        return (
            isinstance(actual, (list, tuple))
            and len(actual) == len(expected)
            and all(same(a, e, tol) for a, e in zip(actual, expected, strict=True))
        )
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and actual.keys() == expected.keys()
            and all(same(actual[k], expected[k], tol) for k in expected)
        )
    return type(actual) is type(expected) and actual == expected


def judge_values(checks: list[dict], reply: dict) -> None:
    """AssertionError unless a value test's reported outcomes are the expected ones, check by check: the same
    number of checks, each the same value (==, `is` for None/True/False, truth) or an exception of the expected
    class or a subclass, and no error outside a check."""
    got = reply["outcomes"]
    if reply["error"] is not None or len(got) != len(checks):
        raise AssertionError
    for want, outcome in zip(checks, got, strict=True):
        if want["raised"] is not None:
            raised = outcome.get("raised")
            ok = isinstance(raised, list) and want["raised"] in raised
        elif "value" not in outcome:
            ok = False
        else:
            actual, expected = dec(outcome["value"]), dec(want["value"])
            ok = actual is expected if want["compare"] == "is" else actual == expected
        if not ok:
            raise AssertionError


def build_tests(tests: dict, candidate, run) -> list:
    """One thunk per test; each raises when its test fails. Test code runs here, in the grader, but a value test's:
    that runs in the worker (`run`), and only its judgement here."""
    kind = tests["kind"]
    if kind == "values":
        return [lambda t=t: judge_values(t["checks"], run(t["code"])) for t in tests["tests"]]
    if kind == "call":

        def case(c: dict) -> None:
            if not same(candidate(*c["args"]), c["expected"], tests["float_tol"]):
                raise AssertionError

        return [functools.partial(case, c) for c in tests["cases"]]
    ns = {"__name__": "tests"}
    if kind == "assert":
        exec(compile(tests["setup"], "setup.py", "exec"), ns)
        ns[tests["entry_point"]] = candidate
        return [(lambda s=s: exec(compile(s, "test.py", "exec"), ns)) for s in tests["asserts"]]
    if kind == "check":
        exec(compile(tests["prelude"], "prelude.py", "exec"), ns)
        exec(compile(tests["code"], "test.py", "exec"), ns)
        ns[tests["entry_point"]] = candidate  # checks may call it by name, not only as candidate
        return [lambda: ns["check"](candidate)]
    raise ValueError(f"unknown test kind {kind!r}")


def run_tests(worker: Worker, thunks: list, deadline: list[float]) -> list[dict]:
    results = []
    for thunk in thunks:
        if not worker.ready():
            results.append({"passed": False, "error": worker.load_error, "where": "solution"})
            continue
        deadline[0] = time.monotonic() + worker.timeout_s
        try:
            thunk()
            results.append({"passed": True, "error": None, "where": None})
        except SolutionBroke as e:
            where = "timeout" if str(e) == "timeout" else "crash"
            results.append({"passed": False, "error": str(e), "where": where})
        except AssertionError:
            results.append({"passed": False, "error": "wrong answer", "where": "test"})
        except Exception as e:  # raised by the solution (re-raised here) or by the test on its result
            results.append({"passed": False, "error": f"{type(e).__name__}: {e}"[:2000], "where": "solution"})
    return results


def grader_main() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    first = Forked()  # before the request: the tests must never be in a worker's memory
    req = json.loads(sys.stdin.buffer.read())
    report_to = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the tests' own prints must not mix with the report
    sys.stdout = sys.stderr
    tests = req["tests"]
    worker = Worker(req["solution"], req["test_timeout_s"], first)
    deadline = [0.0]

    def candidate(*args, **kwargs):
        return worker.call(tests["entry_point"], args, kwargs, deadline[0])

    try:
        thunks = build_tests(tests, candidate, lambda code: worker.run(code, deadline[0]))
    except Exception:  # the task's own setup code is broken: not the solution's fault
        json.dump({"task_error": traceback.format_exc()[-2000:]}, report_to)
        worker.stop()
        return
    results = run_tests(worker, thunks, deadline)
    output = worker.printed()
    json.dump({"load_error": worker.load_error, "tests": results, "output": output}, report_to)
    report_to.flush()


if __name__ == "__main__":
    sys.set_int_max_str_digits(0)  # big integers are plain data too
    worker_main() if sys.argv[1:] == ["--worker"] else grader_main()
