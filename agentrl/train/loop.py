"""One `agentrl train` run, top to bottom (DESIGN.md §2).

Setup builds the trainer (FSDP2 when launched on several ranks), the inference engine (on
one process the `hf` engine samples with the trainer's own module), the rollout controller
over env worker actors, the held-out evaluator and the tracker. Then every iteration:

    rollout    the controller plays groups of episodes until enough groups are complete;
               unfinished ones stay parked (partial rollouts) and continue next iteration
    advantages group-normalised, per turn or per episode (`build_batch`)
    update     M minibatches of GSPO-token (or GSPO / GRPO) against the engine's lp_b
    sync       the new weights reach the engine: policy version + 1
    log        metrics.jsonl (+ TensorBoard / W&B) and sampled trajectories
    evaluate   before iterations 0, K, 2K, ... (`eval.every`) and after the last: greedy, held out
    checkpoint every `checkpoint.every` iterations, on a graceful stop (Ctrl-C) and at the end

With several ranks (torchrun), rank 0 runs the engine, the rollouts, the evaluation and the
tracker; it broadcasts each batch and every rank takes its share of the update.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel
from transformers import AutoTokenizer

from agentrl.engine.base import InferenceEngine
from agentrl.eval import EvalResult, HeldOutEval, success
from agentrl.eval.bench import run_bench
from agentrl.models.default import resolve_path
from agentrl.rollout import ChatFormat, ControllerState, RolloutBatch, RolloutController
from agentrl.runs import RunDir
from agentrl.train import checkpoint
from agentrl.train.batch import TrainBatch, build_batch
from agentrl.train.policy import load_policy
from agentrl.train.run_config import RunConfig
from agentrl.train.tracking import Tracker, trained_views
from agentrl.train.trainer import Record, Trainer, sync_weights

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


async def train(cfg: RunConfig, run: RunDir, *, resume: bool = False, display: Display | None = None,
                stop: asyncio.Event | None = None) -> LoopState:  # fmt: skip
    """Run (with `resume`, continue) to `cfg.iterations`. Setting `stop` ends it gracefully: the
    rollouts in flight are parked, what finished is trained on, and a checkpoint is saved."""
    display, stop = display or Quiet(), stop or asyncio.Event()
    lead = not dist.is_initialized() or dist.get_rank() == 0
    torch.manual_seed(cfg.seed)
    # full fine-tuning's KL reference: the starting weights, from the model path (on resume too)
    reference = load_policy(cfg.model) if cfg.algo.kl_coef and cfg.model.lora is None else None
    trainer = Trainer(cfg.trainer(), load_policy(cfg.model), reference)
    state = LoopState()
    if resume and (ckpt := run.latest_checkpoint()) is not None:
        state = LoopState.model_validate(checkpoint.load(ckpt, trainer))
        display.message(f"resumed from {ckpt}: iteration {state.iteration}, policy version {state.policy_version}")
        if lead:
            run.truncate_logs(state.iteration)
    chat = ChatFormat(AutoTokenizer.from_pretrained(resolve_path(cfg.model.path)))
    engine = controller = held_out = tracker = None
    async with contextlib.AsyncExitStack() as stack:
        if lead:  # setup: the engine, env workers and sandboxes, the evaluator, the run folder's writers
            engine = await stack.enter_async_context(build_engine(cfg, trainer, version=state.policy_version))
            controller = await stack.enter_async_context(RolloutController(cfg.rollout, engine, chat))
            held_out = await stack.enter_async_context(HeldOutEval(
                cfg.eval, engine, chat, env=cfg.rollout.env, env_kwargs=cfg.rollout.env_kwargs,
                max_episode_tokens=cfg.rollout.max_episode_tokens, ray_address=cfg.rollout.ray_address))  # fmt: skip
            tracker = Tracker(run, cfg.log, cfg.model_dump(mode="json"))
            chat.tokenizer.save_pretrained(run.tokenizer)  # so the run's token ids read back as text
            stack.callback(tracker.close)
            restore_dropped = await controller.restore(state.controller) if state.controller else 0
        t_start, first = time.perf_counter() - state.elapsed_s, state.iteration
        for it in range(state.iteration, cfg.iterations):
            train_batch, update, saved, wanted = None, {}, [], set()
            if lead:
                if _eval_due(it, cfg.eval.every) and not stop.is_set():
                    _evaluate(tracker, display, await _stoppable(held_out.run(it), held_out.controller, stop))
                    await _benchmarks(cfg, engine, chat, tracker, display, it)
                t0 = time.perf_counter()
                batch = await _stoppable(controller.run_iteration(), controller, stop)  # 1. rollouts
                metrics = _rollout_metrics(it, batch) | {"rollout/restore_dropped": restore_dropped}
                restore_dropped, t1 = 0, time.perf_counter()
                try:
                    train_batch, info = build_batch(batch.groups, cfg.algo)  # 2. advantages
                    metrics |= {f"batch/{k}": v for k, v in vars(info).items()}
                except ValueError as e:  # nothing to learn from (every episode failed, or no signal)
                    display.message(f"iteration {it}: {e}; no update")
                saved = tracker.to_save(batch.groups)
                ids = {t.episode_id for t in saved}
                wanted = {i for i, e in enumerate(train_batch.episode_ids) if e in ids} if train_batch else set()
            train_batch = broadcast(train_batch)
            # what the update saw of the trajectories saved (all ranks take part: their rows are gathered)
            record = Record(broadcast(wanted)) if cfg.log.trajectories_per_iteration else None
            if train_batch is not None:
                update = _update(trainer, engine, train_batch, record)  # 3. GSPO-token update, M minibatches
                state.policy_version = broadcast(await sync_weights(trainer, engine))  # 4. weight sync
            stopping = broadcast(stop.is_set())
            state.iteration, state.elapsed_s = it + 1, time.perf_counter() - t_start
            if lead:  # 5. log
                t2 = time.perf_counter()
                left = state.elapsed_s / (state.iteration - first) * (cfg.iterations - state.iteration)
                metrics |= {f"train/{k}": v for k, v in update.items()} | {"policy_version": state.policy_version}
                metrics |= {"time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/elapsed_s": state.elapsed_s,
                            "time/left_s": left}  # fmt: skip
                tracker.log(metrics)
                tracker.save_trajectories(it, saved, trained_views(train_batch, record.stats) if record else {})
                display.iteration(metrics)
                if state.iteration == cfg.iterations:
                    _evaluate(tracker, display, await held_out.run(state.iteration))
                    await _benchmarks(cfg, engine, chat, tracker, display, state.iteration)
            done = state.iteration == cfg.iterations or stopping
            if done or (cfg.checkpoint.every and state.iteration % cfg.checkpoint.every == 0):
                _save(run, trainer, state, controller, cfg.checkpoint.keep)  # 6. checkpoint
            if stopping:
                display.message(f"stopped after iteration {it}; resume with: agentrl train --resume {run.path}")
                break
    if cfg.checkpoint.export_final and state.iteration == cfg.iterations:
        checkpoint.export_hf(trainer.scorer, run.final)
        if lead:
            chat.tokenizer.save_pretrained(run.final)
    return state


# -- the pieces the loop calls ---------------------------------------------------------


def build_engine(cfg: RunConfig, trainer: Trainer, *, version: int) -> InferenceEngine:
    """The engine of `cfg.engine`, starting at `version`. Without torch.distributed, `hf` shares the
    trainer's module; with it (a group of one included) rank 0's engine holds an fp32 copy."""
    e = cfg.engine
    if e.kind == "hf":
        from agentrl.engine.hf import HFEngine

        # Sharded weights (FSDP2, one rank included) cannot be sampled in place: rank 0 keeps a full
        # copy that sync_weights refreshes.
        model = load_policy(cfg.model).to(trainer.device) if dist.is_initialized() else trainer.policy
        return HFEngine(model.eval(), max_batch_size=e.max_batch_size, prefix_cache_tokens=e.prefix_cache_tokens,
                        record_routing=e.record_routing, seed=cfg.seed, version=version)  # fmt: skip
    if e.kind == "vllm":
        from agentrl.engine.vllm import VLLMEngine

        lora = trainer.policy.peft_config["default"] if cfg.model.lora else None  # the adapters vLLM will load
        return VLLMEngine(resolve_path(cfg.model.path), max_batch_size=e.max_batch_size, seed=cfg.seed,
                          version=version, lora=lora, **e.vllm)  # fmt: skip
    from agentrl.engine.openai import OpenAIEngine

    return OpenAIEngine(e.base_url)


def _update(trainer: Trainer, engine: InferenceEngine | None, batch: TrainBatch,
            record: Record | None) -> dict[str, float]:  # fmt: skip
    """The update, with no decode step of an engine that shares the module running meanwhile."""
    paused = engine.paused() if engine is not None and hasattr(engine, "paused") else contextlib.nullcontext()
    with paused:
        return trainer.update(batch.to(trainer.device), record)


async def _stoppable(work: Awaitable[T], controller: RolloutController, stop: asyncio.Event) -> T:
    """Await a controller's iteration; once `stop` is set, end it early (its episodes stay parked)."""
    task = asyncio.ensure_future(work)  # started first, so it has reset its own stop flag
    watcher = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            controller.stop()
        return await task
    finally:
        watcher.cancel()


