"""Env workers: processes that own environments and, through them, a sandbox pool.

`EnvWorker` runs as a Ray actor (`RemoteEnvWorker`: with a local `ray.init()` and on a cluster), or in a process
of the driver's without Ray (`agentrl.rollout.local_workers`). One worker runs many episodes at once on its own
event loop; its envs share one warm `SandboxPool` of the run's sandbox backend (`SandboxConfig`), for Docker on the
daemon of the worker's own node (DOCKER_HOST as the node's raylet was started with). Where workers go on a
cluster: `agentrl.rollout.placement`.

A worker can die without running atexit (SIGKILL, or its raylet killed: Ray's workers then exit at once): before
its first sandbox it starts the backend's watchdog (`SandboxConfig.watch`: Docker's removes its containers from
its node's daemon once it is gone).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from agentrl.env.base import Message, TextEnv
from agentrl.env.sandboxes import SandboxSource
from agentrl.sandbox import ExecResult, SandboxConfig, reaper

log = logging.getLogger(__name__)


def env_name(name: str) -> str:
    """An env's registered name; Gymnasium's "module:name" imports the module first (importing it registers it)."""
    module, _, name = name.rpartition(":")
    if module:
        importlib.import_module(module)
    return name


def make_env(name: str, env_kwargs: dict[str, Any], **kw: Any) -> TextEnv:
    """`agentrl.make`, also for Gymnasium's "module:name"."""
    import agentrl

    return agentrl.make(env_name(name), **env_kwargs, **kw)


def task_ids(name: str, env_kwargs: dict[str, Any], n: int | None = None) -> list[str]:
    """The first n task ids of an env's task set (its split), read in this process: no sandbox starts."""
    return [t.id for t in itertools.islice(make_env(name, env_kwargs).task_set, n)]


@dataclass(frozen=True)
class WorkerPlace:
    """An env worker's place (`EnvWorker.where`)."""

    node_id: str
    pid: int
    session: str
    """its sandboxes' session label"""
    watchdog: int | None
    """the pid of the watchdog that removes its containers once it is gone (None: not started yet, or a backend
    whose sandboxes die with it)"""
    docker_host: str | None
    """its Docker daemon (None: the default socket)"""


class EnvWorker:
    """Holds `episode_id -> env`. Every method is a coroutine, and many run at once (one per episode)."""

    def __init__(
        self,
        env: str,
        env_kwargs: dict[str, Any],
        sandboxes: int,
        reuse: int = 0,
        sandbox: SandboxConfig | None = None,
        parkable: int = 0,
    ) -> None:
        self.env_name = env
        self.env_kwargs = env_kwargs
        self.pool_size = sandboxes
        self.reuse = reuse
        self.sandbox = sandbox or SandboxConfig()
        self.source: SandboxSource | None = None
        self.envs: dict[str, TextEnv] = {}
        self.sampler: TextEnv | None = None  # an env never reset: only its task set is used
        self.watchdog: int | None = None
        self.parkable = parkable
        """episodes that may stay parked with their sandbox between iterations (partial rollouts; 0: none)"""

    def _make(self) -> TextEnv:
        if self.source is None:  # created on the worker's own event loop; warm until shutdown
            try:
                self.watchdog = self.sandbox.watch()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # a safety net: run without it
                log.warning(
                    "env worker %d: no sandbox watchdog (%s); a crash leaves its sandboxes to the reaper",
                    os.getpid(),
                    e,
                )
            # A parked episode keeps its sandbox until the next iteration: were the pool's cap on live sandboxes
            # (2 x its size, with reuse) below the episodes that may park, an env call still running when the
            # iteration stops would wait forever for a sandbox that only a parked episode could give back.
            self.source = SandboxSource(
                size=self.pool_size,
                keep_open=True,
                reuse=self.reuse,
                max_size=max(2 * self.pool_size, self.parkable),
                sandbox=self.sandbox,
            )
        return make_env(self.env_name, self.env_kwargs, sandboxes=self.source)

    async def start_sandboxes(self) -> None:
        """Fill the sandbox pool now, before the first episode needs one."""
        if self.sampler is None:
            self.sampler = self._make()
        await self.source.start()

    async def sample_tasks(self, n: int, seed: int) -> list[str]:
        """n task ids drawn from the env's task set (its train split by default), reproducibly."""
        if self.sampler is None:
            self.sampler = self._make()
        rng = np.random.default_rng(seed)
        return [self.sampler.task_set.sample(rng).id for _ in range(n)]

    async def reset(self, episode_id: str, task_id: str, seed: int) -> tuple[list[Message], dict[str, Any]]:
        env = self.envs.get(episode_id) or self._make()
        self.envs[episode_id] = env
        obs, info = await env.areset(seed=seed, options={"task_id": task_id})
        return obs, dict(info)

    async def replay(
        self, episode_id: str, task_id: str, seed: int, actions: list[str]
    ) -> tuple[list[Message], dict[str, Any], list[tuple]]:
        """Rebuild an episode's env after a restart: reset as before, then step the same messages.

        Returns the opening messages, the reset info and every step's (observation, reward,
        terminated, truncated, info), for the caller to compare with what it recorded."""
        obs, info = await self.reset(episode_id, task_id, seed)
        steps = []
        for text in actions:
            o, r, terminated, truncated, step_info = await self.envs[episode_id].astep(text)
            steps.append((o, float(r), terminated, truncated, dict(step_info)))
            if terminated or truncated:
                await self.close(episode_id)
                break
        return obs, info, steps

    async def step(self, episode_id: str, text: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = await self.envs[episode_id].astep(text)
        if terminated or truncated:
            await self.close(episode_id)
        return obs, float(reward), terminated, truncated, dict(info)

    async def agent_run(self, episode_id: str, command: str) -> ExecResult:
        return await self.envs[episode_id].agent_run(command)

    async def agent_grade(self, episode_id: str) -> tuple[float | None, dict[str, Any]]:
        try:
            return await self.envs[episode_id].agent_grade()
        finally:
            await self.close(episode_id)

    async def close(self, episode_id: str) -> None:
        env = self.envs.pop(episode_id, None)
        if env is not None:
            await env.aclose()

    async def shutdown(self) -> None:
        for eid in list(self.envs):
            await self.close(eid)
        if self.sampler is not None:
            await self.sampler.aclose()
        if self.source is not None:
            await self.source.close()

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> WorkerPlace:
        """Where this worker runs and what it left behind if it dies."""
        return WorkerPlace(
            ray.get_runtime_context().get_node_id(),
            os.getpid(),
            reaper.SESSION_ID,
            self.watchdog,
            os.environ.get("DOCKER_HOST"),
        )


# Actors cost no CPU reservation: they wait on sandboxes, and the machine's cores belong to
# the engine and the trainer (nor any of the Docker node resource: `placement.py` says why).
# Concurrency is unbounded in effect (Ray's default for an async actor is 1000 calls): a step
# can wait for a sandbox, and once the waiters fill every slot, the calls of the episodes
# holding the sandboxes (their next step, their close) could never run.
MAX_CALLS = 1 << 20
RemoteEnvWorker = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=MAX_CALLS)(EnvWorker)
