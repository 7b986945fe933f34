"""`agentrl view RUN_DIR`: browse a run's curves and trajectories, or an evaluation's verdicts, in a web page."""

import contextlib
import socket
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
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1; 0 picks a free one.", min=0, max=65535)] = 8765,
) -> None:
    """Serve a local page (127.0.0.1, offline) over a run: curves, trajectories token by token, groups side by side."""
    import uvicorn

    from agentrl.view import create_app

    try:
        app = create_app(folder)
    except FileNotFoundError as e:
        fail(e)
    # bound here, so that a taken port is one clear line and the printed URL is one that answers
    try:
        sock = socket.create_server(("127.0.0.1", port))
    except OSError as e:
        fail(f"cannot listen on 127.0.0.1:{port}: {e.strerror}", 1)
    out.print(f"agentrl view: http://127.0.0.1:{sock.getsockname()[1]}/  ({folder}; Ctrl-C to stop)")
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it stopped on: a stop, exit 0
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
