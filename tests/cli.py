"""The one way tests run the `agentrl` command: `agentrl(...)` to completion, `start_agentrl(...)` in the background
(`sets(...)` spells `--set` options).

Both run `python -m agentrl` of this interpreter (or `python LAUNCHER -m agentrl`, e.g. under
torch.distributed.run) with the test environment (`env()`: no terminal width is set, so output is what
a log file gets; Ray without auth); `agentrl(...)` stops a command that runs too long with a failure
that shows where it stood.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import pytest

AGENTRL = [sys.executable, "-m", "agentrl"]


def env(**extra: str | None) -> dict[str, str]:
    """The environment `agentrl` runs with in tests; a variable `extra` sets to None is left out."""
    out = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"RAY_AUTH_MODE": "disabled"} | extra
    return {k: v for k, v in out.items() if v is not None}


def agentrl(
    *args: object,
    cwd: Path | str | None = None,
    timeout: float = 300,
    check: bool = True,
    extra_env: dict[str, str | None] | None = None,
    launcher: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run `agentrl ARGS` to its end; `check`: fail the test unless it exits 0.

    launcher: python's arguments before `-m agentrl` (["-m", "torch.distributed.run", ...])."""
    cmd = _command(args, launcher)
    name = " ".join(["agentrl", *map(str, args)])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env(**(extra_env or {})))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name} ran past {timeout} s:\n{_text(e.stdout)[-4000:]}\n{_text(e.stderr)[-4000:]}")
    if check and r.returncode != 0:
        pytest.fail(f"{name} exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


def start_agentrl(
    *args: object,
    cwd: Path | str | None = None,
    sigint: bool = True,
    stdout: int | IO | None = None,
    stderr: int | IO | None = None,
    extra_env: dict[str, str | None] | None = None,
) -> subprocess.Popen[str]:
    """`agentrl ARGS` in the background, as text; stdout and stderr piped unless `stdout` / `stderr` say
    where (a file, or subprocess.STDOUT to merge stderr into stdout).

    sigint: the child takes SIGINT as a terminal's Ctrl-C delivers it (a test runner may start
    children with it ignored)."""
    return subprocess.Popen(
        _command(args),
        cwd=cwd,
        env=env(**(extra_env or {})),
        text=True,
        stdout=subprocess.PIPE if stdout is None else stdout,
        stderr=subprocess.PIPE if stderr is None else stderr,
        preexec_fn=_default_sigint if sigint else None,
    )


def listening_url(proc: subprocess.Popen[str]) -> str:
    """The URL a started `agentrl serve` prints once it listens."""
    for line in proc.stdout:
        if "http://" in line:
            return line.split()[-1]
    raise AssertionError(f"agentrl serve exited ({proc.wait()}) before listening: {proc.stderr and proc.stderr.read()}")


@contextlib.contextmanager
def serving(*args: object, extra_env: dict[str, str | None] | None = None) -> Iterator[str]:
    """`agentrl serve ARGS --port 0` for the block: its URL; stopped with Ctrl-C after it."""
    proc = start_agentrl("serve", *args, "--port", 0, stderr=subprocess.DEVNULL, extra_env=extra_env)
    try:
        yield listening_url(proc)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def sets(*settings: str) -> list[str]:
    """`--set S` for each setting: sets("iterations=2", "eval.tasks=4")."""
    return [a for s in settings for a in ("--set", s)]


def _command(args: Sequence[object], launcher: Sequence[str] = ()) -> list[str]:
    return [sys.executable, *launcher, *AGENTRL[1:], *map(str, args)]


def _default_sigint() -> None:
    """In the child: SIGINT as a terminal's Ctrl-C delivers it. Ignored and blocked signals survive exec:
    a shell's background job (as CI may run in) ignores SIGINT, and a thread of the test process may block it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""
