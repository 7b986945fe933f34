"""How to build an engine: `EngineConfig` (the `engine:` section of a run, `agentrl eval` and `agentrl serve`
settings) and `EngineModel` (what it serves). `agentrl.engine.build_engine` takes both."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from agentrl.cluster import InferencePlacement
from agentrl.models.lora import LoraSettings

if TYPE_CHECKING:
    from torch import nn


VLLM_OWN = {"model", "dtype", "max_batch_size", "max_context", "lora", "seed", "version"}
"""VLLMEngine's own arguments: `engine.vllm` holds only further vllm.LLM ones"""

BUILT_IN = ("hf", "vllm", "openai")
"""the engines of this package: their settings are keys of this section, never `engine.options`"""


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str = "hf"
    """a registered engine: hf (transformers in this process; on one process it samples with the trainer's own
    weights, no copy), vllm (in-process vLLM, GPU, pip install agentrl[vllm]), openai (an OpenAI-compatible server
    at base_url, or several at base_urls), or one another installed package registers (entry-point group
    agentrl.engines)"""
    max_batch_size: int | None = Field(None, ge=1)
    """requests decoded together; None: the engine's own default (hf 64, vllm 256). An openai engine's server
    decides its own"""
    prefix_cache_tokens: int = Field(65536, ge=0)
    """hf: KV of prompt prefixes kept for reuse across turns and group members (0: off)"""
    record_routing: bool = False
    """hf, MoE: record each generated token's top-k experts per layer in its trajectory (`routed_experts`)"""
    decode_window: int | None = Field(None, ge=1)
    """hf: decode steps between two reads of the sampled tokens back to the host (a row that stops inside a
    window decodes on to its end, the extra tokens dropped; requests join, aborts land and weights change
    between windows); None: 8 on a GPU, where the host then queues steps ahead of the kernels, 1 elsewhere"""
    cuda_graphs: bool = False
    """hf on a GPU: each decode step replays a CUDA graph, one per bucket of batch sizes, over fixed shapes (the
    batch padded to the bucket, attention over the KV storage's every column); needs the engine's own weights and
    sdpa attention (agentrl.engine.graphs)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "bfloat16_weights"] = "auto"
    """weights of an engine that loads its own copy: auto is float32 for hf (the learner's dtype) and the
    checkpoint's for vllm; bfloat16_weights (hf): weights rounded to bfloat16 (as a bf16 deployment stores
    them, every update too) with float32 compute; an engine sharing the learner's module samples in the
    learner's dtype"""
    base_url: str | None = None
    """openai: the server, e.g. http://127.0.0.1:8000 (agentrl serve; vLLM with --logprobs-mode processed_logprobs)"""
    api_key_env: str | None = None
    """openai: the environment variable holding the servers' API key (sent as a bearer token); the key itself is
    never a setting, so it never reaches a run folder"""
    served_model: str | None = None
    """openai: the served model to ask for; None: the first the server lists"""
    server: Literal["auto", "agentrl", "vllm"] = "auto"
    """openai: the kind of server, which decides how weight updates reach it: agentrl (agentrl serve: uploaded
    over its HTTP API), vllm (`vllm serve`: written into weights_dir and loaded through vLLM's endpoints); auto:
    agentrl when it answers GET /agentrl/version, else vllm"""
    weights_dir: str | None = None
    """openai, a vLLM server: a folder this process and the server both see at this path (a shared filesystem),
    where each update is written for the server to load (a LoRA adapter in peft's format, or a safetensors
    checkpoint); None: the server takes no weights from the run"""
    replicas: int | None = Field(None, ge=1)
    """engines sampling side by side, each a Ray actor (its own process) loading its own copy of the weights,
    behind one engine that routes requests and broadcasts weight updates (agentrl.engine.fleet): hf replicas on
    CPU, vllm one GPU each; 1 is one such actor (an asynchronous run's engine beside the learner); None: the one
    engine in this process"""
    threads_per_replica: int = Field(1, ge=1)
    """hf replicas: torch threads each, also the CPUs each reserves from Ray; 1 keeps R replicas on R cores
    (a CPU decode step of a small batch gains little from more threads)"""
    base_urls: list[str] = Field(default_factory=list)
    """openai: several servers (instead of base_url), one client each, behind one engine that routes requests"""
    affinity_slack_tokens: int = Field(4096, ge=0)
    """replicas or base_urls: an episode's next turn goes to the replica that served its last one (its prefix is
    cached there) unless that replica's outstanding work (prompt + max_tokens of its requests in flight) exceeds
    the least-loaded replica's by more than this many tokens, about one long request"""
    ray_address: str | None = None
    """replicas: the Ray cluster to start them on when Ray is not running yet; None: the run's (in `agentrl train`,
    rollout.ray_address), else a local Ray"""
    vllm: dict[str, Any] = Field(default_factory=dict)
    """vllm: extra vllm.LLM arguments (tensor_parallel_size, gpu_memory_utilization, enable_sleep_mode, ...)"""
    options: dict[str, Any] = Field(default_factory=dict)
    """an engine from another package: its own settings, passed to its `from_config`"""
    # A run's `cluster.inference` (agentrl/cluster.py), set by the run config: not a key of this section, so that
    # the cluster's layout is said in one place.
    _placement: InferencePlacement = PrivateAttr(default_factory=InferencePlacement)

    def api_key(self) -> str | None:
        """The key `api_key_env` names, read now (None without one)."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env, "").strip()
        if not key:
            raise ValueError(f"engine.api_key_env names {self.api_key_env}, which is not set: export the server's key")
        return key

    @property
    def placement(self) -> InferencePlacement:
        """What each replica reserves on a Ray cluster beyond the defaults (GPUs, CPUs, custom node resources)."""
        return self._placement

    def place(self, placement: InferencePlacement) -> None:
        self._placement = placement

    def _changed(self, name: str) -> bool:
        """Whether `name` differs from its default (a run's saved config.yaml sets every field)."""
        return getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)

    @field_validator("kind")
    @classmethod
    def _registered(cls, kind: str) -> str:
        from agentrl.engine import EngineNotFound, engine_entry_point

        try:
            engine_entry_point(kind)
        except EngineNotFound as e:  # a ValueError, for pydantic: the message names the known ones and a close match
            raise ValueError(str(e)) from None
        return kind

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.kind == "openai" and (self.base_url is None) == (not self.base_urls):
            raise ValueError(
                "engine.base_url is required with engine.kind=openai (one server), or engine.base_urls (several)"
            )
        if self.kind != "openai" and self.api_key_env is not None:
            raise ValueError(
                "engine.api_key_env is the key of the servers an openai engine calls: it needs kind=openai"
            )
        if self.kind != "openai" and (self.base_url is not None or self.base_urls):
            raise ValueError(
                "engine.base_url and engine.base_urls name OpenAI-compatible servers: they need engine.kind=openai"
            )
        if len(set(self.base_urls)) < len(self.base_urls):
            raise ValueError("engine.base_urls lists a server twice")
        if self.replicas is not None and self.kind == "openai":
            raise ValueError(
                "engine.replicas starts engines as Ray actors; an openai engine is a client of servers "
                "you start: list them in engine.base_urls"
            )
        if self.replicas is not None and self.kind not in ("hf", "vllm"):
            raise ValueError(f"engine.replicas runs hf or vllm engines as Ray actors, not {self.kind}")
        if self.threads_per_replica != 1 and not (self.kind == "hf" and self.replicas is not None):
            raise ValueError(
                "engine.threads_per_replica sets the torch threads of each hf replica: it needs "
                "engine.kind=hf and engine.replicas"
            )
        if self.ray_address is not None and self.replicas is None:
            raise ValueError("engine.ray_address is where engine replicas start: it needs engine.replicas")
        if self.replicas is not None and self.vllm.get("tensor_parallel_size", 1) != 1:
            raise ValueError("engine.replicas runs one vllm engine per GPU: drop engine.vllm.tensor_parallel_size")
        if self.served_model is not None and self.kind != "openai":
            raise ValueError("engine.served_model names a model on an openai server: it needs engine.kind=openai")
        if (self.server != "auto" or self.weights_dir is not None) and self.kind != "openai":
            raise ValueError(
                "engine.server and engine.weights_dir describe an openai engine's server: they need engine.kind=openai"
            )
        if self.weights_dir is not None and self.server == "agentrl":
            raise ValueError(
                "engine.weights_dir is where a vLLM server reads weights: agentrl serve takes them over HTTP"
            )
        if self.dtype == "bfloat16_weights" and self.kind != "hf":
            raise ValueError("engine.dtype=bfloat16_weights needs engine.kind=hf")
        if self.kind == "openai":  # the server decides these; an openai engine is only its client
            if self.dtype != "auto":
                raise ValueError(
                    "engine.dtype does nothing with engine.kind=openai: the server holds the weights in its own "
                    "dtype (agentrl serve --dtype, vllm serve --dtype); drop engine.dtype"
                )
            if self.max_batch_size is not None:
                raise ValueError(
                    "engine.max_batch_size does nothing with engine.kind=openai: the server batches the requests "
                    "(agentrl serve --max-batch-size, vllm serve --max-num-seqs); drop engine.max_batch_size"
                )
        if self.kind in ("vllm", "openai") and self._changed("prefix_cache_tokens"):
            raise ValueError(
                f"engine.prefix_cache_tokens sizes the hf engine's prefix cache: it does nothing with "
                f"engine.kind={self.kind} (vLLM and servers cache prefixes themselves); set engine.kind=hf, or drop "
                "engine.prefix_cache_tokens"
            )
        if self._changed("affinity_slack_tokens") and max(self.replicas or 0, len(self.base_urls)) < 2:
            raise ValueError(
                "engine.affinity_slack_tokens chooses between replicas: it does nothing without two or more; set "
                "engine.replicas >= 2 (or list engine.base_urls), or drop engine.affinity_slack_tokens"
            )
        if self.options and self.kind in BUILT_IN:
            raise ValueError(
                f"engine.options does nothing with engine.kind={self.kind}: it holds the settings of an engine "
                "from another package; set engine.kind to that engine, or drop engine.options"
            )
        if self.decode_window is not None and self.kind != "hf":
            raise ValueError(
                f"engine.decode_window sets the hf engine's decode loop: it does nothing with engine.kind={self.kind}"
                "; set engine.kind=hf, or drop engine.decode_window"
            )
        if self.cuda_graphs and self.kind != "hf":
            raise ValueError(
                f"engine.cuda_graphs captures the hf engine's decode steps: it does nothing with "
                f"engine.kind={self.kind}; set engine.kind=hf, or drop engine.cuda_graphs"
            )
        if self.record_routing and self.kind != "hf":
            raise ValueError("engine.record_routing needs engine.kind=hf (the engine that can return routing)")
        if self.vllm and self.kind != "vllm":
            raise ValueError("engine.vllm settings need engine.kind=vllm")
        if clash := sorted(VLLM_OWN & self.vllm.keys()):
            raise ValueError(
                f"engine.vllm: {clash} are set from the run (engine.dtype, engine.max_batch_size, seed, "
                "the model and its LoRA settings): set them there"
            )
        return self


@dataclass
class EngineModel:
    """What an engine serves."""

    path: str | None = None
    """a Hugging Face folder (or hub id): its config and tokenizer, and its weights unless `module` is given
    (an engine that loads its own weights needs it)"""
    module: nn.Module | None = None
    """live weights an in-process engine may sample with instead of loading a copy (the learner's own, in one
    process: the engine then declares `capabilities.shares_module`); engines that hold their own weights ignore it"""
    lora: LoraSettings | None = None
    """the adapters the policy trains: an engine holding its own copy gets the same ones, to take LoRA updates"""
    device: str = "cpu"
    """where an in-process engine puts a copy it loads"""


def is_loopback(host: str | None) -> bool:
    """Whether `host` (a name or an IP literal, without brackets or port) names this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:  # a DNS name: it may resolve anywhere
        return False
