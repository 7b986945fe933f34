"""One `agentrl train` run, top to bottom (docs/design.md, "One iteration").

This process is the driver: it runs the loop, and its learner takes the batches wherever its ranks are.
`build` (agentrl/train/build.py) makes the parts: the learner, the engine, the rollout controller over env
worker actors, the held-out evaluator, the tracker and the weight sync. Then every iteration:

    rollout    groups of episodes until enough are complete; unfinished ones stay parked (partial
               rollouts) and continue next iteration; their advantages, group-normalised, per turn.
               With `algo.async_level` k >= 1 the next rollouts (up to k ahead) run meanwhile
    update     M minibatches of GSPO-token (or GSPO / GRPO) against the engine's lp_b
    sync       the new weights reach the engine: policy version + 1 (sampling goes on, when asynchronous)
    log        metrics.jsonl (+ TensorBoard / W&B) and sampled trajectories
    evaluate   before iterations 0, K, 2K, ... (`eval.every`) and after the last: greedy, held out
    checkpoint every `checkpoint.every` iterations, on a graceful stop (Ctrl-C) and at the end
"""

from __future__ import annotations

import asyncio
import time

from agentrl.runs import RunDir
from agentrl.train.build import build
from agentrl.train.driver import Display, LoopState
from agentrl.train.learner import Learner
from agentrl.train.run_config import RunConfig


async def train(
    cfg: RunConfig,
    folder: RunDir,
    *,
    resume: bool = False,
    display: Display | None = None,
    stop: asyncio.Event | None = None,
    learner: Learner | None = None,
) -> LoopState:
    """Run (with `resume`, continue) to `cfg.iterations`. Setting `stop` ends it gracefully: the
    rollouts in flight are parked, what finished is trained on, and a checkpoint is saved.
    `learner`: one the caller started (and closes); None: the one `cfg` and the launcher say."""
    display, stop = display or Display(), stop or asyncio.Event()
    async with build(cfg, folder, resume=resume, display=display, stop=stop, learner=learner) as run:
        state = run.state
        if resume:
            run.tracker.resume(state.iteration)
        resume_with = f"resume with: agentrl train --resume {folder.path}"
        if state.iteration == cfg.iterations:  # a finished run resumed: its final evaluation, logged before its
            await run.evaluate(state.iteration, final=True)  # checkpoint, went with the logs from it on
        for it in range(state.iteration, cfg.iterations):
            if it % cfg.eval.every == 0 if cfg.eval.every else it == 0:
                await run.evaluate(it)  # held-out success (greedy) and benchmarks
            # stopped since the last update (as it was logged or saved), while starting or while evaluating (cut short:
            # not logged): the run ends at this iteration's checkpoint, which a resume evaluates and runs whole
            if stop.is_set():
                if not run.saved():
                    await run.save()
                display.message(f"stopped before iteration {it}; {resume_with}")
                break
            t0 = time.perf_counter()
            rollout = await run.rollout(it)  # 1. episodes in sandboxes, and their advantages
            t1, update, sync_s = time.perf_counter(), {}, 0.0
            if rollout.batch is not None:
                update = await run.update(rollout)  # 2. M minibatch steps of GSPO-token
                sync_s = await run.push_weights()  # 3. weight sync: policy version + 1
            stopping, state.iteration = stop.is_set(), it + 1
            times = {"wait_s": t1 - t0, "update_s": time.perf_counter() - t1 - sync_s, "sync_s": sync_s}
            run.log(rollout, update, times)  # 4. metrics, trajectories
            if state.iteration == cfg.iterations:
                await run.evaluate(state.iteration, final=True)
            if state.iteration == cfg.iterations or stopping or run.checkpoint_due():
                await run.save()  # 5. checkpoint
            if stopping:
                display.message(f"stopped after iteration {it}; {resume_with}")
                break
        if cfg.checkpoint.export_final and state.iteration == cfg.iterations:
            await run.export()
    return state
