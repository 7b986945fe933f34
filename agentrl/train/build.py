"""The setup of one `agentrl train` run, and the parts of an iteration that only rank 0 does.

`build` makes every part once: the learner (agentrl/train/learner.py: the trainer in this process, FSDP2 when
torch.distributed is initialised, or with `cluster.address` its ranks as Ray actors), the loop state (from the
latest checkpoint on resume), and on the lead (rank 0, or the driver of Ray-actor ranks) the inference engine
(`agentrl.engine.build_engine`), the rollout controller over env worker actors, the held-out evaluator and the
tracker; then the weight sync for that engine. `Run`'s methods hide the rank handling from the loop: the lead rolls
out, evaluates and logs; under torchrun what every rank needs (the batch, the rows to record, the policy version,
a stop) is broadcast from rank 0. The lead's rollouts run in a `Pipeline` (agentrl/train/pipeline.py), up to
`algo.async_level` versions ahead of the learner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import ray
import torch
import torch.distributed as dist
from pydantic import BaseModel
from transformers import AutoTokenizer

from agentrl.engine import EngineModel, InferenceEngine, build_engine
from agentrl.eval import EvalResult, HeldOutEval, success
from agentrl.eval.bench import run_bench
from agentrl.models.default import resolve_path
from agentrl.rollout import ChatFormat, ControllerState, Group, RolloutBatch, RolloutController, Trajectory
from agentrl.runs import RunDir
from agentrl.train.batch import TrainBatch, build_batch
from agentrl.train.diagnostics import RowRecorder
from agentrl.train.learner import Learner, LocalLearner, broadcast
from agentrl.train.pipeline import Pipeline
from agentrl.train.ray_learner import RayLearner
from agentrl.train.run_config import RunConfig
from agentrl.train.tracking import Tracker
from agentrl.train.trainer import Trainer
from agentrl.train.weight_sync import WeightSync, weight_sync

T = TypeVar("T")


class LoopState(BaseModel):
    """What a checkpoint keeps of the loop (its `state.json`), besides the trainer's tensors."""

    iteration: int = 0
    """the next iteration to run (== iterations done)"""
    policy_version: int = 0
    elapsed_s: float = 0.0
    controller: ControllerState | None = None
    """the task cursor and the partial-rollout buffer"""


class Display(Protocol):
    def iteration(self, metrics: dict[str, Any]) -> None: ...
    def evaluation(self, result: EvalResult) -> None: ...
    def message(self, text: str) -> None: ...


class Quiet:
    """Shows nothing (tests, ranks > 0)."""

    def __enter__(self) -> Quiet:
        return self

    def __exit__(self, *exc: object) -> None: ...

    def iteration(self, metrics: dict[str, Any]) -> None: ...
    def evaluation(self, result: EvalResult) -> None: ...
    def message(self, text: str) -> None: ...


@dataclass
class Lead:
    """Rank 0's parts."""

    engine: InferenceEngine
    chat: ChatFormat
    controller: RolloutController
    held_out: HeldOutEval | None
    """None: eval.tasks = 0"""
    tracker: Tracker
    restore_dropped: int = 0
    """parked episodes a resume could not rebuild, reported with the first iteration"""


@dataclass
class Rollout:
    """One iteration's rollouts as the update takes them (`batch` on every rank; the rest on rank 0)."""

    batch: TrainBatch | None
    """None when there was nothing to learn from"""
    recorder: RowRecorder | None
    """the rows of the saved trajectories, recorded by the update"""
    saved: list[Trajectory] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)
    """rank 0: the complete groups the batch was built from"""


