"""`agentrl sandbox build | exec | gc`."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated

import docker
import typer

from agentrl.cli.console import err, error, fail, sandbox_backend, seconds
from agentrl.sandbox import ExecResult, Sandbox, SandboxError, SandboxPool, bwrap, reaper
from agentrl.sandbox import image as sandbox_image
from agentrl.sandbox.docker_sandbox import docker_client

app = typer.Typer(help="Build, use and clean up code sandboxes.", no_args_is_help=True)

# How `exec` runs a file, by suffix; anything else is executed directly.
INTERPRETERS = {".py": ["python3", "-u"], ".sh": ["sh"]}


def _client() -> docker.DockerClient:
    try:
        return docker_client()
    except SandboxError as e:
        fail(e)


@app.command()
def build(
    offline: Annotated[bool, typer.Option(help="Do not pull: debootstrap a Debian base and docker-import it.")] = False,
    base: Annotated[str | None, typer.Option(help="Build on this local image instead (needs python3).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if the image for this content hash exists.")] = False,
    mirror: Annotated[str, typer.Option(help="Debian mirror for the offline base.")] = sandbox_image.DEBIAN_MIRROR,
    wheels: Annotated[
        Path | None,
        typer.Option(help="A folder with the wheels of sandboxes/python/requirements.txt (no package index)."),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(help="docker: the image, and for bwrap its root filesystem too; bwrap: only what bwrap binds."),
    ] = "docker",
) -> None:
    """Build the sandbox image (reused while sandboxes/ is unchanged) and what bwrap sandboxes bind in: the test tools
    and, with Docker, the image's root filesystem. `--backend bwrap` needs no Docker (the root is then the host's)."""
    log = lambda m: err.print(m)  # noqa: E731
    if backend not in ("docker", "bwrap"):
        fail(f"--backend {backend}: choose docker or bwrap (local sandboxes need nothing built)")
    try:
        site = sandbox_image.ensure_site(wheels=wheels, log=log)
        if backend == "bwrap":
            print(site)
            return
        client = _client()
        tag = sandbox_image.ensure_image(
            client, offline=offline, base=base, force=force, mirror=mirror, wheels=wheels, log=log
        )
        if bwrap.unavailable() is None:
            sandbox_image.export_rootfs(client, tag, force=force, log=log)
    except RuntimeError as e:
        fail(e)
    print(tag)


@app.command()
def gc(
    all_: Annotated[bool, typer.Option("--all", help="Remove every agentrl sandbox, owners alive or not.")] = False,
) -> None:
    """Remove sandboxes whose owner process is gone: bwrap sandboxes of this host, and Docker's containers when a
    Docker engine answers."""
    trees = bwrap.collect_orphans(everything=all_)
    err.print(f"removed {len(trees)} bwrap sandbox(es)" + (f": {', '.join(trees)}" if trees else ""))
    try:
        client = docker_client()
    except SandboxError:
        err.print("no Docker engine: no containers to look at")
        return
    removed = reaper.collect_orphans(client, everything=all_)
    err.print(f"removed {len(removed)} container(s)" + (f": {', '.join(removed)}" if removed else ""))


@app.command("exec")
def exec_(
    file: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, help="Program to run (.py, .sh, or executable).")
    ],
    timeout: Annotated[float, typer.Option(help="Wall-clock limit in seconds.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with the result.")] = False,
    backend: Annotated[
        str, typer.Option(help="docker (a container), bwrap (bubblewrap, no daemon) or local (NO isolation).")
    ] = "docker",
) -> None:
    """Run FILE in a fresh pooled sandbox and print what it did.

    Exit status: 0 if the program exited 0, 1 if it failed (any other status),
    3 if the sandbox itself failed.
    """
    seconds("--timeout", timeout)
    cfg = sandbox_backend(backend)
    if backend == "docker":
        client = _client()
        if not sandbox_image.image_exists(client, sandbox_image.image_tag()):
            err.print("sandbox image missing: building it (once) ...")
            sandbox_image.ensure_image(client, log=lambda m: err.print(m))
    try:
        result = asyncio.run(_exec(cfg.factory(), file, timeout))
    except SandboxError as e:
        error(f"sandbox failure: {e}")
        raise typer.Exit(3) from None
    if as_json:
        print(json.dumps(result.model_dump(mode="json")))
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        color = "green" if result.ok else "red"
        err.print(
            f"[{color}]{result.status.value}[/{color}] exit_code={result.exit_code} signal={result.signal} "
            f"wall={result.wall_s:.3f}s cpu={result.cpu_s:.3f}s" + (" (output truncated)" if result.truncated else "")
        )
    raise typer.Exit(0 if result.ok else 1)


async def _exec(factory: Callable[[], Awaitable[Sandbox]], file: Path, timeout_s: float) -> ExecResult:
    async with SandboxPool(factory, size=1) as pool, pool.sandbox() as sb:
        await sb.write_file(file.name, file.read_bytes())
        argv = INTERPRETERS.get(file.suffix)
        if argv is None:
            await sb.run(["chmod", "+x", file.name])
            argv = []
        return await sb.run([*argv, f"./{file.name}" if not argv else file.name], timeout_s=timeout_s)
