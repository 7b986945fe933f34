"""`agentrl eval`: an agent on a benchmark env's tasks, N samples each, scored with pass@k.

Episodes run through the rollout controller and its sandbox pools, exactly as in
training (same env, tools, grading), one group of `samples` episodes per problem, all
problems in flight at once (the engine batches them, the pools bound the sandboxes).
A sample is correct when its episode ended with outcome 1 (every hidden test passed,
`success` below). A sandbox failure is retried; one that exhausts its
retries is left out of n for its problem (never a wrong answer) and reported. An episode the agent
failed by its own doing (an agent program that raised, ran past its time or never called the model)
is a wrong answer (`scored` below).

Multi-turn with test feedback (`turns > 1`, where the env supports it) is reported under
its own name: `pass@k` is single-turn, `pass@k (K turns)` is not comparable to it.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from agentrl.engine.base import InferenceEngine
from agentrl.env.base import FailureClass
from agentrl.eval.config import BenchConfig
from agentrl.eval.passk import pass_at_k, pass_at_ks
from agentrl.rollout import ChatFormat, RolloutConfig, RolloutController, Status, Trajectory
from agentrl.rollout.config import EnvWorkersAt
from agentrl.rollout.workers import make_env, task_ids
from agentrl.sandbox import SandboxConfig


def success(traj: Trajectory) -> bool:
    """The episode terminated with outcome 1 on its last turn."""
    return traj.terminated and bool(traj.turns) and traj.turns[-1].info.get("outcome") == 1.0


def scored(traj: Trajectory) -> bool:
    """The episode counts in the score: it ran to an end, or failed by the agent's own doing (a wrong answer).
    Only an infrastructure failure is left out: an agent that raised on the problems it could not solve would
    otherwise have them dropped from n, and score as if it had solved them all."""
    return traj.status is Status.FINISHED or (traj.status is Status.FAILED and traj.failure is not FailureClass.INFRA)


class ProblemResult(BaseModel):
    task_id: str
    n: int
    """samples scored (infrastructure failures left out)"""
    correct: int
    pass_at_k: dict[str, float]
    returns: list[float]
    infra_failed: int


class BenchResult(BaseModel):
    env: str
    split: str
    problems: int
    samples: int
    turns: int
    temperature: float
    pass_at_k: dict[str, float]
    """the mean over problems with n >= k"""
    infra_failed: int
    """episodes left out of n: infrastructure failures after their retries"""
    retried: int
    wall_s: float
    per_problem: list[ProblemResult]
    trajectories: list[Trajectory] = Field(default_factory=list, exclude=True)
    """every episode, for the output folder's transcripts"""


def bench_split(cfg: BenchConfig) -> tuple[str, dict[str, Any]]:
    """The split the benchmark draws from (the env's default, train becoming test) and the env's settings for it."""
    split = cfg.split or make_env(cfg.env, cfg.env_kwargs).cfg.split.replace("train", "test")
    return split, {**cfg.env_kwargs, "split": split} | ({"max_turns": cfg.turns} if cfg.turns > 1 else {})


def bench_tasks(cfg: BenchConfig) -> tuple[str, dict[str, Any], list[str]]:
    """`bench_split`, and the ids of the benchmark's problems."""
    split, env_kwargs = bench_split(cfg)
    return split, env_kwargs, task_ids(cfg.env, env_kwargs, cfg.tasks)


def problem_result(cfg: BenchConfig, task_id: str, scored: list[tuple[float, bool]], left_out: int) -> ProblemResult:
    """One problem's pass@k from its scored samples' (return, success); `left_out`: samples failed, not in n."""
    n, c = len(scored), sum(ok for _, ok in scored)
    return ProblemResult(
        task_id=task_id,
        n=n,
        correct=c,
        returns=[r for r, _ in scored],
        pass_at_k={cfg.metric.format(k=k): pass_at_k(n, c, k) for k in cfg.k if k <= n},
        infra_failed=left_out,
    )


def bench_result(cfg: BenchConfig, split: str, per_problem: list[ProblemResult], **rest: Any) -> BenchResult:
    """The benchmark's result: pass@k over its problems; `rest`: infra_failed, retried, wall_s (, trajectories)."""
    counts = [(p.n, p.correct) for p in per_problem]
    overall = {cfg.metric.format(k=k): v for k, v in pass_at_ks(counts, cfg.k).items()}
    return BenchResult(
        env=cfg.env,
        split=split,
        problems=len(per_problem),
        samples=cfg.samples,
        turns=cfg.turns,
        temperature=cfg.sampling.temperature,
        pass_at_k=overall,
        per_problem=per_problem,
        **rest,
    )


async def run_bench(
    cfg: BenchConfig,
    engine: InferenceEngine,
    chat: ChatFormat,
    *,
    sandbox: SandboxConfig | None = None,
    env_workers: EnvWorkersAt = "ray",
) -> BenchResult:
    """The benchmark on `engine`, its env workers where `env_workers` says, its sandboxes `sandbox`'s."""
    t0 = time.perf_counter()
    split, env_kwargs, ids = bench_tasks(cfg)
    rollout = RolloutConfig(
        env=cfg.env,
        env_kwargs=env_kwargs,
        group_size=cfg.samples,
        groups_per_iteration=len(ids),
        sampling=cfg.sampling,
        max_episode_tokens=cfg.max_episode_tokens,
        partial=False,
        on_infra_failure="retry",
        seed=cfg.seed,
        env_workers=env_workers,
        thinking=cfg.thinking,
        context=cfg.context,
        **cfg.worker_settings(),
    )
    async with RolloutController(rollout, engine, chat, sandbox=sandbox) as ctl:  # every problem in flight at once
        batch = await ctl.run_iteration(ids)
    per_problem = []
    for g in sorted(batch.groups, key=lambda g: ids.index(g.task_id)):
        counted = [t for t in g.trajectories if scored(t)]
        results = [(t.outcome_reward, success(t)) for t in counted]
        per_problem.append(problem_result(cfg, g.task_id, results, len(g.trajectories) - len(counted)))
    return bench_result(
        cfg,
        split,
        per_problem,
        infra_failed=sum(p.infra_failed for p in per_problem),
        retried=batch.stats.retried,
        wall_s=time.perf_counter() - t0,
        trajectories=[t for g in batch.groups for t in g.trajectories],
    )
