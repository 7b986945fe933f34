"""Demonstrations: a scripted expert's episodes played through the real environment, as chat JSONL.

Each episode is reset on a task, the env's `demonstration(task, rng)` messages are stepped
in order, and what the agent would have read comes back as the env really wrote it (tool
results, test reports). An episode is kept only if the env terminated it without a
failure and it earned at least `min_return`, so a wrong reference solution never becomes
training data. One JSONL line per episode: `{"messages": [...], "tools": [...], ...}`, the
shape `agentrl sft` reads.

The expert's code is trusted, so sandboxes are reused across episodes (one episode at a
time each) instead of a fresh container per episode as training does.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from pydantic import BaseModel

from agentrl.env.base import FailureClass, TextEnv
from agentrl.sandbox import Sandbox, SandboxConfig
from agentrl.sandbox.config import Backend
from agentrl.tasks.solutions import PERFECT, Expert


class Mistake(str):
    """An action a demonstration takes as an error to recover from: stepped like any other, and written with
    `"weight": 0`, so fine-tuning conditions on it but never trains toward it."""


class Demonstration(BaseModel):
    task_id: str
    messages: list[dict[str, str | int]]
    """opening messages, then assistant messages each followed by the env's reply (the last reply left out)"""
    tools: list[dict[str, Any]] | None = None
    episode_return: float


class TrustedSandboxes:
    """A fixed set of long-lived sandboxes, each lent to one episode at a time and taken back as is.

    Only for trusted code (an expert's reference solutions): training hands every episode a
    fresh sandbox instead (`SandboxSource`).
    """

    def __init__(self, size: int, config: SandboxConfig | None = None) -> None:
        self.size = size
        self.config = config or SandboxConfig()
        """the backend of these sandboxes, and of those an env makes itself (`SandboxSource.config`)"""
        self._free: asyncio.Queue[Sandbox] = asyncio.Queue()
        self._spare: asyncio.Queue[Sandbox] = asyncio.Queue()  # lent by `fresh`
        self._all: list[Sandbox] = []
        self._create = self.config.factory()

    async def start(self) -> None:
        self._all = list(await asyncio.gather(*(self._create() for _ in range(self.size))))
        for sb in self._all:
            self._free.put_nowait(sb)

    async def acquire(self, env: TextEnv) -> Sandbox:
        return await self._free.get()

    async def release(self, sandbox: Sandbox) -> None:
        await sandbox.reset_session()
        self._free.put_nowait(sandbox)

    async def fresh(self) -> Sandbox:
        """A sandbox for one use beside the episode's own (`SandboxSource.fresh`): trusted code needs no new one, so
        one of a second set is lent, started on first need."""
        if self._spare.empty():
            self._all.append(await self._create())
            return self._all[-1]
        return self._spare.get_nowait()

    async def done(self, sandbox: Sandbox) -> None:
        await sandbox.reset_session()
        self._spare.put_nowait(sandbox)

    async def detach(self, env: TextEnv) -> None:
        pass

    async def close(self) -> None:
        await asyncio.gather(*(sb.close() for sb in self._all))


async def play(env: TextEnv, task_id: str, actions: list[str]) -> Demonstration | None:
    """Reset on the task and step through `actions`; None unless the env ends the episode cleanly."""
    obs, info = await env.areset(options={"task_id": task_id})
    messages, total = list(obs), 0.0
    for action in actions:
        message: dict[str, str | int] = {"role": "assistant", "content": str(action)}
        messages.append(message | {"weight": 0} if isinstance(action, Mistake) else message)
        obs, reward, terminated, truncated, step_info = await env.astep(action)
        total += reward
        if step_info["failure"] is not FailureClass.OK or truncated:
            return None
        if terminated:
            return Demonstration(task_id=task_id, messages=messages, tools=info["tools"] or None, episode_return=total)
        messages += obs
    return None  # the expert stopped before the env ended the episode


async def record(
    env_name: str,
    n: int,
    *,
    env_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    concurrency: int = 4,
    expert: Expert = PERFECT,
    min_return: float | None = 1.0,
    holdout: float = 0.0,
    holdout_seed: int = 1,
    backend: Backend = "docker",
) -> AsyncIterator[Demonstration]:
    """n demonstrations on tasks drawn from the env's task set (its train split by default).

    `holdout` > 0 leaves that share of the set out, by the set's own seeded split (for
    generated tasks: by statement), so a policy fine-tuned on the demonstrations meets, when
    RL trains on the whole split, statements it has never seen, as its evaluation does.

    Tasks are drawn with a generator seeded by `seed`; episodes that fail the checks above
    are replaced by new draws (after 10·n draws in all it gives up with an error). An
    imperfect `expert` (`TextEnv.demonstration`) writes wrong episodes too: to keep them, pass
    `min_return=None`. `backend`: the sandboxes' (`SandboxConfig.backend`).
    """
    import agentrl

    sandboxes = TrustedSandboxes(concurrency, SandboxConfig(backend=backend))
    await sandboxes.start()
    envs = [agentrl.make(env_name, sandboxes=sandboxes, **(env_kwargs or {})) for _ in range(concurrency)]
    tasks = envs[0].task_set
    if holdout:
        tasks = tasks.split("train", seed=holdout_seed, test_fraction=holdout)
    rng = np.random.default_rng(seed)
    expert_rng = random.Random(seed)
    draws = 0

    async def one(env: TextEnv) -> Demonstration | None:
        nonlocal draws
        draws += 1
        task = tasks.sample(rng)
        return await play(env, task.id, env.demonstration(task, expert_rng, expert=expert))

    try:
        made = 0
        pending = {asyncio.ensure_future(one(env)): env for env in envs[: min(concurrency, n)]}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                env = pending.pop(fut)
                demo = fut.result()
                good = demo is not None and (min_return is None or demo.episode_return >= min_return)
                if good and made < n:
                    made += 1
                    yield demo
                if made + len(pending) < n:
                    if draws >= 10 * n:
                        raise RuntimeError(f"only {made} of {n} demonstrations passed in {draws} episodes")
                    pending[asyncio.ensure_future(one(env))] = env
    finally:
        for fut in pending:
            fut.cancel()
        for env in envs:
            await env.aclose()
        await sandboxes.close()
