"""Env workers as processes of the driver (`rollout.env_workers: local`): the env-worker pool's contract on real
worker processes and real bubblewrap sandboxes, with no Ray and no Docker. `agentrl eval` and `agentrl train` run on
them in tests/engine/test_plugin_engine.py."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ownership import bwrap_trees as trees

from agentrl.engine.base import SamplingParams
from agentrl.engine.hf import HFEngine
from agentrl.models.tiny import tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat, RolloutConfig, RolloutController, Status, WorkerDied, WorkerError
from agentrl.sandbox import SandboxConfig, reaper

BWRAP = SandboxConfig(backend="bwrap")


async def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


RUN = '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'


async def test_a_killed_worker_is_replaced_its_episodes_retried_and_its_sandboxes_removed(bwrap_runtime):
    engine = HFEngine(tiny_model("qwen3_moe", seed=0))
    cfg = RolloutConfig(
        env="code_sandbox",
        env_kwargs={"max_turns": 3, "tasks": "procedural:levels=1;families=lists"},
        group_size=2,
        groups_per_iteration=1,
        num_workers=2,
        sandboxes_per_worker=1,
        sampling=SamplingParams(max_tokens=16),
        max_episode_tokens=2000,
        partial=False,
        env_workers="local",
    )
    async with engine, RolloutController(cfg, engine, ChatFormat(load_tokenizer("qwen3")), sandbox=BWRAP) as ctl:
        victim, other = ctl.workers
        assert [ctl.pool.pick() for _ in range(4)] == [victim, other, victim, other]  # round robin
        # the env raising in a live worker (no such episode) is a WorkerError, and nothing is replaced
        with pytest.raises(WorkerError) as err:
            await other.step("no-such-episode", "hi")
        assert not isinstance(err.value, WorkerDied) and "no-such-episode" in str(err.value)
        # an episode of our own on the victim, holding a sandbox when the kill lands
        (task,) = await ctl.pool.sample_tasks(1, 0)
        await victim.reset("ours", task, 0)
        ran = await victim.step("ours", RUN)
        assert "42" in ran[0][0]["content"] and trees(bwrap_runtime, victim.pid)

        iteration = asyncio.create_task(ctl.run_iteration())
        # an episode of the iteration on the victim is generating: its next env step is the victim's (an episode that
        # ended before the kill, under a slow machine's timing, would leave nothing for the kill to fail)
        await until(lambda: any(ep.generating and ep.worker is victim for ep in ctl._live()))
        os.kill(victim.pid, signal.SIGKILL)
        batch = await asyncio.wait_for(iteration, 300)

        fresh = ctl.workers[0]
        assert fresh is not victim and ctl.workers[1] is other  # its slot, a new process
        with pytest.raises(WorkerDied, match="killed by signal 9"):  # a call still holding it: not replaced twice
            await victim.step("ours", RUN)
        await victim.close("ours")  # its envs went with it: closing one is a no-op
        assert ctl.workers == [fresh, other]
        # the replacement serves: our episode rebuilt on it by replay, in a sandbox of its own, then continued
        _, _, steps = await fresh.replay("ours", task, 0, [RUN])
        assert [s[:4] for s in steps] == [tuple(ran[:4])] and trees(bwrap_runtime, fresh.pid)
        assert "42" in (await fresh.step("ours", RUN))[0][0]["content"]
        await until(lambda: not trees(bwrap_runtime, victim.pid))  # the victim's, removed once its process was gone
        pids = [victim.pid, fresh.pid, other.pid]
    trajs = batch.trajectories
    assert len(trajs) == 2 and batch.stats.groups_finished == 1
    # the killed worker held one of the two episodes (round robin): it was retried, and both finished
    assert batch.stats.retried == 1 and all(t.status is Status.FINISHED for t in trajs)
    assert not trees(bwrap_runtime), "closed: no worker's sandbox is left"
    assert not any(reaper.process_alive(p) for p in pids)
    await ctl.pool.close()  # safe twice


@pytest.mark.slow  # the fast tier is at its budget
async def test_episodes_parked_with_their_sandboxes_never_starve_the_stop(bwrap_runtime, monkeypatch):
    """With sandbox reuse the pool caps its live sandboxes (2 x its size), and a parked episode keeps its sandbox until
    the next iteration. Four one-episode groups on one worker of one sandbox, each taking its sandbox at reset: once
    the first group ends the iteration, the others hold or wait for one. Every wait is answered (it used to wait for
    a sandbox only a parked episode could give back: the iteration never ended)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the env workers import parking_envs
    cfg = RolloutConfig(
        env="parking_envs:holds_from_reset",
        group_size=1,
        groups_per_iteration=1,
        max_groups_in_flight=4,
        num_workers=1,
        sandboxes_per_worker=1,
        sandbox_reuse=5,
        sampling=SamplingParams(max_tokens=16),
        env_workers="local",
    )
    async with (
        HFEngine(tiny_model("qwen3_moe", seed=0)) as engine,
        RolloutController(cfg, engine, ChatFormat(load_tokenizer("qwen3")), sandbox=BWRAP) as ctl,
    ):
        first = await asyncio.wait_for(ctl.run_iteration(), 60)
        assert first.stats.groups_finished == 1 and first.stats.parked == 3
        # every parked episode was reset, so holds a sandbox: more than the pool's cap without parking
        assert len(trees(bwrap_runtime, ctl.workers[0].pid)) >= 3 > 2 * cfg.sandboxes_per_worker
        rest = await asyncio.wait_for(ctl.run_iteration(drain=True), 60)
    assert rest.stats.groups_finished == 3 and all(t.status is Status.FINISHED for t in rest.trajectories)