@dataclass
class Run:
    cfg: RunConfig
    folder: RunDir
    learner: Learner
    sync: WeightSync
    state: LoopState
    display: Display
    stop: asyncio.Event
    lead: Lead | None
    """None on ranks > 0"""
    pipeline: Pipeline[Rollout] | None = None
    """rank 0's rollouts, set by `build`"""
    first: int = 0
    """the iteration this process started at (a resume's)"""
    t_start: float = field(default_factory=time.perf_counter)
    """when the run started, as if it had never stopped (a resume's elapsed time counts)"""

    def __post_init__(self) -> None:
        self.first = self.state.iteration
        self.t_start -= self.state.elapsed_s

    def checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every) and self.state.iteration % every == 0

    # -- rank 0 works, every rank gets the result -------------------------------------

    async def rollout(self, iteration: int) -> Rollout:
        """Groups of episodes until enough are complete (the rest stay parked), then their advantages: rank 0
        takes them from its pipeline (rolled out meanwhile, when asynchronous); every rank gets the batch and
        the rows of the trajectories the run saves."""
        r = Rollout(None, None)
        if self.pipeline is not None:
            r = await self.pipeline.next(iteration)
            self._check_staleness(r.groups)
        r.batch = broadcast(r.batch)
        if self.cfg.log.trajectories_per_iteration:
            ids = {t.episode_id for t in r.saved}
            wanted = {i for i, e in enumerate(r.batch.episode_ids) if e in ids} if r.batch is not None else set()
            r.recorder = RowRecorder(broadcast(wanted), self.cfg.algo)
        return r

    def _check_staleness(self, groups: list[Group]) -> None:
        """Every token about to be trained is within `rollout.max_staleness` versions (admission control
        keeps it so; a token beyond it is a bug, not a sample to train on)."""
        bound, version = self.cfg.rollout.max_staleness, self.state.policy_version
        for t in (t for g in groups for t in g.trainable):
            if t.oldest_version is not None and version - t.oldest_version > bound:
                raise RuntimeError(
                    f"episode {t.episode_id} has a token sampled at version {t.oldest_version}, "
                    f"{version - t.oldest_version} behind the learner's {version} "
                    f"(rollout.max_staleness={bound})"
                )

    async def update(self, rollout: Rollout) -> dict[str, float]:
        """M minibatch steps on the batch (asynchronous: the event loop goes on driving the episodes of the next
        rollouts meanwhile)."""
        version = self.state.policy_version  # the learner's, before its first step on the batch
        with self.sync.updating():
            return await self.learner.update(rollout.batch, rollout.recorder, version)

    async def _roll_out(self, iteration: int, ahead: int) -> Rollout:
        lead, batch, t0 = self.lead, None, time.perf_counter()
        work = lead.controller.run_iteration(ahead=ahead)
        episodes = await self._stoppable(work, lead.controller)
        metrics = _rollout_metrics(iteration, episodes) | {"rollout/restore_dropped": lead.restore_dropped}
        lead.restore_dropped = 0
        try:
            batch, info = build_batch(episodes.groups, self.cfg.algo)
            metrics |= {f"batch/{k}": v for k, v in vars(info).items()}
        except ValueError as e:  # nothing to learn from (every episode failed, or no signal)
            self.display.message(f"iteration {iteration}: {e}; no update")
        metrics["time/rollout_s"] = time.perf_counter() - t0
        return Rollout(batch, None, lead.tracker.to_save(episodes.groups), metrics, episodes.groups)

    async def push_weights(self) -> float:
        """The new weights to the engine: policy version + 1 (every rank learns it). Returns its seconds."""
        t0 = time.perf_counter()
        self.state.policy_version = broadcast(await self.sync.push())
        return time.perf_counter() - t0

    def stopping(self) -> bool:
        return broadcast(self.stop.is_set())

    # -- rank 0's work (the other ranks return at once) ----------------------------------

    async def evaluate(self, iteration: int, *, final: bool = False) -> None:
        """Held-out success (greedy, the env's test split) and `eval.benchmarks`, on the current weights."""
        if self.lead is None or (self.stop.is_set() and not final):
            return
        lead = self.lead
        if lead.held_out is not None:
            work = lead.held_out.run(iteration)
            result = await (work if final else self._stoppable(work, lead.held_out.controller))
            lead.tracker.log_eval(result.model_dump(exclude={"episodes"}))
            self.display.evaluation(result)
        for b in self.cfg.eval.benchmarks:
            r = await run_bench(b, lead.engine, lead.chat)
            lead.tracker.log_bench(
                {
                    "iteration": iteration,
                    "env": b.env,
                    **r.pass_at_k,
                    "problems": r.problems,
                    "samples": r.samples,
                    "infra_failed": r.infra_failed,
                    "retried": r.retried,
                    "wall_s": r.wall_s,
                }
            )
            scores = ", ".join(f"{k} {100 * v:.1f}%" for k, v in r.pass_at_k.items())
            self.display.message(
                f"{b.env} @ iteration {iteration}: {scores} on {r.problems} problems ({r.wall_s:.0f} s)"
            )

    def log(self, rollout: Rollout, update: dict[str, float], times: dict[str, float]) -> None:
        """The iteration's time (kept in the state), and on rank 0 metrics.jsonl (and TensorBoard / W&B), the saved
        trajectories with what the update saw, the display."""
        s = self.state
        s.elapsed_s = time.perf_counter() - self.t_start
        if self.lead is None:
            return
        left = s.elapsed_s / (s.iteration - self.first) * (self.cfg.iterations - s.iteration)
        metrics = rollout.metrics | {f"train/{k}": v for k, v in update.items()} | {"policy_version": s.policy_version}
        metrics |= {f"time/{k}": v for k, v in times.items()} | {"time/elapsed_s": s.elapsed_s, "time/left_s": left}
        metrics["time/rollout_idle_s"] = self.pipeline.idle_s  # so far: the rollouts waiting for the learner
        metrics |= self.lead.engine.metrics()  # a fleet's counters, so far
        metrics |= self.placement_metrics() | self.learner.metrics()
        self.lead.tracker.log(metrics)
        views = rollout.recorder.views(rollout.batch) if rollout.recorder and rollout.batch is not None else {}
        self.lead.tracker.save_trajectories(s.iteration - 1, rollout.saved, views)
        self.display.iteration(metrics)

    def placement_metrics(self) -> dict[str, float]:
        """On a cluster: how many distinct nodes hold learner ranks, engine replicas and env workers now."""
        if self.cfg.cluster.address is None:
            return {}
        lead = self.lead
        return {
            "learner/nodes": float(len(set(self.learner.placement()))),
            "fleet/nodes": float(len(set(lead.engine.nodes()))),
            **lead.controller.placement_metrics(),
        }

    def describe_placement(self) -> str:
        """Where the parts run on the cluster, printed at the start of a run."""
        ranks, replicas = self.learner.placement(), self.lead.engine.nodes()
        lines = [
            f"on the Ray cluster at {self.cfg.cluster.address}:",
            f"learner: {len(ranks)} rank(s) on node(s) {_by_node(ranks)}",
            f"engine: {len(replicas)} replica(s) on node(s) {_by_node(replicas)}"
            if replicas
            else "engine: in the driver (no engine.replicas)",
            self.lead.controller.describe_placement(),
        ]
        return "\n".join(lines)

    # -- every rank ---------------------------------------------------------------------

    async def save(self) -> None:
        """A resumable checkpoint of the trainer and the loop; older ones beyond `checkpoint.keep` are deleted.
        Rank 0's pipeline waits between two rollouts meanwhile: the controller's state, and the rollouts queued
        but not trained yet, go into the checkpoint."""
        if self.pipeline is not None:
            queued = await self.pipeline.quiesce()
            self.state.controller = self.lead.controller.state(pending=[g for r in queued for g in r.groups])
        try:
            path = self.folder.checkpoint(self.state.iteration)
            await self.learner.save(path, self.state.model_dump(mode="json"))
            if self.lead is not None:
                for old in sorted(self.folder.checkpoints.glob("iter-*"))[: -self.cfg.checkpoint.keep]:
                    shutil.rmtree(old, ignore_errors=True)
        finally:
            if self.pipeline is not None:
                await self.pipeline.release()

    async def export(self) -> None:
        """The final policy as a Hugging Face folder, with its tokenizer."""
        await self.learner.export(self.folder.final)
        if self.lead is not None:
            self.lead.chat.tokenizer.save_pretrained(self.folder.final)

    async def _stoppable(self, work: Awaitable[T], controller: RolloutController) -> T:
        """Await a controller's iteration; once `stop` is set, end it early (its episodes stay parked)."""
        task = asyncio.ensure_future(work)  # started first, so it has reset its own stop flag
        watcher = asyncio.ensure_future(self.stop.wait())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                controller.stop()
            return await task
        finally:
            watcher.cancel()


