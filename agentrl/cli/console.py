"""Where the `agentrl` commands print: `out` (stdout) and `err` (stderr), and errors said in one red line.

Messages carry user text (paths, settings, `pip install 'agentrl[vllm]'`), so they are printed
escaped: rich would take `[vllm]` for markup. Into a file or a pipe (no terminal) lines are not
wrapped, so a log keeps one line per iteration whatever its length.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

out = Console(soft_wrap=not sys.stdout.isatty())
err = Console(stderr=True, soft_wrap=not sys.stderr.isatty())


def error(message: object) -> None:
    """`message` in red on stderr, as written."""
    err.print(escape(str(message)), style="red")


def fail(message: object, code: int = 2) -> NoReturn:
    """Say what is wrong and exit with `code` (2: the command was used wrongly)."""
    error(message)
    raise typer.Exit(code)
