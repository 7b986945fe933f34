"""The setup of one `agentrl train` run: every part of the driver (agentrl/train/driver.py), made once.

`build` starts the learner (agentrl/train/learner.py: the trainer in this process; under torchrun, rank 0 of
the ranks torchrun started; with `cluster.address`, ranks as Ray actors), reads the loop state from the latest
checkpoint on resume, then makes the inference engine (`agentrl.engine.build_engine`), the rollout controller over
env workers, the held-out evaluator, the tracker, the weight sync for that engine, and the rollouts' pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

import ray
import torch
from transformers import AutoTokenizer

from agentrl.engine import EngineModel, build_engine
from agentrl.eval import HeldOutEval
from agentrl.models.default import resolve_path
from agentrl.rollout import ChatFormat, RolloutController
from agentrl.runs import RunDir
from agentrl.train.driver import Display, Driver, LoopState
from agentrl.train.learner import Learner, LocalLearner
from agentrl.train.pipeline import Pipeline
from agentrl.train.ray_learner import RayLearner
from agentrl.train.run_config import RunConfig
from agentrl.train.torchrun_learner import TorchrunLearner
from agentrl.train.tracking import Tracker
from agentrl.train.weight_sync import weight_sync


@contextlib.asynccontextmanager
async def build(
    cfg: RunConfig,
    folder: RunDir,
    *,
    resume: bool,
    display: Display,
    stop: asyncio.Event,
    learner: Learner | None = None,
) -> AsyncIterator[Driver]:
    """Every part of the run, closed again on the way out (env workers, sandboxes, the engine, the tracker, the
    learner's ranks). `learner`: one the caller started (and closes); None: the one `cfg` and the launcher say."""
    torch.manual_seed(cfg.seed)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    async with contextlib.AsyncExitStack() as stack:
        if learner is None:
            learner = await _learner(cfg, folder, stack)
        state, resumed = LoopState(), False
        if resume and (ckpt := folder.latest_checkpoint()) is not None:
            resumed = True
            state = LoopState.model_validate(await learner.load(ckpt))
            display.message(f"resumed from {ckpt}: iteration {state.iteration}, policy version {state.policy_version}")
        if resume:  # what was logged past the checkpoint (all of it, with none yet) is logged anew
            folder.truncate_logs(state.iteration)
        path = resolve_path(cfg.model.path)
        chat = ChatFormat(AutoTokenizer.from_pretrained(path))
        # The engine samples with the learner's own module where it can (one unsharded process) and the engine's
        # dtype is the learner's; otherwise it loads its own copy, in engine.dtype.
        shared = learner.shared_module if cfg.engine.dtype in ("auto", "float32") else None
        model = EngineModel(path=path, module=shared, lora=cfg.model.lora, device=learner.engine_device)
        # resumed: one version behind, so that the sync of the checkpoint's weights brings it to the checkpoint's
        # version (the tokens a checkpoint holds keep their staleness)
        engine = build_engine(cfg.engine_config(), model, version=state.policy_version - resumed, seed=cfg.seed)
        engine = await stack.enter_async_context(engine)
        if cfg.algo.routing_replay == "R3" and not engine.capabilities.records_routing:
            raise ValueError(
                f"algo.routing_replay=R3 needs the engine's routing record, and the {engine.name} engine returns none"
            )
        sync = weight_sync(learner, engine)
        if cfg.algo.async_level and sync.in_place:
            raise ValueError(
                f"algo.async_level={cfg.algo.async_level} samples while the learner trains, and the "
                f"{engine.name} engine samples with the learner's own module: give the engine "
                "its own weights (engine.replicas)"
            )
        envs = cfg.cluster.envs if cfg.cluster.address is not None else None  # on a cluster: every Docker node
        controller = RolloutController(cfg.rollout, engine, chat, placement=envs, sandbox=cfg.sandbox)
        controller = await stack.enter_async_context(controller)
        # held-out evaluation on a cluster: one env worker per Docker node (eval.num_workers is for one machine)
        held_envs = envs.model_copy(update={"workers_per_node": 1}) if envs is not None else None
        held_out = None
        if cfg.eval.tasks:
            held_out = HeldOutEval(
                cfg.eval,
                engine,
                chat,
                env=cfg.rollout.env,
                env_kwargs=cfg.rollout.env_kwargs,
                max_episode_tokens=cfg.rollout.max_episode_tokens,
                ray_address=cfg.rollout.ray_address,
                env_workers=cfg.rollout.env_workers,
                placement=held_envs,
                sandbox=cfg.sandbox,
                thinking=cfg.rollout.thinking,
                context=cfg.rollout.context,
            )
            held_out = await stack.enter_async_context(held_out)
        tracker = Tracker(folder, cfg.log, cfg.model_dump(mode="json"))
        stack.callback(tracker.close)
        chat.tokenizer.save_pretrained(folder.tokenizer)  # so the run's token ids read back as text
        run = Driver(cfg, folder, learner, engine, chat, controller, held_out, tracker, sync, state, display, stop)
        if state.controller is not None:
            run.restore_dropped = await controller.restore(state.controller)
        if cfg.cluster.address is not None:
            display.message(run.describe_placement())
        if resumed:  # the engine, one version behind, gets the checkpoint's weights (a copy loaded the starting ones)
            await run.push_weights()
        pipeline = Pipeline(run.roll_out, k=cfg.algo.async_level, first=state.iteration, last=cfg.iterations, stop=stop)
        run.pipeline = await stack.enter_async_context(pipeline)
        yield run


async def _learner(cfg: RunConfig, folder: RunDir, stack: contextlib.AsyncExitStack) -> Learner:
    """The learner `cfg` and the launcher say, closed with the run: with `cluster.address`, ranks as Ray actors
    placed by `cluster.learner` (Ray joined here first: the env workers and replicas go there too); under torchrun
    (its WORLD_SIZE), learner rank 0 of them; otherwise the trainer in this process."""
    in_thread = bool(cfg.algo.async_level)
    if cfg.cluster.address is not None:
        if not ray.is_initialized():
            ray.init(address=cfg.cluster.address, include_dashboard=False, logging_level=logging.WARNING)
            stack.callback(ray.shutdown)
        # the ranks' working directory is Ray's: a local model folder goes by its absolute path
        model = cfg.model.model_copy(update={"path": resolve_path(cfg.model.path)})
        trainer = cfg.trainer().model_copy(update={"model": model})
        learner = await RayLearner.start(trainer, cfg.cluster.learner, run_dir=folder.path, threads=cfg.threads)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        learner = TorchrunLearner.start(cfg.trainer(), threads=cfg.threads, in_thread=in_thread)
    else:
        learner = LocalLearner.start(cfg.trainer(), in_thread=in_thread)
    stack.push_async_callback(learner.close)
    return learner
