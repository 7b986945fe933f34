"""`agentrl envs list | show | new | validate-repos` (`demos` is in `agentrl.cli.sft`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from agentrl.cli.console import fail, out, sandbox_backend, seconds

app = typer.Typer(help="List, inspect and create environments.", no_args_is_help=True)


@app.command("list")
def list_() -> None:
    """Every registered env: built-in, registered, and from installed packages (entry point agentrl.envs)."""
    from agentrl.env import list_envs

    table = Table("name", "id", "source", "description")
    for column in table.columns:
        column.overflow = "fold"  # never hide a name behind an ellipsis
    for e in list_envs():
        desc = f"[red]cannot load: {escape(e.error)}[/red]" if e.error else escape(e.description)
        table.add_row(e.name, e.id, e.source, desc)
    out.print(table)


@app.command()
def show(name: Annotated[str, typer.Argument(help="env name, e.g. code_sandbox")]) -> None:
    """An env's tools, task set, reward and settings."""
    from agentrl.env import make

    try:
        env = make(name)
    except Exception as e:
        fail(f"{type(e).__name__}: {e}", 1)
    out.print(f"[bold]{env.spec.id}[/bold]  {env.description}")
    tasks = env.task_set
    size = f"{len(tasks)} tasks" if hasattr(tasks, "__len__") else "unbounded"
    out.print(f"\n[bold]tasks[/bold]  {tasks.name} ({size}): {tasks.description}")
    out.print(f"\n[bold]reward[/bold]  {env.reward_doc}")
    out.print("\n[bold]tools[/bold]" + ("" if env.tool_schemas() else "  none: each reply is the action"))
    for schema in env.tool_schemas():
        fn = schema["function"]
        params = ", ".join(f"{p}: {s.get('type', '?')}" for p, s in fn["parameters"]["properties"].items())
        out.print(f"  {fn['name']}({params})  {fn.get('description', '')}")
    settings = Table("setting", "value", "meaning", title="settings (gymnasium.make keyword arguments)")
    for field in type(env.cfg).model_fields:
        settings.add_row(field, repr(getattr(env.cfg, field)), _meaning(type(env.cfg), field))
    out.print(settings)
    env.close()


@app.command()
def new(
    name: Annotated[str, typer.Argument(help="env name (a Python identifier)")],
    directory: Annotated[Path, typer.Option("--dir", help="where to create the package")] = Path("."),
    agent: Annotated[
        bool, typer.Option("--agent", help="an agent program (OpenAI SDK) on repo_fix instead of an env")
    ] = False,
) -> None:
    """Scaffold a package with a custom env (or, with --agent, an agent program), its entry point and a test."""
    from agentrl.env.scaffold import scaffold

    try:
        root = scaffold(name, directory, agent=agent)
    except (ValueError, FileExistsError) as e:
        fail(e, 1)
    out.print(f"created {root}\nnext: pip install -e '{root}[test]' && pytest {root}/tests")


@app.command("validate-repos")
def validate_repos(
    tasks: Annotated[str, typer.Argument(help="A repository task set: swebench:PATH, or repos[:...].")],
    limit: Annotated[int | None, typer.Option(help="Validate only the first N instances.", min=1)] = None,
    concurrency: Annotated[int, typer.Option(help="Instances at once, each in its own sandbox.", min=1)] = 4,
    timeout: Annotated[float, typer.Option(help="Wall-clock limit of one pytest run, seconds.")] = 120.0,
    backend: Annotated[
        str,
        typer.Option(
            help="The sandboxes: docker (containers), bwrap (bubblewrap, no daemon; an instance's image is unpacked "
            "for it) or local (NO isolation, no instance images)."
        ),
    ] = "docker",
) -> None:
    """Check that each instance grades what it claims, in sandboxes: FAIL_TO_PASS fails and PASS_TO_PASS passes on
    the base, and both pass with the gold patch. Exit status 1 when any instance does not."""
    import asyncio
    import itertools

    from agentrl.env.repos import image_sandbox, validate_instance
    from agentrl.sandbox import SandboxError
    from agentrl.tasks.registry import load_tasks
    from agentrl.tasks.repos.taskset import RepoTaskSet

    seconds("--timeout", timeout)
    config = sandbox_backend(backend)
    try:
        task_set = load_tasks(tasks)
    except (ValueError, FileNotFoundError) as e:
        fail(e)
    if not isinstance(task_set, RepoTaskSet):
        fail(f"{tasks} is not a repository task set (swebench:PATH or repos)")
    ids = list(itertools.islice(task_set.ids(), limit))

    async def one(iid: str, gate: asyncio.Semaphore) -> bool:
        async with gate:
            instance = task_set.instance(iid)
            sandbox = await (image_sandbox(instance.image, config) if instance.image else config.factory()())
            try:
                report = await validate_instance(instance, sandbox, timeout_s=timeout)
            finally:
                await sandbox.close()
        out.print(f"{iid}: " + ("ok" if report.ok else "; ".join(report.problems)), markup=False)
        return report.ok

    async def run() -> list[bool]:
        gate = asyncio.Semaphore(concurrency)
        return await asyncio.gather(*(one(i, gate) for i in ids))

    try:
        oks = asyncio.run(run())
    except SandboxError as e:
        fail(f"sandbox failure: {e}", 3)
    out.print(f"{sum(oks)} of {len(oks)} instances valid")
    if not all(oks):
        raise typer.Exit(1)


def _meaning(config: type, field: str) -> str:
    """A field's docstring; an override without one inherits its parent's."""
    for cls in config.__mro__:
        info = getattr(cls, "model_fields", {}).get(field)
        if info is not None and info.description:
            return info.description
    return ""
