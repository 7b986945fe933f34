"""One engine over R replicas: it routes requests, broadcasts weight updates and restarts a replica that dies.

`engine.replicas: R` (hf on CPU, vllm one per GPU, each a Ray actor with its own copy of the weights) or
`engine.base_urls` (one OpenAI-compatible server each) makes `build_engine` return a `Fleet`; its callers see
one `InferenceEngine` (`agentrl.engine.replica` holds the replicas).

Routing. A replica's outstanding work is the prompt + max_tokens of its requests in flight. A request goes to
the least-loaded replica, except that a request id routed before goes back to the replica that served it (the
rollout controller's request ids are episode ids: an episode's next turn, or a parked episode resuming, finds
its prefix in that replica's cache) unless that replica is overloaded, its work exceeding the least-loaded
one's by more than `engine.affinity_slack_tokens`.

Weights. `update_weights` ships the tensors once (one `ray.put`: every actor reads the same object) and every
replica installs them between two of its decode steps, converting to its own dtype; requests in flight go on,
their later tokens carrying the new version. Every replica must report the same new version.

Failures. A request whose replica dies starts again from its prompt on another replica: its caller gets a
`Generation` as from an undisturbed engine. The fleet starts a new replica in the dead one's place with the
current weights (the last full state dict and LoRA adapter shipped, kept in the object store) at the current
version; a weight update waits for a restart in progress, so that no restarted replica misses one. When no
replica is up and none is restarting, requests raise `FleetDown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import ray
import torch

from agentrl.engine.base import Capabilities, Generation, InferenceEngine, SamplingParams
from agentrl.engine.config import EngineConfig, EngineModel
from agentrl.engine.replica import ActorReplica, Replica, ReplicaDown, replica_class, server_configs

log = logging.getLogger(__name__)

AFFINITY_ENTRIES = 1 << 16
"""request ids remembered for affinity; the least recently routed are forgotten (an episode long finished)"""
FREE_WAIT_S = 30.0
"""how long a fleet waits at start for Ray to have its replicas' resources free"""


class FleetDown(RuntimeError):
    """No replica is up and none is coming back."""


@dataclass(frozen=True)
class ReplicaStats:
    requests: int
    """requests it answered (over its restarts)"""
    generated_tokens: int
    in_flight: int
    version: int | None
    """its policy version; None while it is down"""
    restarts: int
    pid: int | None
    """its process (an actor's); None for a server's client"""
    node: str | None = None
    """its Ray node's id (an actor's); None for a server's client"""


@dataclass(frozen=True)
class FleetStats:
    """Counts since the fleet started (`Fleet.fleet_stats()`)."""

    replicas: tuple[ReplicaStats, ...]
    affinity_hits: int
    """requests whose id was routed before that went back to the replica that served it"""
    affinity_misses: int
    """requests whose id was routed before that went elsewhere: that replica was overloaded or down"""
    retried: int
    """requests started again on another replica after theirs went down"""

    @property
    def affinity_hit_rate(self) -> float | None:
        n = self.affinity_hits + self.affinity_misses
        return self.affinity_hits / n if n else None

    def metrics(self) -> dict[str, float]:
        """Flat, for a metrics log: fleet/affinity_hit_rate (once a request came back), fleet/retried,
        fleet/restarts, and per replica i fleet/replica{i}/requests and fleet/replica{i}/generated_tokens."""
        restarts = sum(r.restarts for r in self.replicas)
        out: dict[str, float] = {"fleet/retried": self.retried, "fleet/restarts": restarts}
        if (rate := self.affinity_hit_rate) is not None:
            out["fleet/affinity_hit_rate"] = rate
        for i, r in enumerate(self.replicas):
            out[f"fleet/replica{i}/requests"] = r.requests
            out[f"fleet/replica{i}/generated_tokens"] = r.generated_tokens
        return out


