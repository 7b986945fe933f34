"""The env-worker pool: the workers a rollout controller plays its episodes on, where they run, and who
replaces one that dies.

The controller owns no worker. It asks its pool for one (`EnvWorkerPool.pick`) and calls it through the
`EnvWorkerHandle` contract; a failed call raises `WorkerError`, whatever runs the worker. The pools:

- `RayEnvWorkerPool`: `rollout.num_workers` Ray actors (`agentrl.rollout.workers`) wherever Ray puts them
  (a local run: this machine);
- `PlacedEnvWorkerPool` (`cluster.envs` of a run on a Ray cluster): `workers_per_node` actors on every Docker
  node, prepared first (orphans removed, the sandbox image shipped where missing); a dead worker's
  replacement goes to a surviving Docker node (`agentrl.rollout.placement`);
- `LocalEnvWorkerPool` (`rollout.env_workers: local`): `rollout.num_workers` processes of the driver on this
  machine (`agentrl.rollout.local_workers`), no Ray runtime.

Every worker makes its sandboxes with the run's `SandboxConfig`, passed to it and read nowhere else.
`env_worker_pool(cfg, placement, sandbox)` chooses the pool, once.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import logging
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import ray
import ray.exceptions

from agentrl.cluster import EnvPlacement
from agentrl.env.base import Message
from agentrl.rollout import local_workers
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.placement import EnvPlacer, NodeWorkers, pinned
from agentrl.rollout.workers import RemoteEnvWorker
from agentrl.sandbox import ExecResult, SandboxConfig

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A call to an env worker failed: the env raised in it, or the worker could not be reached.

    An infrastructure failure, never a verdict on the episode: the controller retries the episode or
    masks it out. The message is the worker's error."""


class WorkerDied(WorkerError):
    """The worker is gone (its process or its node died), and every env it held with it. By the time a
    call raises this, its pool has replaced the worker: the next `pick` hands out a live one."""


class EnvWorkerHandle(abc.ABC):
    """One env worker, as its pool hands it out: environments by episode id, sharing one sandbox pool.

    Every method is a coroutine, and many run at once (one per episode). A call that fails raises
    `WorkerError` (`WorkerDied` when the worker died), never its backend's own exception.

    - `reset(episode_id, task_id, seed) -> (observation, info)` makes the episode's env and resets it on
      the task; `info["tools"]` are the tool schemas for the prompt.
    - `step(episode_id, text) -> (observation, reward, terminated, truncated, info)`; an episode that
      ended has its env closed.
    - `replay(episode_id, task_id, seed, actions) -> (observation, info, steps)` rebuilds an episode's env
      after a restart: reset as before, then each action stepped; `steps` holds each step's (observation,
      reward, terminated, truncated), for the caller to compare with its record.
    - `agent_run(episode_id, command) -> ExecResult`: a hosted agent program's command, in the episode's workspace
      (`TextEnv.agent_run`); `agent_grade(episode_id) -> (reward, info)` grades what it left there and closes
      the episode's env (`TextEnv.agent_grade`).
    - `close(episode_id)` releases the episode's env and its sandbox. An unknown id, or a worker that died
      (its envs went with it), is a no-op: it never raises `WorkerDied`.
    - `sample_tasks(n, seed) -> task ids` drawn from the env's task set, the same for the same seed.
    - `start_sandboxes()` fills the sandbox pool now, before the first episode needs a sandbox.
    """

    @abc.abstractmethod
    async def reset(self, episode_id: str, task_id: str, seed: int) -> tuple[list[Message], dict[str, Any]]: ...

    @abc.abstractmethod
    async def step(self, episode_id: str, text: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]: ...

    @abc.abstractmethod
    async def replay(
        self, episode_id: str, task_id: str, seed: int, actions: list[str]
    ) -> tuple[list[Message], dict[str, Any], list[tuple]]: ...

    @abc.abstractmethod
    async def agent_run(self, episode_id: str, command: str) -> ExecResult: ...

    @abc.abstractmethod
    async def agent_grade(self, episode_id: str) -> tuple[float | None, dict[str, Any]]: ...

    @abc.abstractmethod
    async def close(self, episode_id: str) -> None: ...

    @abc.abstractmethod
    async def sample_tasks(self, n: int, seed: int) -> list[str]: ...

    @abc.abstractmethod
    async def start_sandboxes(self) -> None: ...


