"""Rollout settings: one typed model, every default here, checked before any actor starts."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.engine.base import SamplingParams

Thinking = Literal["keep", "strip"]
"""what later turns' contexts hold of a turn's reasoning (`RolloutConfig.thinking`)"""

EnvWorkersAt = Literal["ray", "local"]
"""where env workers run: Ray actors, or processes of the driver (`agentrl.rollout.pool`)"""


class EnvWorkersConfig(BaseModel):
    """The env workers that play episodes, their sandboxes, and the retries of an episode they fail: the same
    keys under `rollout`, `eval` and each benchmark (an evaluation's defaults: `agentrl.eval.bench`)."""

    model_config = ConfigDict(extra="forbid")

    num_workers: int = Field(2, ge=1)
    """env worker actors (on a Ray cluster, cluster.envs.workers_per_node on each Docker node instead)"""
    sandboxes_per_worker: int = Field(8, ge=1)
    """warm sandboxes each worker keeps (with sandbox_reuse, the ones in use that come back count)"""
    sandbox_reuse: int = Field(0, ge=0)
    """episodes a sandbox may serve after its first, each after a recycle that proves it clean (no process
    left, every writable place emptied); 0: a fresh container per episode"""
    max_retries: int = Field(1, ge=0)
    """restarts of an episode after an infrastructure failure before it is given up (masked out of the loss,
    left out of an evaluation's score)"""

    def worker_settings(self) -> dict[str, Any]:
        """These settings alone, as keyword arguments: an evaluation's `RolloutConfig` takes its own."""
        return {name: getattr(self, name) for name in EnvWorkersConfig.model_fields}


SUMMARY_PROMPT = (
    "The conversation is about to be cut short. Summarise everything needed to finish the task: what was asked, "
    "what you tried, what you found, and what is left to do. Your summary will replace the conversation so far."
)


class ContextConfig(BaseModel):
    """Context folding: what happens when an episode's context would outgrow `max_tokens` (it then goes on in a
    new token sequence of the same episode; `rollout.max_episode_tokens` still ends the episode)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=64)
    """the most tokens one sequence (its prompt and the turn it generates) may hold; None: no folding"""
    policy: Literal["truncate", "summarize"] = "truncate"
    """truncate: keep the opening messages (system prompt and task) and the last turns that fit; summarize: the
    policy writes a summary turn (trained as part of the episode), which replaces the turns before it"""
    summary_prompt: str = SUMMARY_PROMPT
    """summarize: the request for the summary, appended as a user message"""
    summary_max_tokens: int = Field(512, ge=1)
    """summarize: the longest summary; one cut at this length (or empty) fails its episode, counted, unscored"""


class RolloutConfig(EnvWorkersConfig):
    """A rollout controller's settings: its env workers (`EnvWorkersConfig`), then the env, the groups and the
    iterations, budgets and staleness."""

    env: str = "code_sandbox"
    """the environment's registered name, or "module:name" to import the module that registers it"""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """keyword arguments for the environment (its Config)"""
    group_size: int = Field(4, ge=1)
    """G: samples of the same task, compared with each other for advantages"""
    groups_per_iteration: int = Field(4, ge=1)
    """finished groups an iteration hands to the trainer (its completion target)"""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """temperature / top_p / top_k / seed; max_tokens is the per-turn token budget"""
    max_episode_tokens: int = Field(4096, ge=2)
    """per-episode budget: prompt, generated and observation tokens together"""
    partial: bool = True
    """partial rollouts: end the iteration at its target and park unfinished episodes"""
    max_groups_in_flight: int | None = None
    """groups running or parked at once (partial only); default 2 x groups_per_iteration"""
    iteration_token_budget: int | None = Field(None, ge=1)
    """partial only: also end the iteration once this many tokens were generated in it"""
    max_staleness: int = Field(4, ge=0)
    """a parked trajectory more policy versions behind than this is dropped (and counted)"""
    on_infra_failure: Literal["retry", "mask"] = "retry"
    """an infrastructure failure restarts the episode (up to max_retries) or masks it out"""
    seed: int = 0
    """seeds task order and every request's sampling generator"""
    ray_address: str | None = None
    """an existing Ray cluster; None starts a local one"""
    agent_timeout_s: float = Field(600.0, gt=0)
    """an agent program's episode (`agentrl.register(name, agent=...)`): the longest its `run` may take; past it the
    episode fails (never scored)"""
    gateway_host: str = "127.0.0.1"
    """agent programs: the interface the session gateway listens on (every session needs its own key wherever it
    listens; loopback: only agents on this machine reach it)"""
    env_workers: EnvWorkersAt = "ray"
    """where the env workers run: ray: Ray actors (a local Ray unless ray_address names a cluster); local: processes
    of this one on this machine, no Ray runtime"""
    thinking: Thinking = "keep"
    """keep: a turn's reasoning stays in the context of the turns after it (each prompt is the record extended);
    strip: the context of each turn is the chat template's own rendering of the conversation, as when the model is
    served (earlier thoughts dropped by templates that drop them): while a thought is in view, each turn's context
    is rendered, and a rendering that does not extend the record starts a new sequence"""
    context: ContextConfig = Field(default_factory=ContextConfig)
    """context folding (`ContextConfig`)"""

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.env_workers == "local" and self.ray_address is not None:
            raise ValueError(
                f"env_workers=local runs the env workers on this machine, without Ray, and ray_address="
                f"{self.ray_address!r} names a cluster for them: drop ray_address, or set env_workers=ray"
            )
        if not self.partial and (self.iteration_token_budget is not None or self.max_groups_in_flight is not None):
            raise ValueError("iteration_token_budget / max_groups_in_flight need partial=true")
        if self.max_groups_in_flight is not None and self.max_groups_in_flight < self.groups_per_iteration:
            raise ValueError("max_groups_in_flight must be >= groups_per_iteration, or nothing can finish")
        fold = self.context.max_tokens
        turn = self.sampling.max_tokens + (self.context.summary_max_tokens if self.context.policy == "summarize" else 0)
        if fold is not None and fold < 2 * turn:
            raise ValueError(
                f"context.max_tokens={fold} leaves no room for a folded context: a sequence must hold the opening, "
                f"a turn of sampling.max_tokens={self.sampling.max_tokens}"
                + (
                    f" and a summary of context.summary_max_tokens={self.context.summary_max_tokens}"
                    if turn > self.sampling.max_tokens
                    else ""
                )
                + f"; raise context.max_tokens to at least {2 * turn}"
            )
        return self

    @property
    def groups_in_flight(self) -> int:
        if not self.partial:
            return self.groups_per_iteration
        return self.max_groups_in_flight or 2 * self.groups_per_iteration
