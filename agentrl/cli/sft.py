"""`agentrl sft`, `agentrl envs demos` and `agentrl models init`: making and fine-tuning policies."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated

import typer

from agentrl.cli.console import err, fail, out, sandbox_backend


def sft(
    data: Annotated[Path | None, typer.Option(help='Chat JSONL: {"messages": [...], "tools": [...]} per line.')] = None,
    model: Annotated[
        str | None, typer.Option(help='Model to fine-tune: a Hugging Face folder, a hub id, or "default".')
    ] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Where to save the fine-tuned model.")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML with SFT settings.", exists=True, dir_okay=False)] = None,
    set_: Annotated[list[str], typer.Option("--set", help="Override a setting: --set lr=3e-4.")] = [],  # noqa: B006
) -> None:
    """Supervised fine-tuning on chat conversations, with the loss on the assistant's tokens only.

    Conversations are tokenised exactly as rollouts lay them out, so RL later scores the
    same token sequences. Runs on several ranks under torchrun (FSDP2).
    """
    from agentrl.config import ConfigError, load, merge, parse_sets, read_yaml
    from agentrl.train.sft import SFTConfig
    from agentrl.train.sft import sft as run_sft

    flags = {k: str(v) for k, v in (("data", data), ("out", out_dir)) if v is not None}
    if model is not None:
        flags["model"] = {"path": model}
    try:
        cfg = load(
            SFTConfig, merge(merge(read_yaml(config) if config else {}, flags), parse_sets(set_)), source="sft config"
        )
    except ConfigError as e:
        fail(e)
    from agentrl.cli.train import check_model

    if problems := check_model(cfg.model.path):
        fail("\n".join(problems))
    from transformers.utils import logging as transformers_logging

    from agentrl.train.policy import init_distributed, shutdown_distributed

    lead = init_distributed(cfg.model)
    transformers_logging.disable_progress_bar()
    t0 = time.perf_counter()  # metrics go out as plain JSON lines, never wrapped or marked up
    try:
        final = run_sft(cfg, log=lambda m: print(json.dumps({**m, "elapsed_s": round(time.perf_counter() - t0, 1)})))
    except (ValueError, FileNotFoundError) as e:
        fail(e, 1)
    finally:
        shutdown_distributed()
    if lead:
        out.print(f"saved {cfg.out} (loss {final.get('loss', float('nan')):.4f})")


def demos(
    env: Annotated[str, typer.Argument(help="Environment with a scripted expert, e.g. code_sandbox.")],
    n: Annotated[int, typer.Option("-n", help="Demonstrations to record.")] = 1000,
    out_file: Annotated[Path, typer.Option("--out", "-o", help="Chat JSONL to write.")] = Path("demos.jsonl"),
    seed: Annotated[int, typer.Option(help="Seeds the task draws and the expert's choices.")] = 0,
    concurrency: Annotated[int, typer.Option(help="Episodes (and sandboxes) at once.")] = 6,
    misread: Annotated[
        float,
        typer.Option(
            help="An imperfect expert: each step it can misread, it misreads with "
            "this probability; its wrong episodes are kept."
        ),
    ] = 0.0,
    prints: Annotated[
        float,
        typer.Option(
            help="An imperfect expert's habit: with this probability a solution prints its "
            "result instead of returning it; its wrong episodes are kept.",
        ),
    ] = 0.0,
    wrong_file: Annotated[
        float,
        typer.Option(
            help="An imperfect expert of repository tasks: with this probability it looks in the wrong file and "
            "submits no change; its wrong episodes are kept.",
        ),
    ] = 0.0,
    sloppy_edit: Annotated[
        float,
        typer.Option(
            help="An imperfect expert of repository tasks: with this probability it retypes the text to replace "
            "with the whitespace wrong, its edit fails, and it submits no change; its wrong episodes are kept.",
        ),
    ] = 0.0,
    typo_path: Annotated[
        float,
        typer.Option(
            help="An imperfect expert of repository tasks: with this probability it first names the right module "
            "with a typo, and the view fails.",
        ),
    ] = 0.0,
    recover: Annotated[
        float,
        typer.Option(
            help="An imperfect expert of repository tasks: after a wrong file, a failed edit or a typo, with this "
            "probability it recovers (views the right file, retypes the edit) instead of submitting.",
        ),
    ] = 0.0,
    mask_errors: Annotated[
        bool,
        typer.Option(
            help="Repository tasks: write the expert's erring calls with weight 0, so that SFT learns the "
            "recovery from them but not the errors.",
        ),
    ] = False,
    holdout: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.99,
            help="Leave this share of the env's tasks (by its seeded split: statements, for "
            "generated tasks) out of the demonstrations, for RL to meet unseen.",
        ),
    ] = 0.0,
    set_: Annotated[list[str], typer.Option("--set", help="An env setting: --set max_turns=3.")] = [],  # noqa: B006
    backend: Annotated[
        str,
        typer.Option(help="The sandboxes: docker (containers), bwrap (bubblewrap, no daemon) or local (NO isolation)."),
    ] = "docker",
) -> None:
    """Record a scripted expert's episodes through the real env (and sandboxes), as SFT data."""
    from agentrl.config import ConfigError, load, parse_sets
    from agentrl.env.demos import record
    from agentrl.tasks.solutions import Expert

    sandbox = sandbox_backend(backend)
    try:
        env_kwargs = parse_sets(set_)
        expert = load(
            Expert,
            {
                "misread": misread,
                "prints": prints,
                "wrong_file": wrong_file,
                "sloppy_edit": sloppy_edit,
                "typo_path": typo_path,
                "recover": recover,
                "mask_errors": mask_errors,
            },
            source="expert",
        )
    except ConfigError as e:
        fail(e)

    async def write_demonstrations() -> int:
        made = 0
        with open(out_file, "w") as f:
            async for d in record(
                env,
                n,
                env_kwargs=env_kwargs,
                seed=seed,
                concurrency=concurrency,
                expert=expert,
                min_return=1.0 if expert.perfect else None,
                holdout=holdout,
                backend=sandbox.backend,
            ):
                f.write(json.dumps({"messages": d.messages, "tools": d.tools, "task_id": d.task_id}) + "\n")
                made += 1
                if made % 500 == 0:
                    err.print(f"{made}/{n}")
        return made

    try:
        made = asyncio.run(write_demonstrations())
    except (NotImplementedError, RuntimeError, KeyError, ValueError) as e:
        fail(f"{type(e).__name__}: {e}", 1)
    out.print(f"wrote {made} demonstrations to {out_file}")