class CallingEnvWorker(EnvWorkerHandle):
    """A worker in another process, every method one call of the same name there (`_call`): the Ray actor's and the
    local process's."""

    @abc.abstractmethod
    async def _call(self, method: str, *args: Any, dead_ok: bool = False) -> Any:
        """Call `method` in the worker; `dead_ok`: None instead of `WorkerDied` from a worker that is gone."""

    async def reset(self, episode_id: str, task_id: str, seed: int) -> tuple[list[Message], dict[str, Any]]:
        return await self._call("reset", episode_id, task_id, seed)

    async def step(self, episode_id: str, text: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        return await self._call("step", episode_id, text)

    async def replay(
        self, episode_id: str, task_id: str, seed: int, actions: list[str]
    ) -> tuple[list[Message], dict[str, Any], list[tuple]]:
        return await self._call("replay", episode_id, task_id, seed, actions)

    async def agent_run(self, episode_id: str, command: str) -> ExecResult:
        return await self._call("agent_run", episode_id, command)

    async def agent_grade(self, episode_id: str) -> tuple[float | None, dict[str, Any]]:
        return await self._call("agent_grade", episode_id)

    async def close(self, episode_id: str) -> None:
        # a dead worker's sandboxes are reaped by owner pid; its replacement is for its next call to start
        await self._call("close", episode_id, dead_ok=True)

    async def sample_tasks(self, n: int, seed: int) -> list[str]:
        return await self._call("sample_tasks", n, seed)

    async def start_sandboxes(self) -> None:
        await self._call("start_sandboxes")


class EnvWorkerPool(abc.ABC):
    """The env workers of one rollout controller. `start()` before the first `pick`; `close()` stops every
    worker and removes what they left (sandboxes), and is safe to call twice.

    Subclasses set `workers` and implement `start`, `close`, `describe_placement` and `_replace`; a pool
    that places workers on nodes also overrides `nodes` and `placement_metrics`."""

    def __init__(self) -> None:
        self.workers: list[EnvWorkerHandle] = []  # in slots: a replacement takes its dead worker's slot
        self._dead: set[EnvWorkerHandle] = set()  # known dead, replacement not placed yet: `pick` skips them
        self._next = 0
        self._background: set[asyncio.Task] = set()  # reaps of dead workers' sandboxes, referenced until done

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def describe_placement(self) -> str:
        """What to print at the start of a run: where the env workers are."""

    @abc.abstractmethod
    async def _replace(self, dead: EnvWorkerHandle) -> None:
        """A worker died: a fresh one takes its slot, and what it left is removed. Called by every call that
        finds the worker dead, before it raises `WorkerDied`; a worker replaced already is left as it is."""

    def nodes(self) -> list[NodeWorkers]:
        """Each node with live env workers (id, IP, workers, how its sandbox image got there); [] when the
        pool does not choose nodes."""
        return []

    def placement_metrics(self) -> dict[str, float]:
        """`rollout/nodes` (distinct nodes with env workers) and `rollout/env_workers`; {} when the pool does
        not choose nodes."""
        return {}

    def _in_background(self, work: Coroutine) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def pick(self) -> EnvWorkerHandle:
        """The worker for a new episode (or a replay), round robin; one known dead whose replacement is being
        placed is skipped."""
        for _ in range(len(self.workers)):
            w = self.workers[self._next % len(self.workers)]
            self._next += 1
            if w not in self._dead:
                return w
        return w

    async def sample_tasks(self, n: int, seed: int) -> list[str]:
        """n task ids from the first worker's env. A worker that died while idle (no episode of its own to
        notice) is replaced by this call, once: the fresh one answers, or the error is real."""
        try:
            return await self.workers[0].sample_tasks(n, seed)
        except WorkerDied:
            return await self.workers[0].sample_tasks(n, seed)


def _worker_args(cfg: RolloutConfig, sandbox: SandboxConfig) -> tuple:
    """An `EnvWorker`'s arguments. With partial rollouts every episode in flight may park on one worker holding a
    sandbox (round robin, retries and replacements can pile them up there): its pool must let that many live."""
    parkable = cfg.groups_in_flight * cfg.group_size if cfg.partial else 0
    return (cfg.env, cfg.env_kwargs, cfg.sandboxes_per_worker, cfg.sandbox_reuse, sandbox, parkable)


def _reap_orphans(sandbox: SandboxConfig) -> None:
    """Remove this host's sandboxes whose owner process died (a backend that fails now: left to its reaper)."""
    try:
        removed = sandbox.collect_orphans()
    except Exception as e:  # the backend's own error (its daemon gone, a cgroup busy), whichever backend
        log.warning("could not remove a dead env worker's sandboxes now (%s); `agentrl sandbox gc` will", e)
        return
    if removed:
        log.warning("removed %d sandbox(es) of a dead env worker", len(removed))


# -- env workers as Ray actors --------------------------------------------------------------

# A worker is dead when a call to it raises one of these (a worker pinned to a node that died before it
# started is unschedulable: a RayError, but no RayActorError).
_WORKER_DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError)