@pytest.mark.slow  # the fast tier is at its budget
async def test_a_cancelled_error_of_the_env_s_own_is_an_answer_not_a_hang(bwrap_runtime, monkeypatch):
    """A CancelledError raised in the env's own code (not the worker's shutdown) is the call's WorkerError: it went
    unanswered, and the driver waited for the reply forever."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the env workers import parking_envs
    cfg = RolloutConfig(env="parking_envs:cancels_its_step", num_workers=1, sandboxes_per_worker=1, env_workers="local")
    async with (
        HFEngine(tiny_model("qwen3_moe", seed=0)) as engine,
        RolloutController(cfg, engine, ChatFormat(load_tokenizer("qwen3")), sandbox=BWRAP) as ctl,
    ):
        (worker,) = ctl.workers
        (task,) = await ctl.pool.sample_tasks(1, 0)
        await worker.reset("e", task, 0)
        with pytest.raises(WorkerError, match="CancelledError raised in step: the env's own timeout") as err:
            await asyncio.wait_for(worker.step("e", RUN), 30)
        assert not isinstance(err.value, WorkerDied)
        await worker.reset("f", task, 1)  # the worker still serves


DRIVER = """
import asyncio
from agentrl.rollout import RolloutConfig
from agentrl.rollout.pool import env_worker_pool
from agentrl.sandbox import SandboxConfig

async def main():
    cfg = RolloutConfig(env="code_sandbox", num_workers=1, sandboxes_per_worker=2, env_workers="local")
    pool = env_worker_pool(cfg, sandbox=SandboxConfig(backend="bwrap"))
    await pool.start()
    await asyncio.gather(*(w.start_sandboxes() for w in pool.workers))
    print(*(w.pid for w in pool.workers), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.slow  # the fast tier is at its budget; the killed worker above covers the pool
async def test_a_worker_and_its_sandboxes_end_with_a_killed_driver(bwrap_runtime):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in (await asyncio.to_thread(driver.stdout.readline)).split()]
        assert len(pids) == 1 and len(trees(bwrap_runtime, pids[0])) == 2
    finally:
        driver.kill()
        driver.wait()
    # it reads the end of its line, closes its sandboxes and exits
    await until(lambda: not any(reaper.process_alive(p) for p in pids))
    assert not trees(bwrap_runtime)
