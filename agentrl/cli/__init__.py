"""The `agentrl` command line."""

import typer

from agentrl.cli import envs, sandbox, serve

app = typer.Typer(help="Reinforcement learning of LLM agents that call tools and run code.", no_args_is_help=True)
app.add_typer(sandbox.app, name="sandbox")
app.add_typer(envs.app, name="envs")
app.command("serve")(serve.serve)


def main() -> None:
    app()