class RayEnvWorker(CallingEnvWorker):
    """An `agentrl.rollout.workers.EnvWorker` Ray actor (`actor`), pinned to `node_id` when placed."""

    def __init__(self, pool: RayEnvWorkerPool, actor: Any, node_id: str | None = None) -> None:
        self.actor = actor
        self.node_id = node_id
        self._pool = pool

    async def _call(self, method: str, *args: Any, dead_ok: bool = False) -> Any:
        try:
            return await getattr(self.actor, method).remote(*args)
        except _WORKER_DEAD as e:
            if dead_ok:
                return None
            await self._pool._replace(self)
            raise WorkerDied(str(e) or type(e).__name__) from e
        except ray.exceptions.RayError as e:
            raise WorkerError(str(e) or type(e).__name__) from e

    async def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the actor: its pools close its sandboxes; one that does not answer (its node died) is killed,
        and its watchdog removes them."""
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            await asyncio.wait_for(self.actor.shutdown.remote(), timeout_s)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)


class RayEnvWorkerPool(EnvWorkerPool):
    """`rollout.num_workers` env worker actors wherever Ray puts them. Starts a local Ray (or joins
    `rollout.ray_address`) unless one is running, and shuts down only the one it started."""

    def __init__(self, cfg: RolloutConfig, sandbox: SandboxConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.sandbox = sandbox
        self.workers: list[RayEnvWorker] = []
        self._started_ray = False
        self._replaced = 0

    async def start(self) -> None:
        self._init_ray()
        self.workers = [self._new_worker() for _ in range(self.cfg.num_workers)]

    def describe_placement(self) -> str:
        return f"env workers: {len(self.workers) or self.cfg.num_workers}, placed by Ray (no cluster placement)"

    def _init_ray(self) -> None:
        if not ray.is_initialized():
            ray.init(address=self.cfg.ray_address, include_dashboard=False, logging_level=logging.WARNING)
            self._started_ray = True

    def _shutdown_ray(self) -> None:
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def _new_worker(self, node_id: str | None = None) -> RayEnvWorker:
        cls = RemoteEnvWorker if node_id is None else RemoteEnvWorker.options(scheduling_strategy=pinned(node_id))
        actor = cls.remote(*_worker_args(self.cfg, self.sandbox))
        return RayEnvWorker(self, actor, node_id)

    async def _replace(self, dead: EnvWorkerHandle) -> None:
        """A fresh actor takes the dead one's slot, and the dead one's sandboxes (whose owner process is gone)
        are removed now rather than at the next start."""
        for i, w in enumerate(self.workers):
            if w is dead:
                log.warning("env worker %d died; starting a replacement", i)
                self.workers[i] = self._new_worker()
                self._replaced += 1
                self._in_background(asyncio.to_thread(_reap_orphans, self.sandbox))

    async def _stop_workers(self) -> None:
        workers, self.workers = self.workers, []
        await asyncio.gather(*(w.stop() for w in workers))

    async def close(self) -> None:
        """Stop the workers (their sandbox pools close) and the Ray this pool started."""
        await self._stop_workers()
        self._shutdown_ray()
        if self._replaced:
            # Reap again: the reap at a worker's death can run before its killed process is gone (its
            # containers still look owned), and that worker's sandboxes must not outlive the run.
            await asyncio.gather(*self._background, return_exceptions=True)
            await asyncio.to_thread(_reap_orphans, self.sandbox)


class PlacedEnvWorkerPool(RayEnvWorkerPool):
    """`placement.workers_per_node` env worker actors on every alive node of the Ray cluster advertising
    `placement.node_resource` (`rollout.num_workers` is not used), each on its node's Docker daemon."""

    def __init__(self, cfg: RolloutConfig, placement: EnvPlacement, sandbox: SandboxConfig) -> None:
        super().__init__(cfg, sandbox)
        self.placement = placement
        self._placer = EnvPlacer(placement, sandbox)
        self._replace_lock = asyncio.Lock()
        self._image = ""

    async def start(self) -> None:
        """Prepare every Docker node (orphans removed, the sandbox image there), then pin the workers."""
        from agentrl.sandbox.image import image_tag

        self._init_ray()
        self._image = image_tag() if self.sandbox.backend == "docker" else ""  # bwrap nodes need no image
        try:
            slots = await asyncio.to_thread(self._placer.start, self._image)
        except BaseException:
            self._shutdown_ray()  # refused (no Docker node, no image): leave no Ray behind
            raise
        self.workers = [self._new_worker(node) for node in slots]
        log.info("%s", self.describe_placement())

    def nodes(self) -> list[NodeWorkers]:
        return self._placer.summary([w.node_id for w in self.workers])

    def placement_metrics(self) -> dict[str, float]:
        return {"rollout/nodes": float(len(self.nodes())), "rollout/env_workers": float(len(self.workers))}

    def describe_placement(self) -> str:
        """One line per node."""
        nodes = self.nodes()
        p = self.placement
        sandboxes = f"sandbox image {self._image}" if self._image else f"{self.sandbox.backend} sandboxes"
        lines = [
            f"env workers: {len(self.workers)} on {len(nodes)} node(s) with the {self._placer.resource!r} resource "
            f"({p.workers_per_node} per node), {sandboxes}"
        ]
        lines += [f"  {n.ip}  node {n.node_id}: {n.workers} worker(s), image {n.image}" for n in nodes]
        return "\n".join(lines)

    async def _replace(self, dead: EnvWorkerHandle) -> None:
        """The replacement goes to the alive Docker node with the fewest workers. If the dead worker's node is
        gone, every worker of that node is replaced now (their episodes fail on their own); if it is alive, the
        dead worker's sandboxes are removed there. A node's death also kills its workers' sandboxes' owner
        processes without atexit: their watchdogs remove the containers."""
        if not any(w is dead for w in self.workers):
            return  # replaced already
        self._dead.add(dead)
        async with self._replace_lock:
            slots = [i for i, w in enumerate(self.workers) if w is dead]
            if not slots:
                return
            node = self.workers[slots[0]].node_id
            alive = await asyncio.to_thread(self._placer.alive)
            if node not in {x.node_id for x in alive}:  # the node is gone: so are its other workers
                slots = [i for i, w in enumerate(self.workers) if w.node_id == node]
                log.warning("env node %s is gone: replacing its %d worker(s) on the other nodes", node, len(slots))
            load = Counter(w.node_id for i, w in enumerate(self.workers) if i not in slots and w not in self._dead)
            targets = await asyncio.to_thread(self._placer.replacements, alive, load, len(slots), self._image)
            for i, target in zip(slots, targets, strict=True):
                old = self.workers[i]
                log.warning("env worker %d (node %s) died; starting a replacement on node %s", i, node, target)
                with contextlib.suppress(Exception):
                    ray.kill(old.actor)  # it may be alive but unreachable: its sandboxes must not stay
                self.workers[i] = self._new_worker(target)
                self._dead.discard(old)
                self._replaced += 1
            if node in {x.node_id for x in alive}:
                self._in_background(asyncio.to_thread(self._placer.reap, {node}))

    async def close(self) -> None:
        """Stop the workers, then remove orphaned sandboxes on every Docker node still alive."""
        await self._stop_workers()
        if self._placer.nodes:
            await asyncio.gather(*self._background, return_exceptions=True)
            try:
                removed = await asyncio.to_thread(self._placer.reap)
            except Exception as e:  # a node's daemon that fails now: its next start removes them
                log.warning("could not remove orphaned sandboxes on the env nodes: %s", e)
            else:
                if removed:
                    log.warning("removed %d orphaned sandbox(es) on the env nodes", removed)
        self._shutdown_ray()


