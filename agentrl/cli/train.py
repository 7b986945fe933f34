"""`agentrl train` and `agentrl report`."""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from agentrl.cli.console import err, error, fail, out

if TYPE_CHECKING:
    from agentrl.eval import EvalResult
    from agentrl.runs import RunDir
    from agentrl.train.driver import LoopState
    from agentrl.train.run_config import RunConfig


def configs_dir() -> Path:
    """`configs/` of a source checkout, or the copy packaged into the wheel."""
    import agentrl

    pkg = Path(agentrl.__file__).parent
    for candidate in (pkg / "_configs", pkg.parent / "configs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"configs/ not found next to {pkg}: broken install?")


def resolve_config(env: str | None, config: Path | None, sets: list[str], resume: Path | None) -> RunConfig:
    """The run's config: a recipe (--config, else configs/ENV.yaml if there is one), --env, then --set on top.
    With --resume, the run folder's own config.yaml, with --set on top (e.g. more iterations)."""
    from agentrl.config import load, merge, parse_sets, read_yaml
    from agentrl.train.run_config import RunConfig

    if resume is not None:
        if env is not None or config is not None:
            raise ValueError("--resume continues a run with its own config: drop --env/--config (--set is allowed)")
        data = read_yaml(resume / "config.yaml")
        data["out"] = str(resume)
        if "out" in parse_sets(sets):  # it would continue (or start over) in another folder
            raise ValueError(f"--resume continues the run in {resume}: drop --set out=...")
    else:
        if env is None and config is None:
            raise ValueError("say which environment: --env NAME (or --config FILE)")
        recipe = config or (configs_dir() / f"{env}.yaml")
        data = read_yaml(recipe) if config is not None or recipe.exists() else {}
        if env is not None:
            data = merge(data, {"rollout": {"env": env}})
    return load(RunConfig, merge(data, parse_sets(sets)), source="config")


def train(
    env: Annotated[str | None, typer.Option(help="Environment to train on, e.g. code_sandbox.")] = None,
    config: Annotated[
        Path | None, typer.Option(help="YAML recipe (default: configs/ENV.yaml).", exists=True, dir_okay=False)
    ] = None,
    set_: Annotated[list[str], typer.Option("--set", help="Override a setting: --set algo.loss=grpo.")] = [],  # noqa: B006
    resume: Annotated[
        Path | None,
        typer.Option(help="Continue the run in this folder from its last checkpoint.", exists=True, file_okay=False),
    ] = None,
    build_image: Annotated[bool, typer.Option(help="Build a missing sandbox image without asking.")] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="Run on this Ray cluster (ADDR, or auto): learner ranks, engine replicas and env workers "
            "placed by the config's cluster: section."
        ),
    ] = None,
) -> None:
    """Train an agent with GSPO-token: rollouts in sandboxes, updates, weight sync, evaluation.

    Writes a run folder (metrics.jsonl, eval.jsonl, checkpoints, plots); Ctrl-C stops after a
    checkpoint, and `--resume RUN_DIR` continues.
    """
    from agentrl.config import ConfigError

    if ray_address is not None:
        set_ = [*set_, f"cluster.address={ray_address}"]
    try:
        cfg = resolve_config(env, config, set_, resume)
    except (ConfigError, ValueError) as e:
        fail(e)
    if cfg.cluster.address is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fail("cluster.address places the learner ranks as Ray actors: start one `agentrl train`, not torchrun")
    # Under torchrun (its RANK), rank 0 is the driver and ranks 1..N-1 are learner ranks alone: they build their
    # shards of the trainer, then follow the driver's calls (agentrl/train/torchrun_learner.py).
    rank = int(os.environ.get("RANK", "0"))
    # Before any process group or Ray actor: what this machine cannot run, each problem with what to do. The driver
    # checks the env, the model, the engine and (on this machine) the sandbox backend: for Docker the engine and the
    # image, which it builds if asked; a learner rank checks the model it loads (it may be on another node). On a
    # Ray cluster the sandboxes run on the Docker nodes, each checked (and given the image) when the run starts.
    if rank == 0:
        problems = preflight(cfg, sandboxes=cfg.cluster.address is None, build_image=build_image)
    else:
        problems = check_model(cfg.model.path)
    for p in problems:
        error(f"✗ {p}" if rank == 0 else f"✗ rank {rank}: {p}")
    if problems:
        raise typer.Exit(2)
    if rank == 0:
        out.print(cfg.sandbox.describe())
    # torch and the trainer only now: a bad config or a missing part is told in a second, not after their import
    _quiet_libraries()
    if rank > 0:
        from agentrl.train.torchrun_learner import follow

        return follow(cfg.trainer(), threads=cfg.threads)
    from agentrl.runs import RunDir

    if not _create_run_folder(cfg, resume):
        raise typer.Exit(2)
    run = RunDir(cfg.out)
    state = asyncio.run(_run(cfg, run, resume is not None))
    if state.iteration < cfg.iterations:  # stopped early (Ctrl-C), checkpointed: 130, as an interrupted command
        raise typer.Exit(130)
    from agentrl.train.report import report as make_report

    plots, summary = make_report(run.path)
    out.print(summary)
    out.print(f"plots: {plots}")