def _eval_due(iteration: int, every: int) -> bool:
    return iteration % every == 0 if every else iteration == 0


def _evaluate(tracker: Tracker, display: Display, result: EvalResult) -> None:
    tracker.log_eval(result.model_dump(exclude={"episodes"}))
    display.evaluation(result)


async def _benchmarks(cfg: RunConfig, engine: InferenceEngine, chat: ChatFormat, tracker: Tracker, display: Display,
                      iteration: int) -> None:  # fmt: skip
    """`eval.benchmarks`: each an `agentrl eval` on the current weights, one bench.jsonl line each."""
    for b in cfg.eval.benchmarks:
        r = await run_bench(b, engine, chat)
        tracker.log_bench({"iteration": iteration, "env": b.env, **r.pass_at_k, "problems": r.problems,
                           "samples": r.samples, "infra_failed": r.infra_failed, "retried": r.retried,
                           "wall_s": r.wall_s})  # fmt: skip
        scores = ", ".join(f"{k} {100 * v:.1f}%" for k, v in r.pass_at_k.items())
        display.message(f"{b.env} @ iteration {iteration}: {scores} on {r.problems} problems ({r.wall_s:.0f} s)")


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


def _save(run: RunDir, trainer: Trainer, state: LoopState, controller: RolloutController | None, keep: int) -> None:
    """A resumable checkpoint of the trainer and the loop; older ones beyond `keep` are deleted."""
    if controller is not None:
        state.controller = controller.state()
    path = run.checkpoint(state.iteration)
    checkpoint.save(path, trainer, state.model_dump(mode="json"))
    if trainer.rank == 0:
        for old in sorted(run.checkpoints.glob("iter-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def broadcast(obj: T) -> T:
    """Rank 0's `obj` on every rank (itself when not distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