models_app = typer.Typer(help="Make model folders.", no_args_is_help=True)


@models_app.command("init")
def init(
    path: Annotated[Path, typer.Argument(help="Folder to write (config, safetensors, tokenizer).")],
    preset: Annotated[
        str,
        typer.Option(
            help="default: the default policy's shapes; small: twice its active parameters; tiny: the test models'."
        ),
    ] = "default",
    seed: Annotated[int, typer.Option(help="Weight seed.")] = 0,
    experts: Annotated[int | None, typer.Option(help="Experts per MoE layer (default: the preset's).", min=2)] = None,
    top_k: Annotated[
        int | None, typer.Option(help="Experts each token is routed to (default: the preset's).", min=1)
    ] = None,
) -> None:
    """A random-init Qwen3-MoE with the project tokenizer: the starting point `agentrl sft` fine-tunes."""
    from agentrl.models.default import ARCHITECTURE, SMALL_ARCHITECTURE
    from agentrl.models.tiny import save_tiny, tiny_config

    presets = {"default": ARCHITECTURE, "small": SMALL_ARCHITECTURE, "tiny": {}}
    if preset not in presets:
        fail(f"unknown preset {preset!r}; choose one of {sorted(presets)}")
    shapes = presets[preset] | ({} if experts is None else {"num_experts": experts})
    shapes |= {} if top_k is None else {"num_experts_per_tok": top_k}
    config = tiny_config("qwen3_moe", **shapes)
    if config.num_experts_per_tok > config.num_experts:  # transformers' config accepts it; routing would fail
        fail(
            f"--top-k {config.num_experts_per_tok} routes each token to more experts than the {config.num_experts} "
            "there are"
        )
    save_tiny(path, "qwen3_moe", seed=seed, **shapes)
    out.print(f"wrote {path}")