def _quiet_libraries() -> None:
    from transformers.utils import logging as transformers_logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    transformers_logging.disable_progress_bar()  # weight loading and saving: our own display says what runs


def _create_run_folder(cfg: RunConfig, resume: Path | None) -> bool:
    """The run folder (runs/ENV-DATE-TIME unless `out` is set), with the resolved config."""
    from agentrl.runs import RunDir

    run = RunDir(cfg.out or Path("runs") / f"{cfg.rollout.env}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    cfg.out = str(run.path)
    if run.path.exists() and not run.path.is_dir():
        error(f"{run.path} is a file, not a run folder: set --set out=... to a folder")
        return False
    if resume is None and run.path.exists() and any(run.path.iterdir()):
        error(f"{run.path} is not empty: continue it with --resume {run.path}, or set --set out=...")
        return False
    run.create(cfg.model_dump(mode="json"))
    out.print(f"run folder: {run.path}")
    return True


def report(run_dir: Annotated[Path, typer.Argument(help="A run folder.", exists=True, file_okay=False)]) -> None:
    """Plot a run (training reward, held-out success, clip fraction, mismatch, expert flips) into RUN_DIR/plots."""
    from agentrl.train.report import report as make_report

    try:
        plots, summary = make_report(run_dir)
    except FileNotFoundError as e:
        fail(e, 1)
    out.print(summary)
    out.print(f"plots: {plots}")


async def _run(cfg: RunConfig, run: RunDir, resume: bool) -> LoopState:
    from agentrl.train.loop import train as train_loop

    stop = asyncio.Event()
    task = asyncio.current_task()
    display = RichDisplay(cfg.iterations)

    def interrupt() -> None:
        if stop.is_set():
            display.message("second interrupt: quitting now (sandboxes are still removed)")
            task.cancel()
            return
        stop.set()
        display.message(
            "stopping: the rollouts in flight are parked, then a checkpoint is saved (Ctrl-C again to quit at once)"
        )

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt)
    try:
        with display:
            return await train_loop(cfg, run, resume=resume, display=display, stop=stop)
    except asyncio.CancelledError:
        raise typer.Exit(130) from None


class RichDisplay:
    """A progress bar over iterations, and one line per iteration and per evaluation."""

    def __init__(self, iterations: int) -> None:
        self.progress = Progress(
            TextColumn("[bold]iteration {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[last]}"),
            TimeRemainingColumn(compact=True),
            console=out,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=iterations, last="")

    def __enter__(self) -> RichDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def iteration(self, m: dict[str, Any]) -> None:
        clip = m.get("train/clip_fraction")
        line = (
            f"it {m['iteration']:>3}  reward {m['rollout/reward']:+.3f}  success {m['rollout/success_rate']:5.1%}  "
            f"clip {'-' if clip is None else f'{clip:.3f}'}  {m['rollout/tokens_per_s']:6.0f} tok/s  "
            f"partial {m['rollout/parked']:>2} parked / {m['rollout/partial_trained']:>2} trained  "
            f"failed {m['rollout/failed']} retried {m['rollout/retried']}  "
            f"left {datetime.timedelta(seconds=int(m['time/left_s']))}"
        )
        self.progress.console.print(line)
        self.progress.update(self.task, completed=m["iteration"] + 1, last=f"v{m['policy_version']}")

    def evaluation(self, r: EvalResult) -> None:
        self.progress.console.print(
            f"[bold cyan]held-out @ iteration {r.iteration}: success {r.success_rate:.1%} "
            f"({r.successes}/{r.scored}), mean return {r.mean_return:.3f}"
            + (f", {r.infra_failed} infra failures left out" if r.infra_failed else "")
            + "[/bold cyan]"
        )

    def message(self, text: str) -> None:
        self.progress.console.print(f"[yellow]{text}[/yellow]")


