"""Held-out evaluation: the same N test-split tasks every time, greedy, in real sandboxes.

It runs through a `RolloutController` of its own (env workers on the env's test split, one
episode per task, no partial rollouts), on the training engine, so it measures the policy
the trainer just synced, with the training env's tools and grading. An episode succeeds
when it terminated with `info["outcome"] == 1` on its last turn (every hidden test passed;
the exact answer), the outcome every built-in env reports. Infrastructure failures are
retried, and never counted as wrong answers: they are left out of the rate and reported; an
episode the agent failed by its own doing is a wrong answer (`agentrl.eval.bench.scored`).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel

from agentrl.cluster import EnvPlacement
from agentrl.engine.base import InferenceEngine, SamplingParams
from agentrl.eval.bench import scored, success
from agentrl.eval.config import EvalConfig
from agentrl.rollout import ChatFormat, RolloutConfig, RolloutController
from agentrl.rollout.config import ContextConfig, EnvWorkersAt, Thinking
from agentrl.rollout.workers import make_env, task_ids
from agentrl.sandbox import SandboxConfig


class EpisodeResult(BaseModel):
    task_id: str
    success: bool
    episode_return: float
    turns: int
    failure: str
    """ok, or the failure class of an episode left out (infra_error after its retries)"""


class EvalResult(BaseModel):
    iteration: int
    policy_version: int
    tasks: int
    scored: int
    """episodes scored (infrastructure failures left out)"""
    successes: int
    success_rate: float
    mean_return: float
    infra_failed: int
    retried: int
    wall_s: float
    episodes: list[EpisodeResult]


def split_leak(env: str, trained: str) -> str | None:
    """Why a run training on the `trained` split of `env` has no held-out tasks, or None: the test split is held out
    only from the train split (humaneval's and a scaffolded env's default, `all`, holds it)."""
    if trained == "train":
        return None
    return (
        f"held-out evaluation draws the test split of {env}, and the run trains on its {trained} split, which holds "
        "those tasks: train on rollout.env_kwargs.split=train, or set eval.tasks=0"
    )


class HeldOutEval:
    """`async with HeldOutEval(...) as ev: result = await ev.run(iteration)`. Its env workers run where the training
    run's do (`env_workers`, `ray_address`, `placement`) and make its sandboxes (`sandbox`); its episodes' contexts
    are laid out as the run's (`thinking`, `context`)."""

    def __init__(
        self,
        cfg: EvalConfig,
        engine: InferenceEngine,
        chat: ChatFormat,
        *,
        env: str,
        env_kwargs: dict[str, Any],
        max_episode_tokens: int,
        ray_address: str | None = None,
        env_workers: EnvWorkersAt = "ray",
        placement: EnvPlacement | None = None,
        sandbox: SandboxConfig | None = None,
        thinking: Thinking = "keep",
        context: ContextConfig | None = None,
    ) -> None:
        self.cfg = cfg
        if (leak := split_leak(env, make_env(env, env_kwargs).cfg.split)) is not None:
            raise ValueError(leak)
        held_out = {**env_kwargs, "split": "test"}
        # A test split smaller than eval.tasks is evaluated whole: the controller would fill the rest with tasks
        # drawn afresh at each evaluation, repeats of a few of these.
        self.task_ids = task_ids(env, held_out, cfg.tasks)
        rollout = RolloutConfig(
            env=env,
            env_kwargs=held_out,
            group_size=1,
            groups_per_iteration=len(self.task_ids),
            sampling=SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens),
            max_episode_tokens=max_episode_tokens,
            partial=False,
            on_infra_failure="retry",
            ray_address=ray_address,
            env_workers=env_workers,
            thinking=thinking,
            context=context or ContextConfig(),
            **cfg.worker_settings(),
        )
        self.controller = RolloutController(rollout, engine, chat, placement=placement, sandbox=sandbox)

    async def __aenter__(self) -> HeldOutEval:
        await self.controller.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.controller.close()

    async def run(self, iteration: int) -> EvalResult:
        t0 = time.perf_counter()
        batch = await self.controller.run_iteration(self.task_ids)
        trajs = batch.trajectories
        episodes = [
            EpisodeResult(
                task_id=t.task_id,
                success=success(t),
                episode_return=t.outcome_reward,
                turns=len(t.turns),
                failure=str(t.failure),
            )
            for t in trajs
        ]
        counted = [e for t, e in zip(trajs, episodes, strict=True) if scored(t)]
        wins = sum(e.success for e in counted)
        return EvalResult(
            iteration=iteration,
            policy_version=batch.stats.policy_version,
            tasks=len(trajs),
            scored=len(counted),
            successes=wins,
            success_rate=wins / max(len(counted), 1),
            mean_return=sum(e.episode_return for e in counted) / max(len(counted), 1),
            infra_failed=len(trajs) - len(counted),
            retried=batch.stats.retried,
            wall_s=time.perf_counter() - t0,
            episodes=episodes,
        )
