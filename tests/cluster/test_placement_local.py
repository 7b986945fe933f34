"""Env placement on a one-node Ray started here (the fast tier's share of tests/cluster): refusing a cluster without
Docker nodes, where replacements go, and placed workers on a node that advertises the resource."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import ray

from agentrl.cluster import EnvPlacement
from agentrl.engine.base import SamplingParams
from agentrl.engine.hf import HFEngine
from agentrl.models.tiny import tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat, RolloutConfig, RolloutController, Status
from agentrl.rollout.placement import DockerNode, EnvPlacer, NoDockerNodes
from agentrl.sandbox import reaper


@pytest.fixture
def local_ray(request):
    """A local Ray for one test; `@pytest.mark.parametrize("local_ray", [{...resources}], indirect=True)`."""
    ray.init(num_cpus=1, resources=getattr(request, "param", None), include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def config(**kw) -> RolloutConfig:
    base = dict(
        env="code_sandbox",
        env_kwargs={"max_turns": 8},
        group_size=2,
        groups_per_iteration=2,
        num_workers=7,
        sandboxes_per_worker=1,
        sampling=SamplingParams(max_tokens=24),
        max_episode_tokens=2000,
        partial=False,
    )
    return RolloutConfig(**{**base, **kw})


def chat() -> ChatFormat:
    return ChatFormat(load_tokenizer("qwen3"))


async def test_a_cluster_without_docker_nodes_is_refused(local_ray):
    engine = HFEngine(tiny_model("qwen3_moe", seed=0))
    ctl = RolloutController(config(), engine, chat(), EnvPlacement(node_resource="sandbox_host"))
    async with engine:
        with pytest.raises(NoDockerNodes) as e:
            await ctl.start()
    msg = str(e.value)
    assert "'sandbox_host'" in msg and "ray start" in msg and """--resources '{"sandbox_host": 1}'""" in msg, msg
    assert ctl.workers == []  # refused before any worker started


def test_replacements_go_to_the_least_loaded_alive_node():
    placer = EnvPlacer(EnvPlacement(workers_per_node=2))
    a, b, c = (DockerNode(f"{x}" * 8, "10.0.0.1", 1) for x in "abc")
    placer.nodes = {n.node_id: n for n in (a, b, c)}
    # c died: its 2 workers go one to each survivor, the less loaded first
    load = Counter({a.node_id: 2, b.node_id: 1})
    assert placer.replacements([a, b], load, 2, "tag") == [b.node_id, a.node_id]
    assert placer.replacements([a, b], load, 3, "tag") == [b.node_id, a.node_id, b.node_id]
    # a worker of a died on a live a: a has the fewest, it goes back there
    assert placer.replacements([a, b, c], Counter({a.node_id: 1, b.node_id: 2, c.node_id: 2}), 1, "tag") == [a.node_id]
    assert placer.summary([a.node_id, b.node_id, a.node_id])[0].workers == 2


@pytest.mark.docker
@pytest.mark.slow  # the fast tier is at its budget; tests/cluster/test_env_nodes.py places workers on real nodes
@pytest.mark.parametrize("local_ray", [{"docker": 1}], indirect=True)
async def test_placed_workers_on_a_docker_node(local_ray, sandbox_image):
    """workers_per_node on the one Docker node (rollout.num_workers unused), the image found there; a worker killed
    mid-iteration is replaced on the same node, which is alive, and its episodes are retried."""
    engine = HFEngine(tiny_model("qwen3_moe", seed=0))
    node = ray.get_runtime_context().get_node_id()
    async with engine, RolloutController(config(), engine, chat(), EnvPlacement(workers_per_node=2)) as ctl:
        assert [(n.node_id, n.workers, n.image) for n in ctl.nodes()] == [(node, 2, "present")]
        assert ctl.placement_metrics() == {"rollout/nodes": 1.0, "rollout/env_workers": 2.0}
        assert "2 on 1 node(s)" in ctl.describe_placement()
        victim = ctl.workers[0]
        pid = await victim.actor.pid.remote()
        task = asyncio.create_task(ctl.run_iteration())
        while not any(ep.worker is victim and ep.traj.turns for ep in ctl._live()):
            await asyncio.sleep(0.05)
        with engine.paused():  # nothing moves on (the event loop waits too) until the victim is gone
            ray.kill(victim.actor)
            while reaper.process_start_time(pid) is not None:
                time.sleep(0.05)
        batch = await asyncio.wait_for(task, 300)
        assert victim not in ctl.workers and [(n.node_id, n.workers) for n in ctl.nodes()] == [(node, 2)]
    assert batch.stats.retried >= 1 and batch.stats.groups_finished == 2
    assert all(t.status is Status.FINISHED for t in batch.trajectories)


async def test_without_a_placement_nothing_is_placed():
    ctl = RolloutController(config(), None, None)
    assert ctl.nodes() == [] and ctl.placement_metrics() == {}
    assert "placed by Ray" in ctl.describe_placement()
