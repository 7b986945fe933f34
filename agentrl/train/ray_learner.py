"""Learner ranks as Ray actors (`cluster.learner`): torch.distributed among them, the driver outside.

`RayLearner.start` reserves one placement-group bundle per rank (its CPUs, GPUs and custom node resources),
starts a `LearnerRank` actor in each, and has them join one process group (gloo on CPU, NCCL on GPU) at rank
0's address. Every rank then builds the same `Trainer` (`Trainer.build`: loaded and sharded over the group).

The driver keeps the rollouts, the engine and the run folder's writers. An update is one `ray.put` of the batch
that every rank reads; a weight sync, a checkpoint or an export is one call on every rank at once (their
collectives run among the ranks); between calls no rank waits in a collective, so a rollout may take longer than
`cluster.learner.collective_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agentrl.cluster import LearnerPlacement
from agentrl.train.batch import TrainBatch
from agentrl.train.config import TrainerConfig
from agentrl.train.diagnostics import RowRecorder, RowStats
from agentrl.train.learner import Learner, LocalLearner
from agentrl.train.trainer import Trainer


class LearnerRank:
    """One rank: a process group member holding the trainer, driven as a `LocalLearner` (an async actor: the driver
    sends one call at a time, each running on the actor's event loop)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.local: LocalLearner | None = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it: where rank 0 hosts the group's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(
        self, cfg: TrainerConfig, host: str, port: int, *, gpu: bool, timeout_s: float, threads: int, seed: int
    ) -> None:
        """Join the group, then load and shard the policy (collective: every rank at once)."""
        if gpu:  # Ray shows a rank only the GPU it reserved for it
            torch.cuda.set_device(0)
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        dist.init_process_group(
            "nccl" if gpu else "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.local = LocalLearner(Trainer.build(cfg), in_thread=False)

    async def update(
        self, batch: TrainBatch, recorder: RowRecorder | None, policy_version: int | None
    ) -> tuple[dict[str, float], dict[int, RowStats] | None]:
        metrics = await self.local.update(batch, recorder, policy_version)
        return metrics, (recorder.stats if recorder is not None else None)  # rank 0's: every rank's rows

    async def engine_weights(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor] | None:
        return await self.local.engine_weights(dtype)

    async def save(self, path: str, state: dict[str, Any]) -> None:
        await self.local.save(Path(path), state)

    async def load(self, path: str) -> dict[str, Any]:
        return await self.local.load(Path(path))

    async def export(self, path: str) -> None:
        await self.local.export(Path(path))

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def sees(self, marker: str, token: str) -> bool:
        """Whether this rank reads `token` in the file the driver just wrote (a folder shared with it)."""
        try:
            return Path(marker).read_text() == token
        except OSError:
            return False

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


_RemoteRank = ray.remote(max_restarts=0)(LearnerRank)


class LearnerDown(RuntimeError):
    """A learner rank died: the run cannot go on (its shards are gone); resume from the last checkpoint."""


class RayLearner(Learner):
    def __init__(self, ranks: list[Any], group: PlacementGroup, lora: bool) -> None:
        self.ranks = ranks
        self.group = group
        self.lora = lora
        # an engine in the driver (no engine.replicas) runs on its CPU: a GPU there is not reserved from Ray, and may
        # be a learner rank's or a replica's; on a cluster, GPU inference is engine.replicas
        self.engine_device = "cpu"
        self._nodes: list[str] = []
        self._last_call = time.monotonic()  # when the ranks last finished a call
        self._idle_s = 0.0

    @classmethod
    async def start(
        cls,
        cfg: TrainerConfig,
        placement: LearnerPlacement,
        *,
        run_dir: Path | None = None,
        threads: int | None = None,
        ready_timeout_s: float = 300.0,
    ) -> RayLearner:
        """Reserve, start and set up `placement.ranks` ranks on the running Ray cluster (`ray.init` first).
        `run_dir`: the run folder, where every rank writes its checkpoint shards: refused unless every rank sees it."""
        bundle = {"CPU": placement.cpus_per_rank, **placement.resources}
        if placement.gpus_per_rank:
            bundle["GPU"] = placement.gpus_per_rank
        group = placement_group([dict(bundle) for _ in range(placement.ranks)], strategy=placement.strategy)
        try:
            await asyncio.wait_for(group.ready(), ready_timeout_s)
        except TimeoutError:
            remove_placement_group(group)
            raise RuntimeError(
                f"the cluster has no room for {placement.ranks} learner rank(s) of {bundle} "
                f"({placement.strategy}) after {ready_timeout_s:.0f} s; it has "
                f"{ray.available_resources()} available: see cluster.learner"
            ) from None
        except BaseException:  # a cancel (a second Ctrl-C): the reservation goes too
            remove_placement_group(group)
            raise
        gpu = placement.gpus_per_rank > 0
        # Ray leaves a node's GPUs visible to an actor that reserved none: a CPU rank must not see (and pick) them
        hide = {} if gpu else {"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}
        ranks = [
            _RemoteRank.options(
                num_cpus=placement.cpus_per_rank,
                num_gpus=placement.gpus_per_rank,
                resources=placement.resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
                **hide,
            ).remote(i, placement.ranks)
            for i in range(placement.ranks)
        ]
        learner = cls(ranks, group, cfg.model.lora is not None)
        try:
            if run_dir is not None:
                await learner._check_shared(run_dir)
            host, port = await ranks[0].address.remote()
            n = threads or max(1, int(placement.cpus_per_rank))
            await learner._all(
                "setup", cfg, host, port, gpu=gpu, timeout_s=placement.collective_timeout_s, threads=n, seed=cfg.seed
            )
            learner._nodes = await learner._all("node")
        except BaseException:
            await learner.close()
            raise
        return learner

    async def _check_shared(self, run_dir: Path) -> None:
        marker, token = run_dir.absolute() / ".shared-check", secrets.token_hex(8)
        marker.write_text(token)
        try:
            seen = await self._all("sees", str(marker), token)
        finally:
            marker.unlink(missing_ok=True)
        if not all(seen):
            blind = [n for n, ok in zip(await self._all("node"), seen, strict=True) if not ok]
            raise RuntimeError(
                f"the run folder {run_dir} is not visible from the learner ranks on node(s) {blind}: "
                "every rank writes its checkpoint shards there; put it on a filesystem every node "
                "mounts at the same path (--set out=...)"
            )

    async def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`method` on every rank at once (their collectives need each other); a dead rank ends the run."""
        try:
            return await asyncio.gather(*(getattr(r, method).remote(*args, **kwargs) for r in self.ranks))
        except ray.exceptions.RayActorError as e:
            raise LearnerDown(
                f"a learner rank died during {method}: {e}. Resume the run from its last checkpoint "
                "(agentrl train --resume RUN_DIR)"
            ) from e
        finally:
            self._last_call = time.monotonic()

    async def update(
        self, batch: TrainBatch, recorder: RowRecorder | None = None, policy_version: int | None = None
    ) -> dict[str, float]:
        self._idle_s = time.monotonic() - self._last_call  # outside any collective: rollouts, evaluation, logging
        ref = ray.put(batch)  # one copy in the object store, read by every rank
        results = await self._all("update", ref, recorder, policy_version)
        metrics, stats = results[0]  # the metrics are reduced over ranks; the recorded rows gathered on rank 0
        if recorder is not None:
            recorder.stats = stats
        return metrics

    async def engine_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        return (await self._all("engine_weights", dtype))[0]

    async def save(self, path: Path, state: dict[str, Any]) -> None:
        await self._all("save", str(path.absolute()), state)  # absolute: a rank's working directory is Ray's

    async def load(self, path: Path) -> dict[str, Any]:
        return (await self._all("load", str(path.absolute())))[0]

    async def export(self, path: Path) -> None:
        await self._all("export", str(path.absolute()))

    def placement(self) -> list[str]:
        return list(self._nodes)

    def metrics(self) -> dict[str, float]:
        """`time/learner_idle_s`: how long the ranks waited, in no collective, before the last update."""
        return {"time/learner_idle_s": self._idle_s}

    async def close(self) -> None:
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):  # a dead rank has nothing to close
            await asyncio.wait_for(asyncio.gather(*(r.close.remote() for r in self.ranks)), 30)
        for r in self.ranks:
            ray.kill(r)
        remove_placement_group(self.group)
