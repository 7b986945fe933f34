"""A stand-in for a vLLM OpenAI-compatible server (`vllm serve`), which needs a GPU and cannot run here.

It answers the endpoints `OpenAIEngine` drives a vLLM server with, with the request and reply shapes of
vLLM 0.16.0 (the version agentrl's `vllm` extra starts at), read in its source:
- GET /v1/models (vllm/entrypoints/openai/models/serving.py): the base model, named by its path, then
  each loaded adapter (`parent`: the base);
- POST /v1/completions, streamed (vllm/entrypoints/openai/completion/protocol.py): one chunk per token
  with `token_ids`, `logprobs.tokens` ("token_id:N") and `logprobs.token_logprobs`, the last one with
  its `finish_reason`; no `policy_versions` or `policy_kv_versions` (vLLM has neither); `model` names
  the base model or a loaded adapter, anything else is a 404;
- with VLLM_ALLOW_RUNTIME_LORA_UPDATING (`runtime_lora`): POST /v1/load_lora_adapter {lora_name,
  lora_path} (a name already loaded is a 400, a folder without an adapter a 404, the adapter config is
  checked as vLLM's PEFTHelper does) and POST /v1/unload_lora_adapter {lora_name}; both reply with
  plain text (vllm/entrypoints/serve/lora/, models/serving.py);
- with VLLM_SERVER_DEV_MODE (`dev_mode`): POST /pause?mode=keep, POST /resume (serve/rlhf/api_router.py),
  POST /collective_rpc {method, args, kwargs} (serve/rpc/api_router.py; here only `reload_weights` with
  its `weights_path`, gpu_model_runner.py), POST /reset_prefix_cache (serve/cache/api_router.py).
An endpoint that is off is FastAPI's 404, as in vLLM.

Behind it are agentrl's hf engines, so tests can check logprobs: one for the base model, and one per
adapter (peft loads the folder onto a copy of the base weights of the moment it is loaded). A reload
reads the checkpoint folder with transformers (checkpoint names and layout, as vLLM's loaders read
them; a missing or unexpected weight is an error, as in vLLM) into the base engine. /pause holds new
requests until /resume; requests in flight go on (a vLLM engine freezes them: the hf engine cannot
pause across HTTP calls), so a reload lands between two of their decode steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from transformers import AutoConfig, AutoModelForCausalLM

from agentrl.engine.base import SamplingParams
from agentrl.engine.hf import HFEngine
from agentrl.models.lora import peft_model

FINISH = {"stop": "stop", "length": "length", "aborted": "abort"}


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class CompletionRequest(BaseModel):
    """The fields of vLLM's CompletionRequest this stand-in acts on; vLLM ignores unknown ones."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = []
    stream: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False


