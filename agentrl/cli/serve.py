"""`agentrl serve`: an inference engine behind the OpenAI API: completions (token ids in and out) and chat
completions (messages in, tool calls out, token ids as extension fields)."""

from __future__ import annotations

import asyncio
import signal
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import uvicorn

if TYPE_CHECKING:
    from fastapi import FastAPI

    from agentrl.engine import InferenceEngine

from agentrl.cli.console import err, fail
from agentrl.engine.config import is_loopback
from agentrl.models.lora import LoraSettings

API_KEY_ENV = "AGENTRL_API_KEY"
_LORA = LoraSettings()  # the run's defaults, so that a plain --lora-rank matches a plain model.lora

# Requests still running this long after SIGINT/SIGTERM are cut off (`_Server.shutdown` aborted
# them already, so this only bounds an engine that does not honour aborts).
GRACE_S = 10


def serve(
    model: Annotated[
        str | None,
        typer.Option(help='Checkpoint directory (save_pretrained output), or "default" (the shipped policy).'),
    ] = None,
    tiny: Annotated[
        str | None, typer.Option(help="Serve a fresh random-init tiny model of this architecture, e.g. qwen3_moe.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Weight seed of the --tiny model.")] = 0,
    engine: Annotated[str, typer.Option(help="Inference engine: hf, vllm (a GPU), or one a package registers.")] = "hf",
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(help="Port to listen on; 0 picks a free one (the printed URL has it).", min=0, max=65535)
    ] = 8000,
    dtype: Annotated[str, typer.Option(help="Weight dtype: float32, bfloat16, float16 or auto.")] = "float32",
    max_batch_size: Annotated[int, typer.Option(help="Most requests decoded in one batch.")] = 64,
    decode_window: Annotated[
        int | None,
        typer.Option(help="hf: decode steps between two reads of the tokens back (default: 8 on a GPU, else 1)."),
    ] = None,
    lora_rank: Annotated[int, typer.Option(help="Take LoRA adapter updates of this rank (0: none).")] = 0,
    lora_alpha: Annotated[float, typer.Option(help="The adapters' alpha (the run's model.lora.alpha).")] = _LORA.alpha,
    lora_targets: Annotated[
        str, typer.Option(help="Comma-separated modules with adapters (the run's model.lora.target_modules).")
    ] = ",".join(_LORA.target_modules),
    lora_experts: Annotated[bool, typer.Option(help="Adapters on the MoE expert projections too.")] = False,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=API_KEY_ENV,
            show_envvar=True,
            help="Every endpoint but /health needs `Authorization: Bearer KEY`; required off loopback.",
        ),
    ] = None,
) -> None:
    """Serve a model over HTTP (OpenAI completions, token ids in and out) until SIGINT or SIGTERM.

    Prints `agentrl serve: NAME on http://HOST:PORT` once it is listening.

    POST /v1/chat/completions renders messages with the model's chat template and parses its tool calls
    (Hermes) into `tool_calls`: the `openai` SDK works against it unchanged.

    It takes weight updates too (POST /agentrl/weights): `OpenAIEngine` drives it as a policy. For
    a LoRA run, start it with the run's adapter shape (--lora-rank, --lora-alpha, --lora-targets,
    --lora-experts): it serves the base model until the first adapter arrives.
    """
    if (model is None) == (tiny is None):
        fail("pass exactly one of --model DIR and --tiny ARCH")
    if model is not None and seed:
        fail("--seed is the weight seed of a --tiny model: it does nothing with --model; drop it")
    if not lora_rank and (unused := _lora_options(lora_alpha, lora_targets, lora_experts)):
        fail(
            f"{' and '.join(unused)} shape the LoRA adapters: they do nothing without --lora-rank; set it, or drop them"
        )
    api_key = (api_key or "").strip() or None  # an empty AGENTRL_API_KEY is no key
    if api_key is None and not is_loopback(host):
        fail(
            f"--host {host} is reachable from other machines: give a key (--api-key KEY, or {API_KEY_ENV}) that "
            "every request, weight uploads included, must carry"
        )

    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from agentrl.config import ConfigError, load
    from agentrl.engine import EngineConfig, EngineModel, build_engine, engine_unavailable
    from agentrl.engine.server import create_app
    from agentrl.models.default import resolve_path
    from agentrl.models.tiny import save_tiny

    transformers_logging.disable_progress_bar()  # stderr stays readable: the URL line, warnings, "stopped"
    with tempfile.TemporaryDirectory(prefix="agentrl-serve-") as tmp:
        try:
            path = resolve_path(model) if model is not None else save_tiny(tmp, tiny, seed=seed)
        except (ValueError, FileNotFoundError) as e:  # an unknown architecture (the message lists the known ones)
            fail(e)
        if model is not None and model != "default" and not Path(path).is_dir():
            fail(f"--model {model}: no such checkpoint folder")
        name = model if model is not None else f"tiny-{tiny}"
        try:  # a bad setting, or --lora-experts on a dense model: one line, not a traceback
            cfg = load(
                EngineConfig,
                {"kind": engine, "max_batch_size": max_batch_size, "dtype": dtype}
                | ({"decode_window": decode_window} if decode_window is not None else {}),
                source="--engine/--max-batch-size/--dtype/--decode-window",
            )
            if why := engine_unavailable(cfg):
                fail(f"--engine {cfg.kind}: {why}")
            # zero-initialised adapters (peft's B = 0): the base model until the first update
            lora = None
            if lora_rank:
                lora = LoraSettings(
                    rank=lora_rank, alpha=lora_alpha, target_modules=lora_targets.split(","), experts=lora_experts
                )
            eng = build_engine(cfg, EngineModel(str(path), lora=lora))
        except (ConfigError, ValueError, ImportError) as e:  # pydantic's ValidationError is a ValueError too
            fail(e)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):  # no tokenizer files: replies carry ids only, no `text`
            tokenizer = None
        vocab_size = AutoConfig.from_pretrained(path).vocab_size
        app = create_app(eng, model_name=name, tokenizer=tokenizer, vocab_size=vocab_size, api_key=api_key)
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            from agentrl.rollout import ChatFormat
            from agentrl.rollout.chat_api import ChatCompletions

            ChatCompletions(eng, ChatFormat(tokenizer), model_name=name).add_routes(app)
        else:
            err.print(f"agentrl serve: {name} has no chat template: /v1/chat/completions is not served")
        asyncio.run(_serve(app, eng, name, host, port))
    err.print("agentrl serve: stopped")