@contextlib.asynccontextmanager
async def build(
    cfg: RunConfig, folder: RunDir, *, resume: bool, display: Display, stop: asyncio.Event
) -> AsyncIterator[Run]:
    """Every part of the run, closed again on the way out (env workers, sandboxes, the engine, the tracker)."""
    lead_rank = not dist.is_initialized() or dist.get_rank() == 0
    torch.manual_seed(cfg.seed)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    async with contextlib.AsyncExitStack() as stack:
        learner = await _learner(cfg, folder, stack)
        state, resumed = LoopState(), False
        if resume and (ckpt := folder.latest_checkpoint()) is not None:
            resumed = True
            state = LoopState.model_validate(await learner.load(ckpt))
            display.message(f"resumed from {ckpt}: iteration {state.iteration}, policy version {state.policy_version}")
            if lead_rank:
                folder.truncate_logs(state.iteration)
        lead = await _lead(cfg, folder, learner, state, stack, resumed=resumed) if lead_rank else None
        run = Run(cfg, folder, learner, weight_sync(learner, lead and lead.engine), state, display, stop, lead)
        if lead is not None and cfg.algo.routing_replay == "R3" and not lead.engine.capabilities.records_routing:
            raise ValueError(
                f"algo.routing_replay=R3 needs the engine's routing record, and the {lead.engine.name} "
                "engine returns none"
            )
        if cfg.algo.async_level and run.sync.in_place:
            raise ValueError(
                f"algo.async_level={cfg.algo.async_level} samples while the learner trains, and the "
                f"{run.sync.engine.name} engine samples with the learner's own module: give the engine "
                "its own weights (engine.replicas)"
            )
        if lead is not None and cfg.cluster.address is not None:
            display.message(run.describe_placement())
        if resumed:  # the engine, one version behind, gets the checkpoint's weights (a copy loaded the starting ones)
            await run.push_weights()
        if lead is not None:
            run.pipeline = await stack.enter_async_context(
                Pipeline(run._roll_out, k=cfg.algo.async_level, first=state.iteration, last=cfg.iterations, stop=stop)
            )
        yield run


