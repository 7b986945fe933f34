"""The settings of evaluations: held-out evaluation in a run (`eval`), each benchmark in it, and `agentrl eval`.
Plain pydantic models: a run's config loads and is checked without importing what evaluates."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from agentrl.engine.base import SamplingParams
from agentrl.env.registry import same_env
from agentrl.rollout.config import ContextConfig, EnvWorkersAt, EnvWorkersConfig, Thinking
from agentrl.sandbox.config import SandboxConfig


class EvalWorkersConfig(EnvWorkersConfig):
    """The env-worker settings of an evaluation (`eval`, each benchmark, `agentrl eval`); where a default differs
    from training's, the reason is under it."""

    num_workers: int = Field(1, ge=1)
    """env worker actors. One: an evaluation's episodes wait on sandboxes, which `sandboxes_per_worker` counts,
    and the held-out evaluator's worker stays up, idle, between evaluations of a run (training's 2 spread a run's
    many episodes over two processes, so one dying fails only half of them)"""
    max_retries: int = Field(2, ge=0)
    """restarts of an episode after an infrastructure failure before it is left out of the score. Two (training:
    1): an evaluation's tasks are fixed and few, and a task left out changes its rate, where a lost training
    episode is one of many"""


class BenchConfig(EvalWorkersConfig):
    env: str
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    split: Literal["train", "test", "all"] | None = None
    """None: the env's own default, except that its train split becomes test (humaneval: all 164)"""
    tasks: int | None = Field(None, ge=1)
    """the first N problems of the split (a fixed subset); None: all"""
    samples: int = Field(1, ge=1)
    """episodes per problem (n of pass@k)"""
    k: list[int] = Field(default_factory=lambda: [1])
    turns: int = Field(1, ge=1)
    """attempts per episode; > 1 gives test feedback between them where the env supports it"""
    temperature: float | None = Field(None, ge=0)
    """None: greedy for one sample, 0.8 for several (pass@k needs distinct samples)"""
    top_p: float = Field(0.95, gt=0, le=1)
    max_tokens: int = Field(512, ge=1)
    """per-turn token budget"""
    max_episode_tokens: int = Field(4096, ge=1)
    thinking: Thinking = "keep"
    """what later turns' contexts hold of a turn's reasoning, as `rollout.thinking` (strip: as served)"""
    context: ContextConfig = Field(default_factory=ContextConfig)
    """context folding, as `rollout.context`"""
    sandbox_reuse: int = Field(100, ge=0)
    """episodes a sandbox serves after a recycle that proves it clean. 100 (training and held-out evaluation: 0,
    unless a recipe sets it): a benchmark's episodes are many and short (HumanEval: 164 problems x samples, one
    program each), and a container start costs a few hundred ms of CPU"""
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> BenchConfig:
        if bad := [k for k in self.k if not 1 <= k <= self.samples]:
            raise ValueError(f"pass@k needs 1 <= k <= samples ({self.samples}); got k = {bad}: raise --samples")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError("several samples at temperature 0 are one sample repeated: set a temperature > 0")
        return self

    def split_as(self, env: str, env_kwargs: dict[str, Any], *, named: str, trained: str, fix: bool = True) -> None:
        """On the env a policy trains on (`env`, its `env_kwargs`), draw the test split as training does: take its
        split_seed and test_fraction where these settings set neither, so that the test split holds no task the
        policy trains on (the same tasks split by another seed, or with a larger test share, would); setting either
        otherwise is refused (ValueError, naming the setting as `named`.KEY and training's as in `trained`; `fix`:
        the fix may be to change training's). Another env, or the train split or all of it asked for, is left as
        it is."""
        draws = self.split or ("all" if self.env_kwargs.get("split") == "all" else "test")  # as `bench_split` does
        if not same_env(self.env, env) or draws != "test":
            return
        for key in ("split_seed", "test_fraction"):
            if key not in self.env_kwargs:
                if key in env_kwargs:
                    self.env_kwargs = {**self.env_kwargs, key: env_kwargs[key]}
            elif (mine := self.env_kwargs[key]) != env_kwargs.get(key):
                was = f"={env_kwargs[key]}" if key in env_kwargs else " unset: the env's default"
                raise ValueError(
                    f"{named}.{key}={mine}: an evaluation on the env the policy trains on ({self.env}) splits its "
                    f"tasks as training does ({trained}: {key}{was}), so that its test split holds none the policy "
                    f"trains on; drop it" + (f", or set {key}={mine} there too" if fix else "")
                )

    @property
    def sampling(self) -> SamplingParams:
        t = self.temperature if self.temperature is not None else (0.0 if self.samples == 1 else 0.8)
        return SamplingParams(temperature=t, top_p=self.top_p if t > 0 else 1.0, max_tokens=self.max_tokens)

    @property
    def metric(self) -> str:
        return "pass@{k}" if self.turns == 1 else f"pass@{{k}} ({self.turns} turns)"


class EvalCommandConfig(BenchConfig):
    """`agentrl eval`'s settings: a benchmark, and where its sandboxes and env workers run (in a training run, the
    run's `sandbox` and `rollout.env_workers`, the same for every evaluation)."""

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """the backend of every sandbox (agentrl/sandbox/config.py): docker, bwrap or local"""
    env_workers: EnvWorkersAt = "ray"
    """ray: Ray actors on a local Ray; local: processes of this one, no Ray runtime"""


class EvalConfig(EvalWorkersConfig):
    tasks: int = Field(100, ge=0)
    """held-out tasks: the first N of the env's test split (all of it when it has fewer), the same at every
    evaluation; the run must train on the env's train split. 0: no held-out evaluation (and no env workers or
    sandboxes for it; `benchmarks` still run)"""
    every: int = Field(10, ge=0)
    """iterations between evaluations (also before the first and after the last); 0: only those two"""
    max_tokens: int = Field(256, ge=1)
    """per-turn token budget of the greedy episodes"""
    benchmarks: list[BenchConfig] = Field(default_factory=list)
    """more evaluations at the same iterations, on the training engine, each an `agentrl eval` of its
    own (any registered env's test split, a fixed subset with `tasks`, pass@k with `samples` and
    `k`), logged to bench.jsonl apart from the held-out success; e.g. [{env: humaneval, tasks: 40}]. One on the
    run's env splits its tasks as the run does (`split_as_trained`)"""

    def split_as_trained(self, env: str, env_kwargs: dict[str, Any]) -> None:
        """Each benchmark on the run's env `env` splits its tasks as the run does (`BenchConfig.split_as`)."""
        for i, b in enumerate(self.benchmarks):
            b.split_as(env, env_kwargs, named=f"eval.benchmarks.{i}.env_kwargs", trained="rollout.env_kwargs")