# -- env workers as processes of the driver -------------------------------------------------


class _Gone(Exception):
    """The worker's line closed with the call unanswered."""


class LocalEnvWorker(CallingEnvWorker):
    """An `EnvWorker` in a process of the driver's (`agentrl.rollout.local_workers`), reached over a socket pair.

    Its process is spawned at once (a new interpreter: nothing of the driver's memory is inherited, no fork of a
    process with threads), and calls are sent before it is up: they wait in the socket until its loop reads them.
    When the line closes (the process died) every call in flight and every later one raises `WorkerDied`."""

    def __init__(self, pool: LocalEnvWorkerPool, args: tuple) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.gone: str | None = None
        """why the worker cannot be reached (None while it can)"""
        self._pool = pool
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.Task | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._started = asyncio.ensure_future(self._start(args))

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    async def _start(self, args: tuple) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                f"from {local_workers.__name__} import main; main()",
                str(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the driver alone, which parks its episodes first
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the child's alone now: its death closes the line
        reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        local_workers.write_frame(self._writer, args)
        self._reader = asyncio.ensure_future(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Hand each answer to its caller; at the end of the line, wait for the process (its sandboxes' owner must
        be gone before the pool removes them), then fail every call still waiting."""
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                call_id, ok, value = await local_workers.read_frame(reader)
                waiter = self._waiting.pop(call_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result((ok, value))
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:  # alive but its line broke: unreachable, so its sandboxes must not stay
            self.proc.kill()
            await self.proc.wait()
        code = self.proc.returncode
        self.gone = f"env worker process {self.proc.pid} " + (
            f"killed by signal {-code}" if code < 0 else f"exited ({code})"
        )
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(_Gone())
        self._waiting.clear()

    async def _call(self, method: str, *args: Any, dead_ok: bool = False) -> Any:
        try:
            await self._started
        except Exception as e:  # the process could not be spawned
            raise WorkerError(f"env worker process did not start: {e}") from e
        if self.gone is None:
            call_id = next(self._ids)
            waiter = self._waiting[call_id] = asyncio.get_running_loop().create_future()
            try:
                local_workers.write_frame(self._writer, (call_id, method, args))
                with contextlib.suppress(ConnectionError):  # the reader sees the line close and fails the waiter
                    await self._writer.drain()
                ok, value = await waiter
            except _Gone:
                pass
            else:
                if not ok:
                    raise WorkerError(value)
                return value
            finally:
                self._waiting.pop(call_id, None)
        if dead_ok:
            return None
        await self._pool._replace(self)
        raise WorkerDied(self.gone or "env worker process gone")

    async def stop(self, timeout_s: float = 60.0) -> None:
        """Close the line: the worker closes its envs and sandboxes and exits; one that does not in time is killed.
        Returns once its process is gone."""
        with contextlib.suppress(Exception):
            await self._started
        if self.proc is None:
            return
        if self._writer is not None:
            self._writer.close()
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            await self._reader


class LocalEnvWorkerPool(EnvWorkerPool):
    """`rollout.num_workers` env workers as processes of the driver on this machine (`rollout.env_workers: local`):
    no Ray runtime. A dead worker's replacement takes its slot at once, and its sandboxes are removed once its
    process is gone."""

    def __init__(self, cfg: RolloutConfig, sandbox: SandboxConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.sandbox = sandbox
        self.workers: list[LocalEnvWorker] = []
        self._closed = False

    async def start(self) -> None:
        self.workers = [self._new_worker() for _ in range(self.cfg.num_workers)]
        try:
            await asyncio.gather(*(w._started for w in self.workers))  # spawned; each then imports on its own
        except BaseException:
            await self.close()  # nothing half-started
            raise

    def describe_placement(self) -> str:
        return f"env workers: {len(self.workers) or self.cfg.num_workers}, processes of this one (no Ray)"

    def _new_worker(self) -> LocalEnvWorker:
        return LocalEnvWorker(self, _worker_args(self.cfg, self.sandbox))

    async def _replace(self, dead: EnvWorkerHandle) -> None:
        if self._closed:
            return
        for i, w in enumerate(self.workers):
            if w is dead:
                log.warning("env worker %d died (%s); starting a replacement", i, w.gone)
                self.workers[i] = self._new_worker()
                self._in_background(self._reap(w))

    async def _reap(self, dead: LocalEnvWorker) -> None:
        await dead.stop()  # its process is gone (no zombie): its sandboxes' owner reads as dead
        await asyncio.to_thread(_reap_orphans, self.sandbox)

    async def close(self) -> None:
        """Stop the workers (each closes its sandboxes), then wait for the reaps of dead ones."""
        self._closed = True
        workers, self.workers = self.workers, []
        await asyncio.gather(*(w.stop() for w in workers))
        await asyncio.gather(*self._background, return_exceptions=True)


def env_worker_pool(
    cfg: RolloutConfig, placement: EnvPlacement | None = None, sandbox: SandboxConfig | None = None
) -> EnvWorkerPool:
    """The pool for a rollout config: placed on the cluster's Docker nodes with `placement`; else processes of this
    one with `env_workers: local`, or wherever Ray puts them. Its workers make `sandbox`'s sandboxes (Docker's by
    default)."""
    sandbox = sandbox or SandboxConfig()
    if placement is not None:
        if cfg.env_workers == "local":
            raise ValueError("env_workers=local runs the env workers on this machine: a cluster placement needs ray")
        return PlacedEnvWorkerPool(cfg, placement, sandbox)
    return LocalEnvWorkerPool(cfg, sandbox) if cfg.env_workers == "local" else RayEnvWorkerPool(cfg, sandbox)
