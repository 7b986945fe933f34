"""Env workers on a real 3-node Ray cluster (tests/ray_cluster.py): two Docker nodes, each with its own empty
Docker daemon, and the head (the driver's node) on the main one. Real Ray, real dockerd, the hf engine."""

from __future__ import annotations

import asyncio
import os
import time

import docker
import pytest
from ownership import bwrap_trees

from agentrl.cluster import EnvPlacement
from agentrl.engine.base import SamplingParams
from agentrl.engine.hf import HFEngine
from agentrl.models.tiny import tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat, RolloutConfig, RolloutController, Status
from agentrl.sandbox import SandboxConfig, bwrap, reaper
from agentrl.sandbox.image import image_exists

# the node-loss test comes last: the module's cluster has one Docker node after it
pytestmark = [pytest.mark.docker, pytest.mark.slow]


def config(address: str, **kw) -> RolloutConfig:
    base = dict(
        env="code_sandbox",
        env_kwargs={"max_turns": 3},
        group_size=2,
        groups_per_iteration=2,
        num_workers=5,
        sandboxes_per_worker=2,
        sampling=SamplingParams(max_tokens=24),
        max_episode_tokens=2000,
        partial=False,
        ray_address=address,
    )
    return RolloutConfig(**{**base, **kw})


def chat() -> ChatFormat:
    return ChatFormat(load_tokenizer("qwen3"))


def sessions(client: docker.DockerClient) -> set[str]:
    """The sandbox sessions (one per env worker process) with containers on a daemon."""
    return {c["Labels"][reaper.SESSION_LABEL] for c in client.api.containers(all=True, filters={"label": reaper.LABEL})}


async def eventually(check, timeout_s: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.2)


def nothing_left(cluster, wheres: list[dict]) -> bool:
    """No container of these workers on any daemon (the nodes' and the main one), no watchdog of theirs running."""
    mine = {w.session for w in wheres}
    daemons = [n.docker_client() for n in cluster.docker_nodes()] + [docker.from_env()]
    return not any(sessions(d) & mine for d in daemons) and not any(reaper.process_alive(w.watchdog) for w in wheres)


async def test_env_workers_run_on_every_docker_node_on_its_own_daemon(ray_cluster, sandbox_image):
    """One worker per Docker node (rollout.num_workers is not used), each on its node's daemon; the image, missing
    on both daemons, is there before the first episode; after close nothing is left on any daemon."""
    a, b = ray_cluster.docker_nodes()
    assert not image_exists(a.docker_client(), sandbox_image) and not image_exists(b.docker_client(), sandbox_image)
    engine = HFEngine(tiny_model("qwen3_moe", seed=0))
    async with engine, RolloutController(config(ray_cluster.address), engine, chat(), EnvPlacement()) as ctl:
        assert image_exists(a.docker_client(), sandbox_image) and image_exists(b.docker_client(), sandbox_image)
        placed = {(n.node_id, n.ip, n.workers, n.image) for n in ctl.nodes()}
        assert placed == {(a.node_id, a.ip, 1, "shipped"), (b.node_id, b.ip, 1, "shipped")}
        assert ctl.placement_metrics() == {"rollout/nodes": 2.0, "rollout/env_workers": 2.0}
        text = ctl.describe_placement()
        assert a.node_id in text and b.node_id in text and "2 on 2 node(s)" in text, text
        await asyncio.gather(*(w.start_sandboxes() for w in ctl.workers))  # warm pools, as a run starts
        wheres = await asyncio.gather(*(w.actor.where.remote() for w in ctl.workers))
        assert sorted((w.node_id, w.docker_host) for w in wheres) == sorted(
            [(a.node_id, a.docker_host), (b.node_id, b.docker_host)]
        )
        batch = await ctl.run_iteration()
        assert (batch.stats.groups_finished, batch.stats.failed, batch.stats.retried) == (2, 0, 0)
        assert all(t.status is Status.FINISHED and len(t.turns) == 3 for t in batch.trajectories)
        # each node's sandboxes (the workers' warm pools) are on its own daemon, made by its own worker (the tiny
        # model's episodes call no tool: their sandboxes are the pools')
        by_node = {w.node_id: w for w in wheres}
        for n in (a, b):
            assert sessions(n.docker_client()) == {by_node[n.node_id].session}
        assert not sessions(docker.from_env()) & {w.session for w in wheres}
        assert all(reaper.process_alive(w.watchdog) for w in wheres)
    await eventually(lambda: nothing_left(ray_cluster, wheres), 30, "containers or watchdogs left after close")