def preflight(cfg: RunConfig, *, sandboxes: bool = True, build_image: bool = False) -> list[str]:
    """What the run needs, checked before anything starts: each problem comes back with what to do about it.
    `sandboxes`: check that the sandbox backend can run here too (Docker: its engine and the sandbox image, built
    if asked)."""
    problems = _check_env(cfg) + check_model(cfg.model.path) + _check_engine(cfg)
    if sandboxes:
        problems += _check_sandboxes(cfg, build_image)
    if (address := cfg.ray_address) not in (None, "auto"):  # "auto": Ray finds the cluster this machine is in
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port or 6379)), timeout=5).close()
        except (OSError, ValueError) as e:
            problems.append(
                f"Ray cluster at {address} does not answer ({e}): start it (ray start --head), or drop "
                "cluster.address / rollout.ray_address to run Ray locally"
            )
    return problems


def _check_env(cfg: RunConfig) -> list[str]:
    """The env exists and takes these env_kwargs (its own config validates them)."""
    import importlib

    import agentrl

    module, _, name = cfg.rollout.env.rpartition(":")
    try:
        if module:  # "module:name": importing the module registers the env
            importlib.import_module(module)
        made = agentrl.make(name, **cfg.rollout.env_kwargs)
        made.close()
    except Exception as e:  # an unknown env or a bad env setting: the env's own message names the fix
        return [f"rollout.env {cfg.rollout.env!r}: {type(e).__name__}: {e}"]
    from agentrl.eval.heldout import split_leak

    leak = split_leak(cfg.rollout.env, made.cfg.split) if cfg.eval.tasks else None
    return [f"eval.tasks: {leak}"] if leak else []


def _check_engine(cfg: RunConfig) -> list[str]:
    """The engine can run here (vLLM installed and a GPU; a server answering)."""
    from agentrl.engine import engine_unavailable

    # replicas on a Ray cluster are not checked from here (the engine starts them on its nodes)
    why = engine_unavailable(cfg.engine_config())
    return [f"engine.kind={cfg.engine.kind}: {why}"] if why else []


def _check_sandboxes(cfg: RunConfig, build_image: bool) -> list[str]:
    """The backend can make sandboxes here (one line naming the fix, never a fall-back to another); Docker's also
    needs the sandbox image."""
    if why := cfg.sandbox.unavailable():
        return [f"sandbox.backend={cfg.sandbox.backend}: {why}"]
    if cfg.sandbox.backend != "docker":
        return []
    from agentrl.sandbox import image as sandbox_image
    from agentrl.sandbox.docker_sandbox import docker_client

    client = docker_client()
    tag = sandbox_image.image_tag()
    if not sandbox_image.image_exists(client, tag):
        question = f"The sandbox image {tag} is missing. Build it now (about a minute, offline if need be)?"
        if build_image or (sys.stdin.isatty() and typer.confirm(question, default=True)):
            sandbox_image.ensure_image(client, log=lambda m: err.print(m))
        else:
            return [f"sandbox image {tag} is missing: run `agentrl sandbox build` (or pass --build-image)"]
    return []


def check_model(model_path: str) -> list[str]:
    """A local Hugging Face folder, or a hub id this machine has cached or can download (also `agentrl sft`'s)."""
    from agentrl.models.default import resolve_path

    try:
        path = resolve_path(model_path)
    except (FileNotFoundError, ValueError) as e:
        return [f"model: {e}"]
    if Path(path).exists():
        if (Path(path) / "config.json").exists():
            return []
        return [f"model: {path} has no config.json (not a Hugging Face folder)"]
    if path.startswith((".", "/")) or path.count("/") > 1:
        return [f"model: no folder {path}"]
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(path, "config.json"), str):
        return []  # downloaded before: from_pretrained reads the cache
    fix = (
        f"download it where the hub is reachable (huggingface-cli download {path} --local-dir DIR), copy DIR "
        "here and set model.path=DIR"
    )
    if constants.HF_HUB_OFFLINE:
        return [f"model: {path} is a hub id, not a folder here, and HF_HUB_OFFLINE is set: {fix}"]
    import httpx

    try:
        httpx.head(constants.ENDPOINT, timeout=5)
    except httpx.HTTPError as e:
        return [
            f"model: {path} is a hub id, not a folder here, and the hub ({constants.ENDPOINT}) does not "
            f"answer ({type(e).__name__}): {fix}"
        ]
    return []
