"""The `agentrl` command line."""

import os

import typer

from agentrl.cli import envs, evaluate, sandbox, serve, sft, train, view

app = typer.Typer(help="Reinforcement learning of LLM agents that call tools and run code.", no_args_is_help=True)
app.add_typer(sandbox.app, name="sandbox")
app.add_typer(envs.app, name="envs")
app.command("serve")(serve.serve)
app.command("train")(train.train)
app.command("report")(train.report)
app.command("eval")(evaluate.eval_)
app.command("sft")(sft.sft)
app.command("view")(view.view)
app.add_typer(sft.models_app, name="models")
envs.app.command("demos")(sft.demos)


def main() -> None:
    # Ray 2.5x starts a local cluster with token authentication unless RAY_AUTH_MODE says otherwise, and logs a
    # warning on each `ray.init()` that it chose so. It reads the mode once, when ray is imported (setting it
    # later leaves the driver without the token its cluster wants), so it is said here, before any command
    # imports ray. Token, not disabled: a local Ray listens on the node's address, not on loopback alone.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    app()
