"""`agentrl train --ray-address` on a real 3-node Ray cluster (tests/ray_cluster.py): the learner ranks where
`cluster.learner` puts them (the head), env workers on both Docker nodes (each with its own, initially empty,
daemon), engine replicas where `cluster.inference` allows; then one Docker node, holding env workers and an engine
replica, is lost mid-run: the run finishes, the lost episodes are retried and never scored, and no container is
left on any daemon."""

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cli import sets, start_agentrl
from ray_cluster import NodeSpec, RayCluster

from agentrl.runs import read_jsonl
from agentrl.sandbox.reaper import LABEL, PID_LABEL, owner_alive

MODEL = Path(__file__).parents[1] / "data" / "run_v0" / "model"  # a tiny Qwen3-MoE with the project tokenizer
# cluster.learner.collective_timeout_s: far above how far apart two ranks may reach one collective while a node is
# lost (3 s was not, once, in CI), and shorter than the ranks wait before the first update (the image shipped to two
# empty daemons, the engines started: 23 s on the dev VM)
TIMEOUT_S = 10.0
RUN = [
    "model.path=model",
    "out=run",
    "iterations=6",
    "optim.lr=0.05",
    "rollout.group_size=2",
    "rollout.groups_per_iteration=2",
    "rollout.sandboxes_per_worker=3",
    "rollout.max_groups_in_flight=6",
    "rollout.sampling.max_tokens=24",
    "engine.replicas=2",
    "cluster.inference.resources={inference: 1}",
    "cluster.learner.ranks=2",
    "cluster.learner.resources={learner: 1}",
    f"cluster.learner.collective_timeout_s={TIMEOUT_S}",
    "threads=1",
    "eval.tasks=2",
    "eval.every=0",
    "eval.sandboxes_per_worker=1",
    "checkpoint.export_final=false",
]

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    """The head (the driver's node, the machine's Docker daemon) takes the learner ranks; each node may hold one
    engine replica, so a lost replica has somewhere to restart."""
    c = RayCluster.start(
        {
            "a": NodeSpec(docker=True, num_cpus=2, resources={"inference": 1}),
            "b": NodeSpec(docker=True, num_cpus=2, resources={"inference": 1}),
        },
        head=NodeSpec(num_cpus=4, resources={"learner": 2, "inference": 1}),
    )
    try:
        yield c
    finally:
        c.stop()


def containers(node) -> list[str]:
    """The node daemon's sandbox containers, each with its owner's pid and whether that process still runs."""
    return [
        f"{c.name} (owner pid {c.labels.get(PID_LABEL)}, alive: {owner_alive(c.labels)}, {c.status})"
        for c in node.docker_client().containers.list(all=True, filters={"label": LABEL}, ignore_removed=True)
    ]


def placement(stdout: str) -> dict[str, list[str]]:
    """The node ids the run printed for its learner ranks and engine replicas (lines may wrap)."""
    text = " ".join(stdout.split())
    spans = {
        "learner": text[text.index("learner:") : text.index("engine:")],
        "engine": text[text.index("engine:") : text.index("env workers:")],
    }
    return {
        role: [n for n, k in re.findall(r"([0-9a-f]{20,}) \((\d+)\)", span) for _ in range(int(k))]
        for role, span in spans.items()
    }


def test_a_run_places_its_parts_and_survives_a_lost_node(tmp_path, cluster):
    shutil.copytree(MODEL, tmp_path / "model")
    assert all(not n.docker_client().images.list() for n in cluster.docker_nodes())  # no image there yet
    log = open(tmp_path / "stdout.txt", "w")  # noqa: SIM115 (the child writes it while the test reads it)
    proc = start_agentrl(
        "train",
        "--env",
        "code_sandbox",
        "--ray-address",
        cluster.address,
        *sets(*RUN),
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 400
        while not (metrics.exists() and read_jsonl(metrics)) and proc.poll() is None:
            assert time.monotonic() < deadline, "no iteration logged in time"
            time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / "stdout.txt").read_text()[-4000:]
        where = placement((tmp_path / "stdout.txt").read_text())
        by_id = {n.node_id: name for name, n in cluster.nodes.items()}
        assert [by_id[n] for n in where["learner"]] == ["head", "head"]  # cluster.learner.resources: the head's
        lost = next(by_id[n] for n in where["engine"] if by_id[n] != "head")  # a Docker node with a replica
        # iteration 0's parked episodes are lost with it; calls to its worker fail only once Ray declares the node
        # dead, seconds later: the iterations after it give that time, so the retries land in the logged rows
        cluster.kill_node(lost)
        assert proc.wait(timeout=400) == 0, (tmp_path / "stdout.txt").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    stdout = (tmp_path / "stdout.txt").read_text()
    rows = read_jsonl(metrics)
    assert [r["iteration"] for r in rows] == list(range(6))
    first = rows[0]
    # the placement, printed and logged: env workers on both Docker nodes, the learner on one node
    assert (first["rollout/nodes"], first["learner/nodes"], first["fleet/nodes"]) == (2, 1, 2)
    assert stdout.count("image shipped") == 2 and "env workers: 2 on 2 node(s)" in stdout, stdout[:3000]
    assert first["rollout/failed"] == 0 and first["rollout/retried"] == 0  # the image came before any episode
    # the ranks waited longer than one collective may take, between calls (rollouts, evaluation), in none
    idle = [r["time/learner_idle_s"] for r in rows]
    assert max(idle) > TIMEOUT_S, idle
    # the lost node: its episodes retried (never scored), its replica's requests resent, the run went on with one
    lost_after = rows[1:]
    assert sum(r["rollout/retried"] + r["rollout/failed"] for r in lost_after) + rows[-1]["fleet/retried"] > 0
    assert rows[-1]["rollout/nodes"] == 1
    assert all(r["policy_version"] == i + 1 for i, r in enumerate(rows))
    for node in cluster.docker_nodes():  # the lost node's daemon too: its worker's watchdog removed them
        deadline = time.monotonic() + 60
        while containers(node) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert containers(node) == [], node.name
