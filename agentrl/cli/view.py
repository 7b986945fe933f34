"""`agentrl view RUN_DIR`: browse a run's curves and trajectories, or an evaluation's verdicts, in a web page."""

from pathlib import Path
from typing import Annotated

import typer

from agentrl.cli.console import fail, out


def view(
    folder: Annotated[
        Path,
        typer.Argument(
            help="A run folder (agentrl train) or an evaluation folder (agentrl eval --out).",
            exists=True,
            file_okay=False,
        ),
    ],
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1.")] = 8765,
) -> None:
    """Serve a local page (127.0.0.1, offline) over a run: curves, trajectories token by token, groups side by side."""
    from agentrl.view import Folder, serve

    try:
        Folder(folder)
    except FileNotFoundError as e:
        fail(e)
    out.print(f"agentrl view: http://127.0.0.1:{port}/  ({folder}; Ctrl-C to stop)")
    serve(folder, port=port)
