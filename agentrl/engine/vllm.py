"""`vllm` engine: an in-process `vllm.LLM` (extra `agentrl[vllm]`, a GPU machine), stepped by agentrl.

As in `hf` (both are `agentrl.engine.threaded` engines), a background thread runs the loop:
add the requests that arrived, abort the ones asked to stop, run one `LLMEngine.step()` and
hand out its tokens. `update_weights` takes the same lock, so new weights land between two
steps and each token records the version that sampled it. For that, vLLM's engine core runs
in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here): a core in its own process
keeps stepping ahead of the outputs read here, and a token could be credited to the wrong
version.

Logprobs: the LLM is built with `logprobs_mode="processed_logprobs"`, so vLLM reports log q(y)
after temperature and top-k/top-p, and for greedy requests log softmax(logits): the meaning
`agentrl.engine.sampling` defines. (vLLM's top-p drops tokens while the mass of the less likely
ones stays <= 1 - p: the same kept set up to ties at the boundary.) Prefix caching is off by
default, so no request reuses KV computed under older weights.

Weights (vLLM >= 0.10.2):
- full: the state dict goes to each worker's `model.load_weights` through `LLM.collective_rpc`
  and the worker extension `WeightLoader`, laid out as the checkpoint is (`agentrl.models.layout`:
  transformers 5 fuses MoE experts in memory, vLLM's loaders read per-expert checkpoint names).
- LoRA (`VLLMEngine(..., lora=peft.LoraConfig)`): the adapter is written to a temporary
  directory and served as a new `LoRARequest` per version. vLLM binds a request to its adapter
  when it is added, so requests in flight are re-added (prompt + tokens so far) with the new one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.engine.base import Capabilities, FinishReason, SamplingParams
from agentrl.engine.config import EngineConfig, EngineModel
from agentrl.engine.threaded import Request, ThreadedEngine
from agentrl.models.layout import checkpoint_layout, meta_model_at

if TYPE_CHECKING:
    from peft import LoraConfig

MAX_BATCH_SIZE = 256  # sequences vLLM schedules together (max_num_seqs), by default
INSTALL_HINT = "the vllm engine needs vLLM: pip install 'agentrl[vllm]' (on a machine with an NVIDIA GPU)"
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "aborted"}


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e


class WeightLoader:
    """Mixed into vLLM's worker class (`worker_extension_cls`): the methods `collective_rpc` calls."""

    def agentrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.model_runner.model.load_weights(weights=weights)


@dataclass(eq=False, kw_only=True)
class _Request(Request):
    vllm_id: str = ""  # a fresh id each time it is added to vLLM (a LoRA update re-adds it)
    kv_version: int = 0  # the version it was last added under: a full update leaves its KV in place


