"""Per-step overhead of the environment layer above the sandbox call, and many concurrent episodes.

Measures, in one run, for `--env code_sandbox` (default) or `--env repo_fix`:

- serial: one env steps one cheap tool call `--steps` times (code_sandbox: `run_python("print(sum(range(10)))")`;
  repo_fix: `bash("echo $PWD")`, whose shell state is restored and saved around it); each step's wall time, the
  part spent in sandbox calls (`env.sandbox_s`), and the rest: parsing the tool call, validating arguments,
  formatting the observation, bookkeeping. Baseline in the same run: the bare sandbox call of the same program.
- concurrent: `--episodes` episodes at once from one event loop and one pool, with the same per-step split, the
  wall time of the whole batch, the rewards, and the agentrl containers of this process left afterwards (must be
  0). code_sandbox: reset, a run_python step, a submit of the reference solution graded on 10 hidden tests.
  repo_fix: the scripted expert (view the file, edit it, sometimes run the visible tests, submit: its diff graded
  by the hidden tests in a new sandbox).
- gradings (repo_fix): `--gradings` expert episodes one after another, the wall time of each `submit` step (the
  grading of its diff in a fresh sandbox); `--only-gradings` measures these alone.

Prints one JSON object. Run: `python benchmarks/env_bench.py` (about a minute), or `--quick`.
Needs a Docker engine and the sandbox image (`agentrl sandbox build`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import harness

import agentrl
from agentrl.env import SandboxSource
from agentrl.env.repos import bash_argv
from agentrl.sandbox import DockerSandbox, SandboxPool, reaper
from agentrl.sandbox.docker_sandbox import docker_client
from agentrl.sandbox.image import image_exists, image_tag

CODE = "print(sum(range(10)))"
ACTIONS = {
    "code_sandbox": '<tool_call>{"name": "run_python", "arguments": {"code": "print(sum(range(10)))"}}</tool_call>',
    "repo_fix": '<tool_call>{"name": "bash", "arguments": {"command": "echo $PWD"}}</tool_call>',
}


def bare(env_name: str, sandbox):
    """The sandbox call under one serial step, made directly."""
    if env_name == "repo_fix":
        return sandbox.run(bash_argv("echo $PWD"))
    return sandbox.run_python(CODE)


def ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "p50_ms": round(1000 * statistics.median(xs), 3),
        "p95_ms": round(1000 * xs[min(len(xs) - 1, int(0.95 * len(xs)))], 3),
        "mean_ms": round(1000 * statistics.fmean(xs), 3),
    }


async def serial(env_name: str, steps: int) -> dict:
    pool = SandboxPool(DockerSandbox.create, size=1)
    env = agentrl.make(env_name, sandboxes=SandboxSource(pool), max_turns=steps + 20)
    action = ACTIONS[env_name]
    try:
        await env.areset(seed=0)
        sandbox = await env.sandbox()
        direct, wall, inside = [], [], []
        for _ in range(10):  # warm-up of both paths
            await bare(env_name, sandbox)
            await env.astep(action)
        await env.areset(seed=0)
        sandbox = await env.sandbox()
        for _ in range(steps):
            t0 = time.perf_counter()
            await bare(env_name, sandbox)
            direct.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await env.astep(action)
            wall.append(time.perf_counter() - t0)
            inside.append(env.sandbox_s)
    finally:
        await env.aclose()
        await pool.close()
    overhead = [w - s for w, s in zip(wall, inside, strict=True)]
    return {
        "bare_call": ms(direct),
        "env_step": ms(wall),
        "of_which_sandbox": ms(inside),
        "of_which_env_overhead": ms(overhead),
        "step_over_bare_p50_ratio": round(statistics.median(wall) / statistics.median(direct), 3),
    }


async def gradings(episodes: int) -> dict:
    """repo_fix's grading alone: `episodes` scripted-expert episodes one after another on one warm sandbox, the wall
    time of each `submit` step (a fresh sandbox, the diff placed, the hidden tests run and judged), and its
    reward."""
    pool = SandboxPool(DockerSandbox.create, size=1)
    submits, rewards = [], []
    try:
        for i in range(episodes):
            env = agentrl.make("repo_fix", sandboxes=SandboxSource(pool))
            await env.areset(seed=i)
            *work, submit = env.demonstration(env.task, random.Random(i))
            for action in work:
                await env.astep(action)
            t0 = time.perf_counter()
            _, reward, *_ = await env.astep(submit)
            submits.append(time.perf_counter() - t0)
            rewards.append(reward)
            await env.aclose()
    finally:
        await pool.close()
    return {"episodes": episodes, "submit_step": ms(submits), "rewards_mean": statistics.fmean(rewards)}


async def concurrent(env_name: str, episodes: int, pool_size: int) -> dict:
    client = docker_client()
    mine = {"label": f"{reaper.SESSION_LABEL}={reaper.SESSION_ID}"}
    steps: list[tuple[float, float]] = []
    rewards: list[float] = []

    async def episode(i: int, source: SandboxSource) -> None:
        env = agentrl.make(env_name, sandboxes=source)
        await env.areset(seed=i)
        if env_name == "repo_fix":
            actions = env.demonstration(env.task, random.Random(i))
        else:
            submit = json.dumps({"name": "submit", "arguments": {"code": env.task_set.reference_solution(env.task)}})
            actions = [ACTIONS[env_name], f"<tool_call>{submit}</tool_call>"]
        total = 0.0
        for action in actions:
            t0 = time.perf_counter()
            _, reward, *_ = await env.astep(action)
            steps.append((time.perf_counter() - t0, env.sandbox_s))
            total += reward
        rewards.append(total)
        await env.aclose()

    pool = SandboxPool(DockerSandbox.create, size=pool_size)
    t0 = time.perf_counter()
    try:
        await pool.start()
        started = time.perf_counter()
        await asyncio.gather(*(episode(i, SandboxSource(pool)) for i in range(episodes)))
        ran = time.perf_counter() - started
    finally:
        await pool.close()
    total = time.perf_counter() - t0
    return {
        "episodes": episodes,
        "pool_size": pool_size,
        "wall_s_episodes": round(ran, 2),
        "wall_s_with_pool_start_and_close": round(total, 2),
        "rewards_mean": statistics.fmean(rewards),
        "step": ms([w for w, _ in steps]),
        "of_which_sandbox": ms([s for _, s in steps]),
        "of_which_env_overhead": ms([w - s for w, s in steps]),
        "containers_left": len(client.api.containers(all=True, filters=mine)),
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", choices=sorted(ACTIONS), default="code_sandbox")
    p.add_argument("--quick", action="store_true", help="few repetitions: a smoke run")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--pool-size", type=int, default=8)
    p.add_argument("--gradings", type=int, default=30, help="repo_fix: serial episodes whose grading is timed")
    p.add_argument("--only-gradings", action="store_true", help="repo_fix: measure the gradings alone")
    args = p.parse_args()
    if args.quick:
        args.steps, args.episodes, args.gradings = 20, 10, 5
    if not image_exists(docker_client(), image_tag()):
        raise SystemExit(f"no image {image_tag()}: run `agentrl sandbox build` first")
    load = os.getloadavg()
    result = {"machine": harness.machine() | {"load_before": load}, "image": image_tag(), "env": args.env}
    if args.env == "repo_fix":
        result["gradings"] = await gradings(args.gradings)
    if not args.only_gradings:
        result["serial"] = await serial(args.env, args.steps)
        result["concurrent"] = await concurrent(args.env, args.episodes, args.pool_size)
    result["machine"]["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
