"""The driver: the one process that runs `agentrl train`'s loop, and the steps of an iteration it takes.

The driver holds every part but the learner's ranks: the inference engine (or fleet), the rollout controller over
env workers, the held-out evaluator, the tracker and the weight sync; `agentrl/train/build.py` makes them. The
learner is one interface (agentrl/train/learner.py) wherever its ranks are: batches go out, metrics and weights
come back. The rollouts run in a `Pipeline` (agentrl/train/pipeline.py), up to `algo.async_level` policy versions
ahead of the learner.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from agentrl.engine import InferenceEngine
from agentrl.eval import EvalResult, HeldOutEval, success
from agentrl.eval.bench import run_bench
from agentrl.rollout import ChatFormat, ControllerState, Group, RolloutBatch, RolloutController, Trajectory
from agentrl.runs import RunDir
from agentrl.train.batch import TrainBatch, build_batch
from agentrl.train.diagnostics import RowRecorder
from agentrl.train.learner import Learner
from agentrl.train.pipeline import Pipeline
from agentrl.train.run_config import RunConfig
from agentrl.train.tracking import Tracker
from agentrl.train.weight_sync import WeightSync

T = TypeVar("T")


class LoopState(BaseModel):
    """What a checkpoint keeps of the loop (its `state.json`), besides the trainer's tensors."""

    iteration: int = 0
    """the next iteration to run (== iterations done)"""
    policy_version: int = 0
    elapsed_s: float = 0.0
    controller: ControllerState | None = None
    """the task cursor and the partial-rollout buffer"""


class Display:
    """What a run shows as it goes (`agentrl train`'s progress bar overrides these); by itself, nothing."""

    def iteration(self, metrics: dict[str, Any]) -> None:
        """One iteration's metrics, as logged."""

    def evaluation(self, result: EvalResult) -> None:
        """A held-out evaluation's result."""

    def message(self, text: str) -> None:
        """A note for the user (a resume, a stop, an iteration with nothing to learn from)."""


@dataclass
class Rollout:
    """One iteration's rollouts as the update takes them."""

    batch: TrainBatch | None
    """None when there was nothing to learn from"""
    recorder: RowRecorder | None
    """the rows of the saved trajectories, recorded by the update"""
    saved: list[Trajectory] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)
    """the complete groups the batch was built from"""


