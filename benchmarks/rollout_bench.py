"""Rollout throughput and partial rollouts, measured against baselines in the same run.

1. Throughput: the controller (Ray env workers, continuous-batching hf engine, Docker
   sandboxes) against a naive loop, one episode at a time with `model.generate` per turn
   (re-rendering the chat each turn), on the same tiny model, env and sandbox setup.
2. Long tail: episode lengths drawn from a power law of turns (most short, a few very
   long); iteration wall time with partial rollouts on and off, the policy version bumped
   between iterations as training would; then everything left is drained to show that
   nothing was lost. With partial rollouts an iteration returns every group complete at its
   end, which can be more than its target, so the time is also given per target's worth of
   groups (`s_per_target_batch`): the same amount of training data both ways.

    python benchmarks/rollout_bench.py            # prints one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time
import zlib
from pathlib import Path

import ray
import torch

import agentrl
from agentrl.engine import EngineConfig, EngineModel, SamplingParams, build_engine
from agentrl.envs.code_sandbox import CodeSandboxEnv
from agentrl.models.tiny import tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat, RolloutConfig, RolloutController

ROOT = Path(__file__).resolve().parents[1]


class LongTailCodeSandbox(CodeSandboxEnv):
    """code_sandbox whose turn limit is drawn per task from a power law: P(k turns) ∝ k^-2, k = 1..MAX_TURNS."""

    MAX_TURNS = 24

    async def _reset(self, task):
        weights = [k**-2 for k in range(1, self.MAX_TURNS + 1)]
        u = (zlib.crc32(task.id.encode()) + 0.5) / 2**32 * sum(weights)
        k = next(k for k, c in enumerate(itertools.accumulate(weights), 1) if u <= c)
        self.cfg = self.cfg.model_copy(update={"max_turns": k})
        return await super()._reset(task)


agentrl.register("longtail_code", "benchmarks.rollout_bench:LongTailCodeSandbox")


async def controller_run(model, cfg: RolloutConfig, iterations: int, *, bump: bool) -> dict:
    chat = ChatFormat(load_tokenizer())
    engine = build_engine(EngineConfig(), EngineModel(module=model))  # samples with `model` itself, as a run's does
    async with engine, RolloutController(cfg, engine, chat) as ctl:
        # warm-up outside the clock: actors import their envs and fill their sandbox pools, the engine thread starts
        await asyncio.gather(*(w.start_sandboxes() for w in ctl.workers))
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=4))
        walls, tokens, episodes = [], 0, 0
        for _ in range(iterations):
            b = await ctl.run_iteration()
            walls.append(b.stats.wall_s)
            tokens += b.stats.generated_tokens
            episodes += len(b.trajectories)
            if bump:
                await engine.update_weights()  # a shared model: training would have changed it in place
        t0 = time.perf_counter()
        drained = await ctl.run_iteration(drain=True)
        drain_s = time.perf_counter() - t0
        finished = episodes + len(drained.trajectories)
        lost = drained.stats.dropped_stale + drained.stats.failed
        return {
            "iteration_wall_s": walls,
            "mean_iteration_s": sum(walls) / len(walls),
            "tokens_per_s": tokens / sum(walls),
            "episodes_per_min": 60 * episodes / sum(walls),
            "episodes_returned_in_iterations": episodes,
            "s_per_target_batch": sum(walls) / (episodes / cfg.group_size) * cfg.groups_per_iteration,
            "episodes_after_drain": finished,
            "drain_s": drain_s,
            "lost": lost,
            "max_staleness_drained": drained.stats.max_staleness,
            "prompt_tokens_prefilled": engine.prefilled_tokens,
            "prompt_tokens_from_prefix_cache": engine.cached_tokens,
        }


async def naive_run(model, episodes: int, env_kwargs: dict, max_tokens: int) -> dict:
    """One episode at a time; each turn re-renders the chat and calls model.generate."""
    tok = load_tokenizer()
    env = agentrl.make("code_sandbox", **env_kwargs)
    await env.areset(seed=0)
    await env.sandbox()  # warm-up outside the clock: fills its sandbox pool
    tokens, t0 = 0, time.perf_counter()
    for ep in range(episodes):
        messages, info = await env.areset(seed=ep)
        done = False
        while not done:
            ids = tok.apply_chat_template(
                messages, tools=info["tools"], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            out = model.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            new = out[0, ids.shape[1] :]
            tokens += new.numel()
            text = tok.decode(new, skip_special_tokens=True)
            obs, _, terminated, truncated, _ = await env.astep(text)
            messages += [{"role": "assistant", "content": text}, *obs]
            done = terminated or truncated
    await env.aclose()
    wall = time.perf_counter() - t0
    return {
        "episodes": episodes,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "episodes_per_min": 60 * episodes / wall,
    }


async def main(args) -> dict:
    # imported here, not at the top: Ray's env workers import this module as benchmarks.rollout_bench (the
    # longtail env), and there benchmarks/ is not on sys.path
    import harness

    model = tiny_model("qwen3_moe", seed=0)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    env_kwargs = {"max_turns": args.turns}
    base = dict(
        group_size=args.group_size,
        num_workers=2,
        sandboxes_per_worker=8,
        sampling=sampling,
        max_episode_tokens=4096,
        seed=0,
    )

    torch.manual_seed(0)  # model.generate samples from the global generator
    naive = await naive_run(model, args.naive_episodes, env_kwargs, args.max_tokens)
    ctl = await controller_run(
        model,
        RolloutConfig(
            env="code_sandbox", env_kwargs=env_kwargs, groups_per_iteration=args.groups, partial=False, **base
        ),
        2,
        bump=False,
    )

    tail_env = "benchmarks.rollout_bench:longtail_code"
    tail = dict(env=tail_env, groups_per_iteration=args.tail_groups, max_staleness=args.tail_iterations, **base)
    off = await controller_run(model, RolloutConfig(partial=False, **tail), args.tail_iterations, bump=True)
    on = await controller_run(model, RolloutConfig(partial=True, **tail), args.tail_iterations, bump=True)
    return {
        "machine": harness.machine("torch"),
        "model": "tiny qwen3_moe (random init), fp32 CPU",
        "throughput": {
            "controller": ctl,
            "naive": naive,
            "tokens_per_s_ratio": ctl["tokens_per_s"] / naive["tokens_per_s"],
            "episodes_per_min_ratio": ctl["episodes_per_min"] / naive["episodes_per_min"],
        },
        "long_tail": {
            "partial_off": off,
            "partial_on": on,
            "iteration_time_cut": 1 - on["mean_iteration_s"] / off["mean_iteration_s"],
            "iteration_time_cut_same_data": 1 - on["s_per_target_batch"] / off["s_per_target_batch"],
        },
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--naive-episodes", type=int, default=16)
    p.add_argument("--tail-groups", type=int, default=4)
    p.add_argument("--tail-iterations", type=int, default=12)
    args = p.parse_args()
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    ray.init(
        include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
    )
    try:
        print(json.dumps(asyncio.run(main(args)), indent=2))
    finally:
        ray.shutdown()