class VLLMStandIn:
    """`app` serves the checkpoint folder `path`; `close()` the engines afterwards."""

    def __init__(
        self, path: str | Path, *, runtime_lora: bool = True, dev_mode: bool = True, max_lora_rank: int = 16
    ) -> None:
        self.path = str(path)
        self.config = AutoConfig.from_pretrained(self.path)
        self.max_lora_rank = max_lora_rank
        self.base = HFEngine(AutoModelForCausalLM.from_pretrained(self.path))
        self.engines: dict[str, HFEngine] = {self.path: self.base}  # what each served name samples with
        self.adapters: dict[str, str] = {}  # loaded adapter -> its folder
        self.retired: list[HFEngine] = []  # unloaded adapters' engines: requests in flight may still use them
        self.running = asyncio.Event()  # cleared while paused
        self.running.set()
        self.app = self._app(runtime_lora, dev_mode)

    async def close(self) -> None:
        for engine in [*self.engines.values(), *self.retired]:
            await engine.close()

    def _app(self, runtime_lora: bool, dev_mode: bool) -> FastAPI:
        app = FastAPI()
        created = int(time.time())

        @app.get("/v1/models")
        async def models() -> dict:
            cards = [
                {
                    "id": self.path,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": self.path,
                    "parent": None,
                    "max_model_len": self.base.max_context,
                }
            ]
            cards += [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": path,
                    "parent": self.path,
                }
                for name, path in self.adapters.items()
            ]
            return {"object": "list", "data": cards}

        @app.post("/v1/completions", response_model=None)
        async def completions(req: CompletionRequest) -> Response:
            engine = self.engines.get(req.model or self.path)
            if engine is None:
                return _error(404, f"The model `{req.model}` does not exist.", "NotFoundError", "model")
            if not req.stream:
                return _error(400, "the stand-in serves streamed completions only (OpenAIEngine always streams)")
            await self.running.wait()  # a paused server holds new requests
            params = SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=max(req.top_k, 0),
                max_tokens=req.max_tokens,
                stop_token_ids=tuple(req.stop_token_ids),
                seed=req.seed,
            )
            return StreamingResponse(self._stream(engine, req, params, created), media_type="text/event-stream")

        if runtime_lora:

            @app.post("/v1/load_lora_adapter", response_model=None)
            async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
                if req.lora_name in self.adapters and not req.load_inplace:
                    message = (
                        f"The lora adapter '{req.lora_name}' has already been loaded. If you want to load "
                        "the adapter in place, set 'load_inplace' to True."
                    )
                    return _error(400, message, "InvalidUserInput")
                config_file = Path(req.lora_path) / "adapter_config.json"
                if not config_file.is_file():
                    return _error(
                        404,
                        f"Loading lora {req.lora_name} failed: No adapter found for {req.lora_path}",
                        "NotFoundError",
                    )
                if problem := self._adapter_problem(json.loads(config_file.read_text())):
                    return _error(400, problem)
                from peft import LoraConfig, set_peft_model_state_dict
                from safetensors.torch import load_file

                # peft_model: peft's own call of a transformers deprecation is not shown (nor turned into an error)
                module = peft_model(copy.deepcopy(self.base.model), LoraConfig.from_pretrained(req.lora_path))
                set_peft_model_state_dict(module, load_file(Path(req.lora_path) / "adapter_model.safetensors"))
                self.engines[req.lora_name] = HFEngine(module)
                self.adapters[req.lora_name] = req.lora_path
                return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

            @app.post("/v1/unload_lora_adapter", response_model=None)
            async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
                if req.lora_name not in self.adapters:
                    return _error(404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError")
                del self.adapters[req.lora_name]
                self.retired.append(self.engines.pop(req.lora_name))
                return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

        if dev_mode:

            @app.post("/pause")
            async def pause(mode: str = "abort") -> dict:
                if mode != "keep":
                    raise NotImplementedError("the stand-in pauses with mode=keep only")
                self.running.clear()
                return {"status": "paused"}

            @app.post("/resume")
            async def resume() -> dict:
                self.running.set()
                return {"status": "resumed"}

            @app.post("/collective_rpc")
            async def collective_rpc(body: dict[str, Any]) -> dict:
                if body.get("method") != "reload_weights" or body.get("args"):
                    raise NotImplementedError(f"the stand-in runs only reload_weights(weights_path=...), not {body}")
                await self._reload(body.get("kwargs", {})["weights_path"])
                return {"results": [None]}  # one worker, whose reload_weights returns None

            @app.post("/reset_prefix_cache")
            async def reset_prefix_cache(reset_running_requests: bool = False) -> Response:
                return Response(status_code=200)  # the hf engine empties its prefix cache on every update itself

        return app

    def _adapter_problem(self, config: dict) -> str | None:
        """What vLLM's PEFTHelper refuses in an adapter_config.json (vllm/lora/peft_helper.py)."""
        if missing := {"r", "lora_alpha", "target_modules"} - config.keys():
            return f"Missing required configuration fields: {missing}"
        if config.get("modules_to_save"):
            return "vLLM only supports modules_to_save being None."
        if config.get("use_dora"):
            return "vLLM does not yet support DoRA."
        if config.get("bias", "none") != "none":
            return "Adapter bias is not supported."
        if config["r"] > self.max_lora_rank:
            return f"LoRA rank {config['r']} is greater than max_lora_rank {self.max_lora_rank}."
        return None

    async def _reload(self, weights_path: str) -> None:
        """The worker's reload_weights(weights_path=...): every weight, from the folder's safetensors."""
        files = list(Path(weights_path).glob("*.safetensors"))
        if not Path(weights_path).is_absolute() or not files:
            raise RuntimeError(f"Cannot find any model weights with `{weights_path}`")
        with tempfile.TemporaryDirectory() as view:  # the served model's config beside the folder's weights
            self.config.save_pretrained(view)
            for f in files:
                (Path(view) / f.name).symlink_to(f)
            model, info = AutoModelForCausalLM.from_pretrained(view, output_loading_info=True)
        if info["missing_keys"] or info["unexpected_keys"]:
            raise ValueError(f"weights not in the model or not in the checkpoint: {info}")
        await self.base.update_weights(model.state_dict())

    async def _stream(
        self, engine: HFEngine, req: CompletionRequest, params: SamplingParams, created: int
    ) -> AsyncIterator[str]:
        gen = await engine.generate(req.prompt, params)
        n = len(gen.token_ids)
        for i in range(max(n, 1)):  # a request that made no token still gets its finish reason
            ids, lps = gen.token_ids[i : i + 1], gen.logprobs[i : i + 1]
            choice = {
                "index": 0,
                "text": "",
                "finish_reason": FINISH[gen.finish_reason] if i >= n - 1 else None,
                "stop_reason": None,
                "logprobs": {
                    "text_offset": [0] * len(ids),
                    "token_logprobs": lps,
                    "tokens": [f"token_id:{t}" if req.return_tokens_as_token_ids else "" for t in ids],
                    "top_logprobs": [None] * len(ids),
                },
            }
            if req.return_token_ids:
                choice |= {"token_ids": ids, "prompt_token_ids": req.prompt if i == 0 else None}
            chunk = {
                "id": "cmpl-standin",
                "object": "text_completion",
                "created": created,
                "model": req.model or self.path,
                "choices": [choice],
                "usage": None,
            }
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"


def _error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    """vLLM's ErrorResponse: {"error": {message, type, param, code}}, the code the HTTP status."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


@contextlib.asynccontextmanager
async def serving(app: FastAPI, port: int = 0) -> AsyncIterator[str]:
    """`app` as a real HTTP server on `port` of 127.0.0.1 (0: a free one), in this event loop, for the block: its
    URL."""
    sock = socket.create_server(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # it failed to start: raise why
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