async def test_env_workers_make_bwrap_sandboxes_on_every_env_node(ray_cluster, bwrap_site):
    """bwrap sandboxes on a cluster: one worker per env node (here the nodes' resource is "docker"; a bwrap run's
    default is "bwrap"), its sandboxes made there with bubblewrap, no image shipped; a killed worker's episode is
    retried on a replacement, and its node reaps the dead worker's sandbox trees; after close no tree is left."""
    a, b = ray_cluster.docker_nodes()
    cfg = config(ray_cluster.address, env_kwargs={"max_turns": 12})
    engine = HFEngine(tiny_model("qwen3_moe", seed=0))
    placement, sandbox = EnvPlacement(node_resource="docker"), SandboxConfig(backend="bwrap")
    async with engine, RolloutController(cfg, engine, chat(), placement, sandbox) as ctl:
        assert {(n.node_id, n.workers, n.image) for n in ctl.nodes()} == {
            (a.node_id, 1, "bwrap"),
            (b.node_id, 1, "bwrap"),
        }
        assert "with the 'docker' resource (1 per node), bwrap sandboxes" in ctl.describe_placement()
        await asyncio.gather(*(w.start_sandboxes() for w in ctl.workers))
        before = await asyncio.gather(*(w.actor.where.remote() for w in ctl.workers))
        assert {w.node_id for w in before} == {a.node_id, b.node_id}
        runtime = bwrap.runtime_dir()
        assert all(len(bwrap_trees(runtime, w.pid)) == 2 for w in before)  # each worker's warm pool, on its node
        victim = ctl.workers[0]
        task = asyncio.create_task(ctl.run_iteration())
        deadline = time.monotonic() + 120
        while not any(ep.worker is victim and ep.traj.turns for ep in ctl._live()):
            assert time.monotonic() < deadline, "no episode of the victim got a turn"
            await asyncio.sleep(0.05)
        with engine.paused():
            dead = next(w for w in before if w.node_id == victim.node_id)
            os.kill(dead.pid, 9)
            while reaper.process_alive(dead.pid):
                await asyncio.sleep(0.05)
        batch = await asyncio.wait_for(task, 300)
        assert batch.stats.groups_finished == 2 and batch.stats.retried >= 1
        assert all(t.status in (Status.FINISHED, Status.FAILED) for t in batch.trajectories)
        after = await asyncio.gather(*(w.actor.where.remote() for w in ctl.workers))
        deadline = time.monotonic() + 30
        while bwrap_trees(runtime, dead.pid):  # its node reaps them (its sandboxes died with it)
            assert time.monotonic() < deadline, "the dead worker's sandbox trees were not removed"
            await asyncio.sleep(0.1)
    pids = {w.pid for w in before + after}
    assert not any(bwrap_trees(runtime, pid) for pid in pids)


async def test_a_lost_node_costs_retries_and_the_run_goes_on(ray_cluster, sandbox_image):
    """Node b's raylet is killed mid-iteration: its worker's episodes are retried (never scored) on a replacement
    on node a, the iteration completes; b's containers are removed from b's daemon by the dead worker's watchdog."""
    a, b = ray_cluster.docker_nodes()
    engine = HFEngine(tiny_model("qwen3_moe", seed=0))
    cfg = config(ray_cluster.address, env_kwargs={"max_turns": 12}, groups_per_iteration=3)
    async with engine, RolloutController(cfg, engine, chat(), EnvPlacement()) as ctl:
        await asyncio.gather(*(w.start_sandboxes() for w in ctl.workers))
        before = await asyncio.gather(*(w.actor.where.remote() for w in ctl.workers))
        victim = ctl.workers[[w.node_id for w in before].index(b.node_id)]
        task = asyncio.create_task(ctl.run_iteration())
        # until an episode of b's worker is mid-way (it has a turn; 11 more to go)
        await eventually(lambda: any(ep.worker is victim and ep.traj.turns for ep in ctl._live()), 120)
        on_b = sessions(b.docker_client())
        assert on_b, "node b's worker has sandboxes on b's daemon"
        t0 = time.monotonic()
        with engine.paused():  # no token is generated (the event loop waits too) until b's worker is gone
            ray_cluster.kill_node("b")
            pid = next(w.pid for w in before if w.node_id == b.node_id)
            while reaper.process_alive(pid):
                assert time.monotonic() - t0 < 60, "b's env worker outlived its raylet"
                time.sleep(0.05)
        print(f"b's worker exited {time.monotonic() - t0:.1f} s after its raylet was killed")
        batch = await asyncio.wait_for(task, 300)
        print(f"iteration done {time.monotonic() - t0:.1f} s after the kill; stats {batch.stats}")
        assert victim not in ctl.workers
        trajs = batch.trajectories
        assert len(trajs) == 6 and batch.stats.groups_finished == 3
        assert batch.stats.retried >= 1, "b's episodes were restarted"
        failed = [t for t in trajs if t.status is Status.FAILED]
        assert len(failed) == batch.stats.failed and not any(t.trainable for t in failed)
        assert all(t.status in (Status.FINISHED, Status.FAILED) for t in trajs)
        # the replacement is on the surviving Docker node
        assert [(n.node_id, n.workers) for n in ctl.nodes()] == [(a.node_id, 2)]
        assert ctl.placement_metrics()["rollout/nodes"] == 1.0
        after = await asyncio.gather(*(w.actor.where.remote() for w in ctl.workers))
        assert {w.node_id for w in after} == {a.node_id}
    # the killed worker's containers on b's daemon: gone (its watchdog); the rest: closed or reaped
    await eventually(lambda: nothing_left(ray_cluster, before + after), 30, "containers or watchdogs left")
