"""Where a run's parts go on a Ray cluster: the `cluster:` section of a run config, and the Ray placement
that section describes (docs/design.md §6, "On a cluster").

Three roles share the cluster:
- learning: `learner.ranks` Ray actors running torch.distributed (gloo on CPU, NCCL on GPU), kept together
  by a placement group;
- inference: the engine fleet's replicas (`engine.replicas`), each with its GPUs and CPUs;
- environments: env workers on every node that advertises the sandbox backend's node resource
  (`envs.node_resource`, e.g. `ray start --resources '{"docker": 1}'`, or `{"bwrap": 1}` with
  `sandbox.backend=bwrap`), each making its sandboxes on its own node (its own Docker daemon, or bubblewrap).

With `address` unset the run stays on this machine: Ray starts locally for the env workers (and replicas),
and several learner ranks come from `torchrun`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LearnerPlacement(_Strict):
    ranks: int = Field(1, ge=1)
    """learner processes (torch.distributed world size), each a Ray actor"""
    gpus_per_rank: int = Field(0, ge=0, le=1)
    """0: CPU ranks over gloo (a node's GPUs hidden from them); 1: one GPU each, over NCCL"""
    cpus_per_rank: float = Field(1.0, gt=0)
    """CPUs each rank reserves (also its torch threads, rounded down, unless `threads` is set)"""
    resources: dict[str, float] = Field(default_factory=dict)
    """custom node resources each rank needs, e.g. {"learner": 1}: the ranks go only to nodes started with them"""
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """the placement group's strategy over the ranks' bundles (PACK: as few nodes as fit)"""
    collective_timeout_s: float = Field(1800.0, gt=0)
    """torch.distributed's timeout for one collective (in an update, a sync, a checkpoint, an export); the ranks wait
    in none while episodes run, so a rollout may take longer"""


class InferencePlacement(_Strict):
    gpus_per_replica: int | None = Field(None, ge=0)
    """None: the engine's need (vllm 1, hf 0)"""
    cpus_per_replica: float | None = Field(None, gt=0)
    """None: engine.threads_per_replica for hf, 1 for vllm"""
    resources: dict[str, float] = Field(default_factory=dict)
    """custom node resources each replica needs, e.g. {"inference": 1}"""


class EnvPlacement(_Strict):
    node_resource: str | None = None
    """env workers go to every alive node that has this custom resource (one that can make the run's sandboxes);
    None: the sandbox backend's name, "docker" (a node with its own Docker daemon) or "bwrap" (bubblewrap). A
    cluster with none such is refused before the run starts"""

    def resource(self, backend: str) -> str:
        """The node resource env workers go to, for sandboxes of `backend`."""
        return self.node_resource or backend

    workers_per_node: int = Field(1, ge=1)
    """env worker actors per such node (each keeps rollout.sandboxes_per_worker warm sandboxes)"""


class ClusterConfig(_Strict):
    address: str | None = None
    """a Ray cluster to run on ("auto": the one this machine belongs to; `agentrl train --ray-address`); None:
    this machine only, with torchrun for several learner ranks"""
    learner: LearnerPlacement = Field(default_factory=LearnerPlacement)
    inference: InferencePlacement = Field(default_factory=InferencePlacement)
    envs: EnvPlacement = Field(default_factory=EnvPlacement)
