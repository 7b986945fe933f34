"""The replicas of a fleet (`agentrl.engine.fleet`): one engine each, as the fleet drives it.

- `ActorReplica`: an hf or vllm engine in its own process, a Ray actor (`EngineReplica`) loading its own
  copy of the weights; weight updates reach it as object-store references (one `ray.put` for all).
- `ClientReplica`: an `OpenAIEngine` client of one server of `engine.base_urls`, in the caller's process.

The fleet sees one interface, `Replica`; whatever means the replica itself failed (its process died, its
server stopped answering) raises `ReplicaDown`, and the fleet moves the request elsewhere. An error of the
request (a context overflow, a bad update) is the engine's own and reaches the caller as it is.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import ray
import ray.exceptions
import torch

from agentrl.engine.base import Capabilities, Generation, InferenceEngine, SamplingParams
from agentrl.engine.config import EngineConfig, EngineModel

Tensors = Mapping[str, torch.Tensor]
# An actor's async methods run concurrently on its event loop (Ray's default allows 1000 at once); a replica
# holds every request routed to it, which can be more: its engine queues them.
MAX_CALLS = 1 << 20
EARLY_ABORTS = 1024  # aborts remembered for requests that have not reached the actor yet


class ReplicaDown(RuntimeError):
    """The replica itself failed (its process died, its server does not answer): the request may go elsewhere."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What a started replica reports."""

    capabilities: Capabilities
    max_context: int
    version: int
    pid: int | None
    """its process (an actor's), None for a client of a server"""
    node: str | None = None
    """its Ray node's id (an actor's), None for a client of a server"""


class Replica(ABC):
    """One engine of a fleet. `attempt` ids are the fleet's, fresh for every attempt at a request, so that a
    request resumed under its old id, or retried after its replica failed, never meets its earlier attempt."""

    @classmethod
    @abstractmethod
    def create(cls, cfg: EngineConfig, model: EngineModel, *, slot: int, seed: int) -> Replica:
        """The replica in place `slot` of the fleet `cfg` describes (not started)."""

    @staticmethod
    @abstractmethod
    def ship(tensors: Tensors | None) -> Any:
        """Tensors of a weight update as this kind of replica takes them (one copy for every replica)."""

    @abstractmethod
    async def start(self, version: int, full: Any, lora: Any) -> ReplicaInfo:
        """Start serving policy `version`: the loaded weights, then `full` (shipped) and `lora` installed."""

    @abstractmethod
    async def generate(self, prompt: list[int], params: SamplingParams, attempt: str) -> Generation: ...

    @abstractmethod
    async def abort(self, attempt: str) -> None: ...

    @abstractmethod
    async def update_weights(self, full: Any, lora: Any) -> int: ...

    @abstractmethod
    async def close(self) -> None: ...


