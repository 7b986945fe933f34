"""Where the `agentrl` commands print: `out` (stdout) and `err` (stderr), and errors said in one red line.

Messages carry user text (paths, settings, `pip install 'agentrl[vllm]'`), so they are printed
escaped: rich would take `[vllm]` for markup. Into a file or a pipe (no terminal) lines are not
wrapped, so a log keeps one line per iteration (and a table one line per row) whatever its length.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from agentrl.sandbox import SandboxConfig


def _console(stderr: bool) -> Console:
    # Rich lays a pipe out at 80 columns: text soft-wraps instead, and a table gets room for one row per line.
    # (The stream itself is looked up at each print, so a caller that swaps sys.stdout still gets the output.)
    piped = not (sys.stderr if stderr else sys.stdout).isatty()
    return Console(stderr=stderr, soft_wrap=piped, width=1000 if piped else None)


out, err = _console(stderr=False), _console(stderr=True)


def error(message: object) -> None:
    """`message` in red on stderr, as written."""
    err.print(escape(str(message)), style="red")


def fail(message: object, code: int = 2) -> NoReturn:
    """Say what is wrong and exit with `code` (2: the command was used wrongly)."""
    error(message)
    raise typer.Exit(code)


def seconds(option: str, value: float) -> None:
    """A time limit option, refused in one line unless a number of seconds > 0 (0 or less timed every program out
    at once, and nan or inf failed in the sandbox, reported as a sandbox failure)."""
    if not 0 < value < math.inf:
        fail(f"{option} takes seconds > 0, got {value}")


def sandbox_backend(backend: str) -> SandboxConfig:
    """A command's `--backend`, refused in one line when unknown or unusable here (nothing started yet)."""
    from agentrl.sandbox import SandboxConfig

    try:
        config = SandboxConfig(backend=backend)
    except ValueError:
        fail(f"--backend {backend}: choose docker, bwrap or local")
    if (why := config.unavailable()) is not None:
        fail(why)
    return config