async def _learner(cfg: RunConfig, folder: RunDir, stack: contextlib.AsyncExitStack) -> Learner:
    """The trainer in this process (a torchrun rank, or the only process), or with `cluster.address` its ranks as
    Ray actors placed by `cluster.learner` (Ray joined here first: the env workers and replicas go there too)."""
    if cfg.cluster.address is None:
        return LocalLearner(Trainer.build(cfg.trainer()), in_thread=bool(cfg.algo.async_level))
    if not ray.is_initialized():
        ray.init(address=cfg.cluster.address, include_dashboard=False, logging_level=logging.WARNING)
        stack.callback(ray.shutdown)
    # the ranks' working directory is Ray's: a local model folder goes by its absolute path
    model = cfg.model.model_copy(update={"path": resolve_path(cfg.model.path)})
    trainer = cfg.trainer().model_copy(update={"model": model})
    learner = await RayLearner.start(trainer, cfg.cluster.learner, run_dir=folder.path, threads=cfg.threads)
    stack.push_async_callback(learner.close)
    return learner


async def _lead(
    cfg: RunConfig,
    folder: RunDir,
    learner: Learner,
    state: LoopState,
    stack: contextlib.AsyncExitStack,
    *,
    resumed: bool,
) -> Lead:
    """The lead's parts: the engine, env workers and sandboxes, the evaluator, the run folder's writers."""
    path = resolve_path(cfg.model.path)
    chat = ChatFormat(AutoTokenizer.from_pretrained(path))
    # In one unsharded process an in-process engine may sample with the trainer's own module; otherwise the
    # engine loads its own copy.
    model = EngineModel(path=path, module=learner.shared_module, lora=cfg.model.lora, device=learner.engine_device)
    # resumed: one version behind, so that the sync of the checkpoint's weights brings it to the checkpoint's
    # version (the tokens a checkpoint holds keep their staleness)
    version = state.policy_version - resumed
    engine = build_engine(cfg.engine, model, version=version, seed=cfg.seed)
    engine = await stack.enter_async_context(engine)
    envs = cfg.cluster.envs if cfg.cluster.address is not None else None  # on a cluster: every Docker node
    controller = await stack.enter_async_context(RolloutController(cfg.rollout, engine, chat, placement=envs))
    # held-out evaluation on a cluster: one env worker per Docker node (eval.num_workers is for one machine)
    held_envs = envs.model_copy(update={"workers_per_node": 1}) if envs is not None else None
    held_out = (
        await stack.enter_async_context(
            HeldOutEval(
                cfg.eval,
                engine,
                chat,
                env=cfg.rollout.env,
                env_kwargs=cfg.rollout.env_kwargs,
                max_episode_tokens=cfg.rollout.max_episode_tokens,
                ray_address=cfg.rollout.ray_address,
                placement=held_envs,
            )
        )
        if cfg.eval.tasks
        else None
    )
    tracker = Tracker(folder, cfg.log, cfg.model_dump(mode="json"))
    stack.callback(tracker.close)
    chat.tokenizer.save_pretrained(folder.tokenizer)  # so the run's token ids read back as text
    restore_dropped = await controller.restore(state.controller) if state.controller else 0
    return Lead(engine, chat, controller, held_out, tracker, restore_dropped)


def _rollout_metrics(iteration: int, batch: RolloutBatch) -> dict[str, Any]:
    s = batch.stats
    trainable = [t for g in batch.groups for t in g.trainable]
    n = max(len(trainable), 1)
    return {
        "iteration": iteration,
        "rollout/reward": sum(t.outcome_reward for t in trainable) / n,
        "rollout/success_rate": sum(success(t) for t in trainable) / n,
        "rollout/turns": sum(len(t.turns) for t in trainable) / n,
        "rollout/tokens_per_s": s.tokens_per_s,
        "rollout/generated_tokens": s.generated_tokens,
        "rollout/episodes": s.episodes_finished,
        "rollout/groups": s.groups_finished,
        "rollout/parked": s.parked,
        "rollout/partial_trained": sum(len(t.policy_versions) > 1 for t in trainable),
        "rollout/dropped_stale": s.dropped_stale,
        "rollout/failed": s.failed,
        "rollout/retried": s.retried,
        "rollout/truncated": s.truncated,
        "rollout/max_staleness": s.max_staleness,
    }


def _by_node(nodes: list[str]) -> str:
    """ "abc123 (2), def456 (1)": how many of something each node holds."""
    return ", ".join(f"{n} ({k})" for n, k in Counter(nodes).items()) or "none"