class EngineReplica:
    """A Ray actor holding one engine of `cfg.kind` (hf or vllm) that loads its own weights from `model.path`.

    vllm replicas run the same actor on one GPU each (`num_gpus=1`); untested here (no GPU on CI machines)."""

    def __init__(self, cfg: EngineConfig, model: EngineModel, seed: int, threads: int | None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.cfg, self.model, self.seed = cfg, model, seed
        self.engine: InferenceEngine | None = None
        self.running: set[str] = set()
        self.early_aborts: deque[str] = deque(maxlen=EARLY_ABORTS)

    async def start(self, version: int, full: Tensors | None, lora: Tensors | None) -> ReplicaInfo:
        from agentrl.engine import engine_class

        updates: list[dict[str, Tensors]] = [{"state_dict": full}] if full is not None else []
        if lora is not None:
            updates.append({"lora": lora})
        # every update moves the version by one: built one version back per update, it lands on `version`
        engine = engine_class(self.cfg.kind).from_config(
            self.cfg, self.model, version=version - len(updates), seed=self.seed
        )
        await engine.start()
        for update in updates:
            await engine.update_weights(**update)
        assert engine.version == version, f"replica reached version {engine.version}, not {version}"
        self.engine = engine
        node = ray.get_runtime_context().get_node_id()
        return ReplicaInfo(engine.capabilities, engine.max_context, engine.version, os.getpid(), node)

    async def generate(self, prompt: list[int], params: SamplingParams, attempt: str) -> Generation:
        # Ray does not promise an async actor runs calls in the order they were sent: an abort may come first
        if attempt in self.early_aborts:
            return Generation([], [], [], "aborted", len(prompt))
        self.running.add(attempt)
        try:
            return await self.engine.generate(prompt, params, request_id=attempt)
        finally:
            self.running.discard(attempt)

    async def abort(self, attempt: str) -> None:
        if attempt in self.running:
            await self.engine.abort(attempt)
        else:
            self.early_aborts.append(attempt)

    async def update_weights(self, full: Tensors | None, lora: Tensors | None) -> int:
        return await self.engine.update_weights(full, lora=lora)


_RemoteReplica = ray.remote(max_restarts=0, max_concurrency=MAX_CALLS)(EngineReplica)


class ActorReplica(Replica):
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    @classmethod
    def create(cls, cfg: EngineConfig, model: EngineModel, *, slot: int, seed: int) -> ActorReplica:
        hf = cfg.kind == "hf"
        need = ActorReplica.resources(cfg.model_copy(update={"replicas": 1}))
        resources = {"num_cpus": need.pop("CPU"), "num_gpus": need.pop("GPU", 0), "resources": need}
        # the actor loads the weights from the path (never the caller's module); hf replicas run on CPU
        # (vllm places itself on the actor's GPU)
        model = replace(model, module=None, device="cpu")
        actor = _RemoteReplica.options(**resources).remote(cfg, model, seed, cfg.threads_per_replica if hf else None)
        return cls(actor)

    @staticmethod
    def resources(cfg: EngineConfig) -> dict[str, float]:
        """What the replicas of `cfg` reserve from Ray, all together: per replica its CPUs (hf: its threads), GPUs
        (vllm: one) and custom node resources, as `cfg.placement` (a run's cluster.inference) may say."""
        p, hf = cfg.placement, cfg.kind == "hf"
        cpus = p.cpus_per_replica if p.cpus_per_replica is not None else cfg.threads_per_replica if hf else 1
        gpus = p.gpus_per_replica if p.gpus_per_replica is not None else 0 if hf else 1
        one = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **p.resources}
        return {k: v * cfg.replicas for k, v in one.items()}

    @staticmethod
    def ship(tensors: Tensors | None) -> Any:
        # CPU tensors: a replica without a GPU must read them (a vllm replica moves them to its own)
        return None if tensors is None else ray.put({k: v.detach().cpu() for k, v in tensors.items()})

    async def _call(self, ref: ray.ObjectRef) -> Any:
        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            raise ReplicaDown(f"engine replica actor died: {e}") from e

    async def start(self, version: int, full: Any, lora: Any) -> ReplicaInfo:
        # references as arguments: Ray hands each actor the object, read from its node's object store
        return await self._call(self.actor.start.remote(version, full, lora))

    async def generate(self, prompt: list[int], params: SamplingParams, attempt: str) -> Generation:
        return await self._call(self.actor.generate.remote(prompt, params, attempt))

    async def abort(self, attempt: str) -> None:
        await self._call(self.actor.abort.remote(attempt))

    async def update_weights(self, full: Any, lora: Any) -> int:
        return await self._call(self.actor.update_weights.remote(full, lora))

    async def close(self) -> None:
        ray.kill(self.actor)


class ClientReplica(Replica):
    """A client of one server, which holds the weights. Started at a fleet's version, the client counts from it, one
    version back per update the fleet shipped, and installs those updates when the server is at that count: always a
    server that reports no version (vLLM: a new client must load the adapter its requests name), and agentrl serve
    just that far behind. A server at another version is refused by the fleet: restart it with the current weights."""

    def __init__(self, cfg: EngineConfig, model: EngineModel) -> None:
        self.cfg, self.model = cfg, model
        self.engine: InferenceEngine | None = None  # built by `start`, at the version it is given

    @classmethod
    def create(cls, cfg: EngineConfig, model: EngineModel, *, slot: int, seed: int) -> ClientReplica:
        return cls(server_configs(cfg)[slot], model)

    @staticmethod
    def ship(tensors: Tensors | None) -> Any:
        return tensors

    async def _call(self, call: Any) -> Any:
        from agentrl.engine.openai import ServerUnavailable

        try:
            return await call
        except ServerUnavailable as e:
            raise ReplicaDown(str(e)) from e

    async def start(self, version: int, full: Any, lora: Any) -> ReplicaInfo:
        from agentrl.engine.openai import OpenAIEngine

        updates: list[dict[str, Tensors]] = [{"state_dict": full}] if full is not None else []
        if lora is not None:
            updates.append({"lora": lora})
        # as an actor's engine: one version back per update; agentrl serve replaces it with its own
        behind = version - len(updates)
        self.engine = OpenAIEngine.from_config(self.cfg, self.model, version=behind)
        await self._call(self.engine.start())
        if self.engine.version == behind:
            for update in updates:
                await self._call(self.engine.update_weights(**update))
        return ReplicaInfo(self.engine.capabilities, self.engine.max_context, self.engine.version, None)

    async def generate(self, prompt: list[int], params: SamplingParams, attempt: str) -> Generation:
        return await self._call(self.engine.generate(prompt, params, request_id=attempt))

    async def abort(self, attempt: str) -> None:
        await self.engine.abort(attempt)

    async def update_weights(self, full: Any, lora: Any) -> int:
        return await self._call(self.engine.update_weights(full, lora=lora))

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()


def replica_class(cfg: EngineConfig) -> type[Replica]:
    return ClientReplica if cfg.base_urls else ActorReplica


def server_configs(cfg: EngineConfig) -> list[EngineConfig]:
    """The one-server openai config of each of `cfg.base_urls`."""
    return [cfg.model_copy(update={"base_url": url, "base_urls": []}) for url in cfg.base_urls]
