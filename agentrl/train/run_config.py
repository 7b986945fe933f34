"""The settings of one `agentrl train` run: every component's typed config, nested, checked at load.

A YAML recipe (`configs/*.yaml`) and `--set key=value` overrides are merged over these
defaults and validated before anything starts (`agentrl.config.load`): an unknown key, a
wrong type or an incompatible combination is refused with the valid choices named. The
resolved config is saved in the run folder as `config.yaml`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from agentrl.cluster import ClusterConfig
from agentrl.engine.config import EngineConfig
from agentrl.eval import EvalConfig
from agentrl.rollout import RolloutConfig
from agentrl.sandbox import SandboxConfig
from agentrl.train.config import AlgoConfig, ModelConfig, OptimConfig, TrainerConfig, _Strict, changed


class CheckpointConfig(_Strict):
    every: int = Field(1, ge=0)
    """iterations between checkpoints (also on Ctrl-C and at the end); 0: only those. At 1, a
    SIGKILLed run resumes losing at most the iteration in flight"""
    keep: int = Field(2, ge=1)
    """newest checkpoints kept; older ones are deleted"""
    export_final: bool = True
    """also save the final policy as a plain Hugging Face folder (run folder /final, LoRA merged)"""


class LogConfig(_Strict):
    tensorboard: bool = True
    """write TensorBoard event files to the run folder /tensorboard"""
    wandb: Literal["auto", "on", "off"] = "auto"
    """Weights & Biases: auto logs when wandb is installed and configured (WANDB_API_KEY or WANDB_MODE set)"""
    wandb_project: str = "agentrl"
    """the W&B project the run logs to (not with wandb off)"""
    trajectories_per_iteration: int = Field(16, ge=0)
    """trajectories saved per iteration (whole groups, for `agentrl view`); 0: none"""
    max_trajectory_mb: float = Field(500.0, ge=0)
    """saved trajectories stop once their files reach this size, so a long run stays bounded on disk"""

    @field_validator("wandb", mode="before")
    @classmethod
    def _yaml_switch(cls, v: object) -> object:
        # YAML 1.1 reads a bare on/off as a bool (`--set log.wandb=off` arrives as False)
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _check(self) -> LogConfig:
        if self.wandb == "off" and changed(self, "wandb_project"):
            raise ValueError(
                "log.wandb_project does nothing with log.wandb=off: set log.wandb=auto or on, or drop log.wandb_project"
            )
        if not self.trajectories_per_iteration and changed(self, "max_trajectory_mb"):
            raise ValueError(
                "log.max_trajectory_mb bounds the saved trajectories: it does nothing with "
                "log.trajectories_per_iteration=0; save some, or drop log.max_trajectory_mb"
            )
        return self


class RunConfig(_Strict):
    iterations: int = Field(30, ge=1)
    """rollout-then-train iterations (each ends with a weight sync: the policy version counts them)"""
    seed: int = 0
    """seeds the trainer, the rollouts' task order and sampling (unless rollout.seed is set)"""
    threads: int | None = Field(None, ge=1)
    """torch threads of each learner process; None: torch's default (every core). With engine replicas in their
    own processes (engine.replicas), split the cores: threads + replicas x engine.threads_per_replica"""
    out: str | None = None
    """the run folder; default runs/{env}-{date}-{time}"""
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(path="default"))
    """the policy; path "default" is the embedded default policy"""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """where the parts run on a Ray cluster (agentrl/cluster.py); default: this machine"""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """the backend of every sandbox the run makes (the env workers', held-out evaluation's, the benchmarks'):
    agentrl/sandbox/config.py"""

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if "seed" not in self.rollout.model_fields_set:
            self.rollout.seed = self.seed
        if self.rollout.sampling.temperature == 0:
            raise ValueError(
                "rollout.sampling.temperature=0 is greedy: a group's samples would all be the same; "
                "set a temperature > 0 (evaluation is greedy on its own)"
            )
        self.eval.split_as_trained(self.rollout.env, self.rollout.env_kwargs)
        # On a cluster, `build` joins it before any part starts, and every part's actors go there: the address is said
        # once (not copied into the saved sections, so that a resume may name the cluster anew)
        if (address := self.cluster.address) is not None:
            if self.rollout.env_workers == "local":
                raise ValueError(
                    f"rollout.env_workers=local runs the env workers on this machine, without Ray, and cluster.address="
                    f"{address!r} places them on the cluster's Docker nodes: drop cluster.address, or set "
                    "rollout.env_workers=ray"
                )
            if self.sandbox.backend == "local":
                raise ValueError(
                    "sandbox.backend=local with cluster.address: local sandboxes are host processes, not isolation, "
                    "and a cluster's env nodes run untrusted code; set sandbox.backend=docker or bwrap"
                )
            for section, cfg in (("rollout", self.rollout), ("engine", self.engine)):
                if cfg.ray_address is not None:
                    raise ValueError(
                        f"{section}.ray_address={cfg.ray_address!r} and cluster.address={address!r}: "
                        "on a cluster set only cluster.address"
                    )
            self.engine.place(self.cluster.inference)
        if self.algo.routing_replay == "R3" and not self.engine.record_routing:
            raise ValueError(
                "algo.routing_replay=R3 forces the engine's recorded experts in the learner's forward: "
                "set engine.record_routing=true (an hf engine; openai and vllm engines return no "
                "routing)"
            )
        if self.algo.async_level > self.rollout.max_staleness:
            raise ValueError(
                f"algo.async_level={self.algo.async_level} lets tokens be that many versions old when "
                f"trained, beyond rollout.max_staleness={self.rollout.max_staleness}: raise the bound "
                "or lower the level"
            )
        self._refuse_inert()
        return self

    def _refuse_inert(self) -> None:
        """Settings that another setting makes inert are refused, never ignored: those spanning sections, and
        those within the rollout section (its own checks belong to agentrl/rollout/config.py)."""
        r, sampling = self.rollout, self.rollout.sampling
        # every request's sampling seed and stop tokens are the controller's (agentrl.rollout.controller)
        if changed(sampling, "seed"):
            raise ValueError(
                "rollout.sampling.seed does nothing: each request's seed is drawn from rollout.seed (so that its "
                "tokens do not depend on batching); set rollout.seed, or drop rollout.sampling.seed"
            )
        if changed(sampling, "stop_token_ids"):
            raise ValueError(
                "rollout.sampling.stop_token_ids does nothing: a turn stops at the chat template's end-of-turn "
                "tokens; drop rollout.sampling.stop_token_ids"
            )
        if r.on_infra_failure == "mask" and changed(r, "max_retries"):
            raise ValueError(
                "rollout.max_retries does nothing with rollout.on_infra_failure=mask (a failed episode is masked "
                "out, never retried); set rollout.on_infra_failure=retry, or drop rollout.max_retries"
            )
        # without partial rollouts nothing waits between iterations, and at async_level 0 nothing runs ahead
        if not r.partial and not self.algo.async_level and changed(r, "max_staleness"):
            raise ValueError(
                "rollout.max_staleness does nothing with rollout.partial=false and algo.async_level=0: every "
                "trained token is of the current policy version; set rollout.partial=true or algo.async_level "
                ">= 1, or drop rollout.max_staleness"
            )
        if self.algo.routing_replay == "R2" and self.optim.minibatches == 1:
            raise ValueError(
                "algo.routing_replay=R2 routes minibatches after the first as the weights before the update did: "
                "it does nothing at optim.minibatches=1; set optim.minibatches >= 2, or drop algo.routing_replay"
            )
        if self.engine.replicas is None and changed(self.cluster, "inference"):
            raise ValueError(
                "cluster.inference places engine replicas: it does nothing without engine.replicas; set "
                "engine.replicas, or drop cluster.inference"
            )
        engine_at, rollout_at = self.engine.ray_address, r.ray_address
        if engine_at is not None and rollout_at is not None and engine_at != rollout_at:
            raise ValueError(
                f"engine.ray_address={engine_at!r} and rollout.ray_address={rollout_at!r}: a process joins one "
                "Ray cluster, so one of them would do nothing; set only rollout.ray_address (the engine replicas "
                "start there too)"
            )

    @property
    def ray_address(self) -> str | None:
        """The Ray cluster the run's actors start on: cluster.address, else rollout.ray_address (env workers and
        replicas only); None: a local Ray."""
        return self.cluster.address or self.rollout.ray_address

    def engine_config(self) -> EngineConfig:
        """The engine's settings, its replicas on the run's Ray cluster unless engine.ray_address names one (resolved
        here, not copied into the saved section, so that a resume may name the cluster anew)."""
        if self.engine.replicas is None or self.engine.ray_address is not None:
            return self.engine
        return self.engine.model_copy(update={"ray_address": self.ray_address})

    def trainer(self) -> TrainerConfig:
        return TrainerConfig(model=self.model, algo=self.algo, optim=self.optim, seed=self.seed)