class VLLMEngine(ThreadedEngine):
    """vLLM in this process. `llm_kwargs` go to `vllm.LLM` (tensor_parallel_size, gpu_memory_utilization, ...)."""

    name = "vllm"
    thread_name = "agentrl-vllm-engine"
    logprob_semantics = (
        "log q(y): q = softmax(top_p(top_k(logits / T))), renormalised; greedy: softmax(logits) "
        "(vLLM logprobs_mode=processed_logprobs)"
    )

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "auto",
        max_batch_size: int = MAX_BATCH_SIZE,
        max_context: int | None = None,
        lora: LoraConfig | None = None,
        seed: int = 0,
        version: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        _require_vllm()
        from vllm import LLM

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the LLM is built (see the module docstring)
        kwargs: dict[str, Any] = dict(
            model=str(model),
            dtype=dtype,
            max_num_seqs=max_batch_size,
            max_model_len=max_context,
            seed=seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightLoader",
            enable_prefix_caching=False,
        )
        if lora is not None:
            kwargs.update(enable_lora=True, max_lora_rank=lora.r, max_loras=1)
        self.llm = LLM(**{**kwargs, **llm_kwargs})
        self._engine = self.llm.llm_engine
        super().__init__(int(self._engine.model_config.max_model_len), version=version)
        self._model_path = model  # its config gives the checkpoint layout of full weight updates
        self._lora_config = lora
        self._dtype = str(self._engine.model_config.dtype).removeprefix("torch.")
        self._lora_dir = Path(tempfile.mkdtemp(prefix="agentrl-vllm-lora-")) if lora is not None else None
        self._lora_request = None  # the adapter of the current version; None: the base weights
        self._vllm_ids = itertools.count()
        self._running: dict[str, _Request] = {}  # by vllm_id: the requests vLLM holds

    @classmethod
    def from_config(cls, cfg: EngineConfig, model: EngineModel, *, version: int = 0, seed: int = 0) -> VLLMEngine:
        """vLLM loads `model.path` itself (a shared module cannot be sampled by it); with `model.lora` it serves
        the same adapters, so that it takes LoRA updates."""
        _require_vllm()
        if model.path is None:
            raise ValueError("vLLM loads its model from a folder or hub id: EngineModel(path=...)")
        lora = None
        if model.lora is not None:
            from agentrl.models.lora import peft_config

            lora = peft_config(model.lora, meta_model_at(model.path))
        return cls(
            model.path,
            dtype=cfg.dtype,
            max_batch_size=cfg.max_batch_size or MAX_BATCH_SIZE,
            seed=seed,
            version=version,
            lora=lora,
            **cfg.vllm,
        )

    @classmethod
    def unavailable(cls, cfg: EngineConfig) -> str | None:
        if importlib.util.find_spec("vllm") is None:
            return INSTALL_HINT
        if not torch.cuda.is_available():
            return "vLLM needs an NVIDIA GPU and none is visible here: use engine.kind=hf on this machine"
        return None

    @property
    def capabilities(self) -> Capabilities:
        updates = {"full", "lora"} if self._lora_config is not None else {"full"}
        return Capabilities(weight_updates=frozenset(updates), pausable=True, dtype=self._dtype)

    # -- requests --------------------------------------------------------------------

    def _new_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> _Request:
        return _Request(id=request_id, prompt=prompt, params=params, loop=loop, future=loop.create_future())

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None = None, *, lora: Mapping[str, torch.Tensor] | None = None
    ) -> int:
        if (state_dict is None) == (lora is None):
            raise ValueError("pass exactly one of a full state_dict and a LoRA adapter (vLLM holds its own weights)")
        return await asyncio.to_thread(self._install, state_dict, lora)

    def _install(self, state_dict: Mapping[str, torch.Tensor] | None, lora: Mapping[str, torch.Tensor] | None) -> int:
        with self._lock:
            version = self._version + 1
            if lora is not None:
                self._install_lora(lora, version)
            else:
                weights = checkpoint_layout(self._model_path, state_dict)
                self.llm.collective_rpc("agentrl_load_weights", args=(list(weights.items()),))
            self.llm.reset_prefix_cache()  # if the caller turned prefix caching on: drop KV of the old weights
            self._version = version
            return version

    def _install_lora(self, lora: Mapping[str, torch.Tensor], version: int) -> None:
        if self._lora_config is None:
            raise ValueError("a LoRA update needs the engine built with lora=peft.LoraConfig(...)")
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        path = self._lora_dir / f"v{version}"
        path.mkdir()
        self._lora_config.save_pretrained(str(path))  # adapter_config.json
        save_file(
            {k: v.detach().to("cpu", copy=True).contiguous() for k, v in lora.items()},
            str(path / "adapter_model.safetensors"),
        )
        old, self._lora_request = self._lora_request, LoRARequest(f"agentrl-v{version}", version, str(path))
        running = list(self._running.values())
        if running:
            self._engine.abort_request([r.vllm_id for r in running])
            self._running.clear()
            for req in running:
                self._add(req)
        if old is not None:
            self._engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    async def close(self) -> None:
        await super().close()
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    # -- the loop (engine thread) -----------------------------------------------------

    def _busy(self) -> bool:
        return bool(self._running)

    def _step(self, arrived: list[_Request]) -> None:
        for req in arrived:
            if req.aborted:
                self._resolve(req, "aborted")
            else:
                self._add(req)
        aborted = [r for r in self._running.values() if r.aborted]
        if aborted:
            self._engine.abort_request([r.vllm_id for r in aborted])
            for req in aborted:
                del self._running[req.vllm_id]
                self._resolve(req, "aborted")
        if not self._running:
            return
        for out in self._engine.step():  # DELTA outputs: the tokens this step added
            req = self._running.get(out.request_id)
            if req is None:
                continue
            completion = out.outputs[0]
            for token, logprobs in zip(completion.token_ids, completion.logprobs, strict=True):
                req.tokens.append(token)
                req.logprobs.append(logprobs[token].logprob)
                req.versions.append(self._version)
                req.kv_versions.append(req.kv_version)
            if out.finished:
                del self._running[req.vllm_id]
                self._resolve(req, _FINISH[completion.finish_reason])

    def _add(self, req: _Request) -> None:
        """Hand `req` to vLLM; a request re-added after a LoRA update continues from its tokens so far."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        p = req.params
        params = VLLMSamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            max_tokens=p.max_tokens - len(req.tokens),
            stop_token_ids=list(p.stop_token_ids),
            seed=p.seed,
            logprobs=0,  # the sampled token's logprob only
            ignore_eos=True,  # stop only at stop_token_ids, as every agentrl engine does
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        req.vllm_id = f"{req.id}-{next(self._vllm_ids)}"
        prompt = TokensPrompt(prompt_token_ids=req.prompt + req.tokens)
        self._engine.add_request(req.vllm_id, prompt, params, lora_request=self._lora_request)
        req.kv_version = self._version  # vLLM prefills it now (prefix caching is reset on every update)
        self._running[req.vllm_id] = req