def _lora_options(alpha: float, targets: str, experts: bool) -> list[str]:
    """The adapter options set to other than their defaults."""
    changed = {
        "--lora-alpha": alpha != _LORA.alpha,
        "--lora-targets": targets != ",".join(_LORA.target_modules),
        "--lora-experts": experts,
    }
    return [option for option, differs in changed.items() if differs]


class _Server(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Abort the running requests first: uvicorn waits for every open request before it stops,
        # and an aborted one replies at once, with the tokens made so far (finish_reason "abort").
        await self.config.app.state.stop()
        await super().shutdown(sockets)


async def _serve(app: FastAPI, engine: InferenceEngine, name: str, host: str, port: int) -> None:
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=GRACE_S
    )
    server = _Server(config)
    # uvicorn catches SIGINT/SIGTERM while it serves, shuts down gracefully, then restores the
    # handlers it found and raises the signal again. These are the handlers it finds: they take
    # that repeat, so the process goes on to close the engine and exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    from agentrl.engine.server import listen

    try:
        try:  # bound here, so that a taken port is one clear line and the URL is printed once it listens
            sock = listen(host, port)
        except OSError as e:
            fail(f"cannot listen on {host}:{port}: {e.strerror}", 1)
        bound_host, bound_port = sock.getsockname()[:2]
        bound_host = f"[{bound_host}]" if ":" in bound_host else bound_host  # an IPv6 address, as a URL writes it
        await engine.start()
        print(f"agentrl serve: {name} on http://{bound_host}:{bound_port}", flush=True)
        await server.serve(sockets=[sock])
    finally:
        await engine.close()