@dataclass
class Driver:
    cfg: RunConfig
    folder: RunDir
    learner: Learner
    engine: InferenceEngine
    chat: ChatFormat
    controller: RolloutController
    held_out: HeldOutEval | None
    """None: eval.tasks = 0"""
    tracker: Tracker
    sync: WeightSync
    state: LoopState
    display: Display
    stop: asyncio.Event
    pipeline: Pipeline[Rollout] | None = None
    """the rollouts, started by `build` once the engine has the checkpoint's weights"""
    restore_dropped: int = 0
    """parked episodes a resume could not rebuild, reported with the first iteration"""
    first: int = 0
    """the iteration this process started at (a resume's)"""
    t_start: float = field(default_factory=time.perf_counter)
    """when the run started, as if it had never stopped (a resume's elapsed time counts)"""
    before_s: float = 0.0
    """the run's elapsed time before this process (a resume's)"""

    def __post_init__(self) -> None:
        self.first, self.before_s = self.state.iteration, self.state.elapsed_s
        self.t_start -= self.state.elapsed_s

    def checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every) and self.state.iteration % every == 0

    def saved(self) -> bool:
        """The run's latest finished checkpoint is of the current iteration (a resume's, or one saved since)."""
        return self.folder.latest_checkpoint() == self.folder.checkpoint(self.state.iteration)

    # -- the steps of an iteration --------------------------------------------------------

    async def rollout(self, iteration: int) -> Rollout:
        """Groups of episodes until enough are complete (the rest stay parked), with their advantages: from the
        pipeline, where they were rolled out meanwhile when asynchronous."""
        r = await self.pipeline.next(iteration)
        self._check_staleness(r.groups)
        return r

    async def roll_out(self, iteration: int, ahead: int) -> Rollout:
        """The pipeline's producer: iteration `iteration`'s episodes (`ahead`: the weight syncs that may still
        come before it is trained), the batch the update takes, and the rows of the trajectories the run saves."""
        t0 = time.perf_counter()
        work = self.controller.run_iteration(ahead=ahead)
        episodes = await self._stoppable(work, self.controller)
        metrics = _rollout_metrics(iteration, episodes) | {"rollout/restore_dropped": self.restore_dropped}
        self.restore_dropped = 0
        batch = recorder = None
        try:
            batch, info = build_batch(episodes.groups, self.cfg.algo)
            metrics |= {f"batch/{k}": v for k, v in vars(info).items() if v is not None}
        except ValueError as e:  # nothing to learn from (every episode failed, or no signal)
            self.display.message(f"iteration {iteration}: {e}; no update")
        saved = self.tracker.to_save(episodes.groups)
        if batch is not None and self.cfg.log.trajectories_per_iteration:
            ids = {t.episode_id for t in saved}
            recorder = RowRecorder({i for i, e in enumerate(batch.episode_ids) if e in ids}, self.cfg.algo)
        metrics["time/rollout_s"] = time.perf_counter() - t0
        return Rollout(batch, recorder, saved, metrics, episodes.groups)

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

    async def push_weights(self) -> float:
        """The new weights to the engine: policy version + 1. Returns its seconds."""
        t0 = time.perf_counter()
        self.state.policy_version = await self.sync.push()
        return time.perf_counter() - t0

    async def evaluate(self, iteration: int, *, final: bool = False) -> None:
        """Held-out success (greedy, the env's test split) and `eval.benchmarks`, on the current weights."""

        def stopped() -> bool:  # the loop stops before the iteration, and a resume evaluates it again
            return self.stop.is_set() and not final

        if stopped():
            return
        if self.held_out is not None:
            work = self.held_out.run(iteration)
            result = await (work if final else self._stoppable(work, self.held_out.controller))
            if stopped():
                return  # cut short: the tasks it left parked would be missing from its score
            self.tracker.log_eval(result.model_dump(exclude={"episodes"}))
            self.display.evaluation(result)
        for b in self.cfg.eval.benchmarks:
            if stopped():
                return
            r = await run_bench(
                b, self.engine, self.chat, sandbox=self.cfg.sandbox, env_workers=self.cfg.rollout.env_workers
            )
            self.tracker.log_bench(
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
        """The iteration's time (kept in the state), metrics.jsonl (and TensorBoard / W&B), the saved trajectories
        with what the update saw of them, the display."""
        s = self.state
        s.elapsed_s = time.perf_counter() - self.t_start
        # at this process's pace: a resume's earlier time is spread over its earlier iterations, not these
        left = (s.elapsed_s - self.before_s) / (s.iteration - self.first) * (self.cfg.iterations - s.iteration)
        metrics = rollout.metrics | {f"train/{k}": v for k, v in update.items()} | {"policy_version": s.policy_version}
        metrics |= {f"time/{k}": v for k, v in times.items()} | {"time/elapsed_s": s.elapsed_s, "time/left_s": left}
        metrics["time/rollout_idle_s"] = self.pipeline.idle_s  # so far: the rollouts waiting for the learner
        metrics |= self.engine.metrics()  # a fleet's counters, so far
        metrics |= self.placement_metrics() | self.learner.metrics()
        self.tracker.log(metrics)
        views = rollout.recorder.views(rollout.batch) if rollout.recorder is not None else {}
        self.tracker.save_trajectories(s.iteration - 1, rollout.saved, views)
        self.display.iteration(metrics)

    def placement_metrics(self) -> dict[str, float]:
        """On a cluster: how many distinct nodes hold learner ranks, engine replicas and env workers now."""
        if self.cfg.cluster.address is None:
            return {}
        return {
            "learner/nodes": float(len(set(self.learner.placement()))),
            "fleet/nodes": float(len(set(self.engine.nodes()))),
            **self.controller.placement_metrics(),
        }

    def describe_placement(self) -> str:
        """Where the parts run on the cluster, printed at the start of a run."""
        ranks, replicas = self.learner.placement(), self.engine.nodes()
        lines = [
            f"on the Ray cluster at {self.cfg.cluster.address}:",
            f"learner: {len(ranks)} rank(s) on node(s) {_by_node(ranks)}",
            f"engine: {len(replicas)} replica(s) on node(s) {_by_node(replicas)}"
            if replicas
            else "engine: in the driver (no engine.replicas)",
            self.controller.describe_placement(),
        ]
        return "\n".join(lines)

    async def save(self) -> None:
        """A resumable checkpoint of the learner and the loop; older ones beyond `checkpoint.keep` are deleted.
        The pipeline waits between two rollouts meanwhile: the controller's state, and the rollouts queued but
        not trained yet, go into the checkpoint."""
        queued = await self.pipeline.quiesce()
        self.state.controller = self.controller.state(pending=[g for r in queued for g in r.groups])
        try:
            await self.learner.save(self.folder.checkpoint(self.state.iteration), self.state.model_dump(mode="json"))
            for old in sorted(self.folder.checkpoints.glob("iter-*"))[: -self.cfg.checkpoint.keep]:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            await self.pipeline.release()

    async def export(self) -> None:
        """The final policy as a Hugging Face folder, with its tokenizer."""
        await self.learner.export(self.folder.final)
        self.chat.tokenizer.save_pretrained(self.folder.final)

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
            if not task.done():  # cancelled ourselves (a failure elsewhere, a second Ctrl-C): the iteration ends
                task.cancel()  # here, before its controller closes, not driving episodes on a closed pool
                await asyncio.gather(task, return_exceptions=True)


def _rollout_metrics(iteration: int, batch: RolloutBatch) -> dict[str, Any]:
    s = batch.stats
    trainable = [t for g in batch.groups for t in g.trainable]
    n = max(len(trainable), 1)
    return {
        "iteration": iteration,
        "rollout/reward": sum(t.outcome_reward for t in trainable) / n,
        "rollout/success_rate": sum(success(t) for t in trainable) / n,
        "rollout/turns": sum(len(t.turns) for t in trainable) / n,
        "rollout/sequences": sum(len(t.sequences) + 1 for t in trainable) / n,
        "rollout/folds": sum(s.reason == "fold" for t in trainable for s in t.sequences),
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
        "rollout/rewritten": s.rewritten,
        "rollout/max_staleness": s.max_staleness,
    }


def _by_node(nodes: list[str]) -> str:
    """ "abc123 (2), def456 (1)": how many of something each node holds."""
    return ", ".join(f"{n} ({k})" for n, k in Counter(nodes).items()) or "none"