@dataclass(eq=False)
class _Slot:
    """A place in the fleet and the replica in it now (a restart puts a new one there)."""

    index: int
    replica: Replica
    version: int | None = None
    """None: down (dead, or restarting)"""
    pid: int | None = None
    node: str | None = None
    work: int = 0
    """prompt + max_tokens of its requests in flight"""
    in_flight: int = 0
    requests: int = 0
    generated_tokens: int = 0
    restarts: int = 0
    restart: asyncio.Task[None] | None = None
    error: BaseException | None = None
    """why its last restart failed"""

    @property
    def up(self) -> bool:
        return self.version is not None


@dataclass(eq=False)
class _Flight:
    """A request of the caller, over its attempts."""

    replica: Replica | None = None
    attempt: str = ""
    aborted: bool = False


class Fleet(InferenceEngine):
    name = "fleet"
    logprob_semantics = "its replicas' engine's: agentrl.engine.sampling's for hf and vllm, the servers' for openai"

    def __init__(self, cfg: EngineConfig, model: EngineModel, *, version: int = 0, seed: int = 0) -> None:
        if not cfg.base_urls and model.path is None:
            raise ValueError("engine.replicas: every replica loads its own copy of the weights, from EngineModel.path")
        self.cfg, self.model = cfg, model
        self._kind = replica_class(cfg)
        self._version = version
        self._seed = seed
        self._made = 0  # replicas created, restarts included: each gets its own seed
        self._slots: list[_Slot] = []
        self._flights: dict[str, _Flight] = {}
        self._affinity: OrderedDict[str, Replica] = OrderedDict()  # request id -> the replica that served it last
        self._hits = self._misses = self._retried = 0
        self._full: Any = None  # the last weights shipped: a restarted replica installs them
        self._lora: Any = None
        self._weights = asyncio.Lock()  # an update and a restart never overlap
        self._starting = asyncio.Lock()
        self._capabilities: Capabilities | None = None
        self._max_context: int | None = None
        self._started_ray = False
        self._closed = False
        self._background: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, cfg: EngineConfig, model: EngineModel, *, version: int = 0, seed: int = 0) -> Fleet:
        return cls(cfg, model, version=version, seed=seed)

    @classmethod
    def unavailable(cls, cfg: EngineConfig) -> str | None:
        """A server of base_urls that does not answer; replicas on this machine (no ray_address): what stops
        their engine here. A cluster's nodes are not checked from here."""
        from agentrl.engine import engine_class

        if cfg.base_urls:
            openai = engine_class("openai")
            return next((why for one in server_configs(cfg) if (why := openai.unavailable(one))), None)
        return None if cfg.ray_address else engine_class(cfg.kind).unavailable(cfg)

    # -- state -----------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        if self._max_context is None:
            raise RuntimeError("the fleet's context length is known once it has started: `await fleet.start()`")
        return self._max_context

    @property
    def capabilities(self) -> Capabilities:
        """The replicas' (all the same), but never shared or pausable: every replica holds its own weights."""
        if self._capabilities is None:
            raise RuntimeError("the fleet's capabilities are known once it has started: `await fleet.start()`")
        return self._capabilities

    def metrics(self) -> dict[str, float]:
        return self.fleet_stats().metrics()

    def nodes(self) -> list[str]:
        return [s.node for s in self._slots if s.node is not None]

    def fleet_stats(self) -> FleetStats:
        """Requests and generated tokens per replica, the affinity hit rate, retries and restarts."""
        replicas = tuple(
            ReplicaStats(s.requests, s.generated_tokens, s.in_flight, s.version, s.restarts, s.pid, s.node)
            for s in self._slots
        )
        return FleetStats(replicas, self._hits, self._misses, self._retried)

    # -- start and close -------------------------------------------------------------

    async def start(self) -> None:
        async with self._starting:
            if self._closed:
                raise RuntimeError("engine is closed")
            if self._slots:
                return
            if self._kind is ActorReplica:
                await self._init_ray()
            n = len(self.cfg.base_urls) or self.cfg.replicas
            slots = [_Slot(i, self._new_replica(i)) for i in range(n)]
            try:
                infos = await asyncio.gather(*(s.replica.start(self._version, None, None) for s in slots))
                if len(caps := {i.capabilities for i in infos}) > 1:
                    raise ValueError(f"the replicas declare different capabilities: {caps}")
                if len(versions := {i.version for i in infos}) > 1:  # servers keep their own
                    raise ValueError(f"the replicas report different policy versions: {sorted(versions)}")
            except BaseException:
                await asyncio.gather(*(s.replica.close() for s in slots), return_exceptions=True)
                self._shutdown_ray()
                raise
            for slot, info in zip(slots, infos, strict=True):
                slot.version, slot.pid, slot.node = info.version, info.pid, info.node
            self._version = versions.pop()
            self._capabilities = replace(caps.pop(), shares_module=False, pausable=False)
            self._max_context = min(i.max_context for i in infos)
            self._slots = slots

    async def _init_ray(self) -> None:
        if not ray.is_initialized():
            ray.init(address=self.cfg.ray_address, include_dashboard=False, logging_level=logging.WARNING)
            self._started_ray = True
        # what is free (a run's learner ranks already hold theirs): a replica that cannot fit would wait forever.
        # What an actor just killed held comes back within moments: wait that long before refusing.
        need, deadline = ActorReplica.resources(self.cfg), time.monotonic() + FREE_WAIT_S
        while short := self._short_of(need):
            if time.monotonic() > deadline:
                self._shutdown_ray()
                raise ValueError(
                    f"engine.replicas={self.cfg.replicas} reserve {need} from Ray and the cluster has "
                    f"{short} free: lower engine.replicas (or threads_per_replica), or add "
                    "nodes"
                )
            await asyncio.sleep(0.5)

    @staticmethod
    def _short_of(need: dict[str, float]) -> dict[str, float]:
        """The resources of `need` that Ray has less of free than needed (what it has of each)."""
        have = ray.available_resources()
        return {k: have.get(k, 0) for k, v in need.items() if have.get(k, 0) < v}

    def _shutdown_ray(self) -> None:
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def _new_replica(self, slot: int) -> Replica:
        seed = int(np.random.SeedSequence([self._seed, self._made]).generate_state(1)[0])
        self._made += 1
        return self._kind.create(self.cfg, self.model, slot=slot, seed=seed)

    async def close(self) -> None:
        self._closed = True
        tasks = [s.restart for s in self._slots if s.restart is not None] + list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.replica.close() for s in self._slots), return_exceptions=True)
        self._slots = []
        self._shutdown_ray()

    # -- requests --------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None
    ) -> Generation:
        await self.start()
        self.check_fits(len(prompt_ids), params)
        rid = request_id or uuid.uuid4().hex
        if rid in self._flights:
            raise ValueError(f"request id {rid!r} is already in flight")
        prompt, work = list(prompt_ids), len(prompt_ids) + params.max_tokens
        flight = self._flights[rid] = _Flight()
        try:
            for attempt in range(len(self._slots) + 1):
                slot = await self._route(request_id, count=attempt == 0)
                if flight.aborted:  # while its replica went down, or while it waited for a restart
                    return Generation([], [], [], "aborted", len(prompt))
                if request_id is not None:
                    self._remember(request_id, slot.replica)
                flight.replica, flight.attempt = slot.replica, uuid.uuid4().hex
                slot.work += work
                slot.in_flight += 1
                try:
                    gen = await flight.replica.generate(prompt, params, flight.attempt)
                except ReplicaDown as e:
                    self._down(slot, flight.replica, e)
                    self._retried += 1
                    continue
                except asyncio.CancelledError:  # the replica would go on generating for nobody
                    self._spawn(self._abort_attempt(flight))
                    raise
                finally:
                    slot.work -= work
                    slot.in_flight -= 1
                slot.requests += 1
                slot.generated_tokens += len(gen.token_ids)
                return gen
            raise FleetDown(f"request {rid}: {len(self._slots) + 1} replicas in a row went down under it")
        finally:
            del self._flights[rid]

    async def _route(self, request_id: str | None, *, count: bool) -> _Slot:
        """The replica for this request: least outstanding work, or the one that served `request_id` last
        unless it is overloaded. `count`: the choice counts in the affinity hit rate."""
        while not (up := [s for s in self._slots if s.up]):
            if self._closed:
                raise RuntimeError("engine is closed")
            restarting = [s.restart for s in self._slots if s.restart is not None]
            if not restarting:
                errors = "; ".join(f"replica {s.index}: {s.error}" for s in self._slots)
                raise FleetDown(f"every engine replica is down and none could be restarted ({errors})")
            await asyncio.wait(restarting, return_when=asyncio.FIRST_COMPLETED)
        least = min(up, key=lambda s: (s.work, s.index))
        last = self._affinity.get(request_id) if request_id is not None else None
        if last is None:
            return least
        home = next((s for s in up if s.replica is last), None)
        stay = home is not None and home.work - least.work <= self.cfg.affinity_slack_tokens
        if count:
            self._hits += stay
            self._misses += not stay
        return home if stay else least

    def _remember(self, request_id: str, replica: Replica) -> None:
        self._affinity[request_id] = replica
        self._affinity.move_to_end(request_id)
        if len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)

    async def abort(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.aborted = True
            await self._abort_attempt(flight)

    async def _abort_attempt(self, flight: _Flight) -> None:
        if flight.replica is not None:
            with contextlib.suppress(ReplicaDown):  # its request restarts elsewhere, and sees `aborted` first
                await flight.replica.abort(flight.attempt)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- weights ---------------------------------------------------------------------

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None = None, *, lora: Mapping[str, torch.Tensor] | None = None
    ) -> int:
        if state_dict is not None and lora is not None:
            raise ValueError("pass either a full state_dict or a LoRA adapter, not both")
        await self.start()
        async with self._weights:
            # one copy for every replica (a ray.put: off the event loop, the rollouts go on meanwhile)
            full, adapter = await asyncio.gather(*(asyncio.to_thread(self._kind.ship, t) for t in (state_dict, lora)))
            up = [s for s in self._slots if s.up]
            if not up and not any(s.restart is not None for s in self._slots):
                raise FleetDown("every engine replica is down and none could be restarted: no weights can land")
            new = self._version + 1
            results = await asyncio.gather(
                *(s.replica.update_weights(full, adapter) for s in up), return_exceptions=True
            )
            errors: list[BaseException] = []
            for slot, result in zip(up, results, strict=True):
                if not slot.up:  # a request found it dead meanwhile: its restart, waiting for this lock, installs them
                    continue
                if isinstance(result, ReplicaDown):  # its restart, waiting for this lock, installs the new weights
                    self._down(slot, slot.replica, result)
                elif isinstance(result, BaseException):
                    errors.append(result)
                elif result != new:
                    errors.append(
                        RuntimeError(
                            f"engine replica {slot.index} reports policy version {result} after "
                            f"the update; the fleet expects {new}"
                        )
                    )
                else:
                    slot.version = result
            if errors:
                raise errors[0]
            self._version = new
            if full is not None:  # a full state dict holds the adapters too
                self._full, self._lora = full, None
            if adapter is not None:
                self._lora = adapter
            return new

    # -- failures --------------------------------------------------------------------

    def _down(self, slot: _Slot, replica: Replica, error: ReplicaDown) -> None:
        """`replica` (in `slot`) failed: restart it, once however many of its requests report it."""
        if slot.replica is not replica or not slot.up or self._closed:
            return
        log.warning("engine replica %d is down (%s): starting a new one", slot.index, error)
        slot.version = None
        slot.restart = asyncio.ensure_future(self._restart(slot))

    async def _restart(self, slot: _Slot) -> None:
        with contextlib.suppress(Exception):  # an actor already dead
            await slot.replica.close()
        try:
            async with self._weights:
                replica = self._new_replica(slot.index)
                try:
                    info = await replica.start(self._version, self._full, self._lora)
                    if info.version != self._version:  # a server restarted without the current weights
                        raise ReplicaDown(f"it reports policy version {info.version}; the fleet is at {self._version}")
                except BaseException:
                    await replica.close()
                    raise
                slot.replica, slot.version, slot.pid, slot.node = replica, info.version, info.pid, info.node
                slot.restarts += 1
            log.warning("engine replica %d is back, at policy version %d", slot.index, info.version)
        except Exception as e:
            slot.error = e
            log.error("engine replica %d could not be restarted: %s", slot.index, e)
        finally:
            slot.restart = None
