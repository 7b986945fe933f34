"""Env workers on a Ray cluster: on every env node, each worker making its sandboxes on its own node.

An env node is an alive node that advertises the custom resource `cluster.envs.node_resource` (by default the
sandbox backend's name: `ray start ... --resources '{"docker": 1}'`, or `{"bwrap": 1}`). For Docker sandboxes its
raylet's environment (DOCKER_HOST) names its daemon, and the Ray workers it starts inherit it; bubblewrap sandboxes
need no daemon. A sandbox is reached through a Unix socket on its host, so it runs on its worker's node. (Docker
nodes, in the names below, are env nodes of either backend.) `EnvPlacer`, for the rollout controller:

1. finds the env nodes (`docker_nodes`), refusing a cluster with none;
2. before any worker starts, on every one of them at once (a Ray task pinned to the node): removes the
   sandboxes whose owner is gone (`SandboxConfig.collect_orphans`) and checks that the node can make the run's:
   for Docker, the sandbox image, which a node whose daemon lacks it gets from the driver's daemon (`docker save`
   bytes, put once in the object store, `docker load`-ed by a task on the node); for bwrap, that bubblewrap runs
   there (a node where it cannot is refused with the reason);
3. pins `workers_per_node` env workers to each (`NodeAffinitySchedulingStrategy(soft=False)`);
4. puts a dead worker's replacement on the alive Docker node with the fewest workers; when the dead worker's
   node is gone, its other workers are replaced too;
5. at close, removes orphans on every node still alive.

"Alive" is Ray's view (`ray.nodes()`) confirmed by a TCP connect to the node's raylet: Ray marks a node whose
raylet was killed dead only once its health checks have failed for a while (about 15 s by default), while a
connect to a killed raylet's port is refused at once (and one to a vanished machine times out).

Workers reserve none of the node resource (nor CPU): node affinity alone keeps them on their node, and a
reservation would stop a replacement from doubling up on a surviving node that has no share left.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agentrl.cluster import EnvPlacement
from agentrl.sandbox.config import SandboxConfig

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
PREPARE_TIMEOUT_S = 900.0
"""the longest a node's orphan removal, image check and image load may take (a load of a 200 MB image takes
seconds; the bound is for a node whose daemon hangs)"""


class NoDockerNodes(RuntimeError):
    """The cluster has no alive node advertising the env node resource."""


@dataclass(frozen=True)
class DockerNode:
    node_id: str
    ip: str
    raylet_port: int

    def __str__(self) -> str:
        return f"{self.ip} ({self.node_id[:8]})"


@dataclass(frozen=True)
class NodeWorkers:
    """Where env workers run: one Docker node, how many live workers it has, how its sandbox image got there."""

    node_id: str
    ip: str
    workers: int
    image: str
    """ "present" (the node's daemon had it) or "shipped" (loaded from the driver's before the first episode)"""


def _raylet_answers(node: DockerNode, timeout_s: float) -> bool:
    """False only on evidence that the raylet is gone: a refused connection (nothing listens on its port), or two
    connects in a row that time out (a vanished machine). One slow connect on a loaded node is not a loss."""
    for _ in range(2):
        try:
            with socket.create_connection((node.ip, node.raylet_port), timeout=timeout_s):
                return True
        except ConnectionRefusedError:
            return False
        except OSError:  # a timeout: try once more
            continue
    return False


def docker_nodes(resource: str, *, probe_s: float | None = PROBE_TIMEOUT_S) -> list[DockerNode]:
    """The alive nodes that advertise `resource`, by IP then id; with `probe_s`, only those whose raylet accepts
    a connection within that many seconds."""
    nodes = [
        DockerNode(n["NodeID"], n["NodeManagerAddress"], int(n["NodeManagerPort"]))
        for n in ray.nodes()
        if n.get("Alive") and n.get("Resources", {}).get(resource, 0) > 0
    ]
    if probe_s and nodes:
        with ThreadPoolExecutor(min(32, len(nodes))) as pool:
            answers = list(pool.map(lambda n: _raylet_answers(n, probe_s), nodes))
        for n, ok in zip(nodes, answers, strict=True):
            if not ok:
                log.warning("node %s has the %r resource but its raylet does not answer: left out", n, resource)
        nodes = [n for n, ok in zip(nodes, answers, strict=True) if ok]
    return sorted(nodes, key=lambda n: (n.ip, n.node_id))


def no_docker_nodes_error(resource: str, backend: str = "docker") -> NoDockerNodes:
    alive = [n for n in ray.nodes() if n.get("Alive")]
    which = (
        "that has a Docker daemon for sandboxes"
        if backend == "docker"
        else "that runs bubblewrap sandboxes (Debian's bubblewrap)"
    )
    return NoDockerNodes(
        f"no alive node of this Ray cluster ({len(alive)} alive) advertises the {resource!r} resource "
        f"(cluster.envs.node_resource), so env workers have nowhere to run: start each node {which} with "
        f"`ray start --address ... --resources '{{\"{resource}\": 1}}'`"
        + (" (with DOCKER_HOST set if its daemon is not the default one)" if backend == "docker" else "")
    )


def pinned(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


# -- tasks run on one node, through its Docker daemon -------------------------------------
# num_cpus=0: they wait on the daemon, and must not queue behind a node's busy CPUs. Each may run again
# (max_retries: a worker killed under memory pressure), so each is idempotent.


@ray.remote(num_cpus=0, max_retries=2)
def _reap_and_check(tag: str | None, sandbox: SandboxConfig) -> tuple[list[str], bool]:
    """Remove this node's orphaned sandboxes; say whether its daemon has image `tag` (docker; bwrap needs no image,
    and a node where bubblewrap cannot run raises, saying why)."""
    removed = sandbox.collect_orphans()
    if sandbox.backend != "docker":
        if tag is not None and (why := sandbox.unavailable()) is not None:
            raise RuntimeError(why)
        return removed, True
    from agentrl.sandbox.docker_sandbox import docker_client
    from agentrl.sandbox.image import image_exists

    return removed, tag is None or image_exists(docker_client(), tag)


@ray.remote(num_cpus=0, max_retries=2)
def _load_image(data: bytes, tag: str) -> None:
    from agentrl.sandbox.docker_sandbox import docker_client
    from agentrl.sandbox.image import import_image

    import_image(docker_client(), data, tag)


@ray.remote(num_cpus=0, max_retries=2)
def _save_image(tag: str) -> bytes:
    from agentrl.sandbox.docker_sandbox import docker_client
    from agentrl.sandbox.image import export_image

    return export_image(docker_client(), tag)


_NODE_GONE = (
    ray.exceptions.TaskUnschedulableError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.GetTimeoutError,
    ray.exceptions.ObjectLostError,
)


def _on_each(nodes: list[DockerNode], task, *args, timeout_s: float = PREPARE_TIMEOUT_S) -> dict[str, object]:
    """Run `task` on every node at once; the results of those where it ran. A node that died meanwhile is left
    out (logged); a task that ran and raised raises, naming its node."""
    refs = {n.node_id: task.options(scheduling_strategy=pinned(n.node_id)).remote(*args) for n in nodes}
    deadline = time.monotonic() + timeout_s
    out: dict[str, object] = {}
    for n in nodes:
        try:
            out[n.node_id] = ray.get(refs[n.node_id], timeout=max(0.0, deadline - time.monotonic()))
        except _NODE_GONE as e:
            log.warning("node %s: left out, its task did not run (%s)", n, type(e).__name__)
            if isinstance(e, ray.exceptions.GetTimeoutError):
                ray.cancel(refs[n.node_id], force=True)
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(f"env node {n}: {e.cause if e.cause is not None else e}") from e
    return out


def prepare_nodes(nodes: list[DockerNode], tag: str, sandbox: SandboxConfig | None = None) -> dict[str, str]:
    """Remove orphans on every node and make sure it can make `sandbox`'s sandboxes: for Docker, that its daemon has
    image `tag`, shipping it where missing; for bwrap, that bubblewrap runs there.

    Returns node id -> "present" | "shipped" (the image) | "bwrap" for the nodes prepared (one that died meanwhile
    is left out)."""
    sandbox = sandbox or SandboxConfig()
    checked = _on_each(nodes, _reap_and_check, tag, sandbox)
    for n in nodes:
        if n.node_id in checked and checked[n.node_id][0]:
            log.warning("node %s: removed %d orphaned sandbox(es)", n, len(checked[n.node_id][0]))
    if sandbox.backend != "docker":
        return {nid: sandbox.backend for nid in checked}
    status = {nid: "present" for nid, (_, has) in checked.items() if has}
    missing = [n for n in nodes if n.node_id in checked and not checked[n.node_id][1]]
    if missing:
        ref = _image_ref(tag, [n for n in nodes if n.node_id in status], missing)
        t0 = time.monotonic()
        loaded = _on_each(missing, _load_image, ref, tag)
        del ref
        log.info("sandbox image %s shipped to %d node(s) in %.1f s", tag, len(loaded), time.monotonic() - t0)
        status |= {nid: "shipped" for nid in loaded}
    return status


def _image_ref(tag: str, having: list[DockerNode], missing: list[DockerNode]) -> ray.ObjectRef:
    """The image's `docker save` bytes in the object store: from the driver's daemon, else from a node's."""
    from agentrl.sandbox import SandboxError
    from agentrl.sandbox.docker_sandbox import docker_client
    from agentrl.sandbox.image import export_image

    where = ", ".join(map(str, missing))
    try:
        data = export_image(docker_client(), tag)
    except (SandboxError, RuntimeError) as e:
        if not having:
            raise RuntimeError(
                f"the sandbox image {tag} is on none of the env nodes' Docker daemons ({where} lack it) and cannot "
                f"be shipped from this machine: {e}. Run `agentrl sandbox build` here or on each env node"
            ) from e
        log.info("sandbox image %s: not on this machine's daemon (%s); shipping it from node %s", tag, e, having[0])
        return _save_image.options(scheduling_strategy=pinned(having[0].node_id)).remote(tag)
    log.info("sandbox image %s (%.0f MB) is missing on %s: shipping it", tag, len(data) / 2**20, where)
    return ray.put(data)


def reap_nodes(nodes: list[DockerNode], sandbox: SandboxConfig | None = None) -> int:
    """Remove orphaned sandboxes on every node that is still alive; how many were removed."""
    removed = _on_each(nodes, _reap_and_check, None, sandbox or SandboxConfig(), timeout_s=120.0)
    return sum(len(r[0]) for r in removed.values())


class EnvPlacer:
    """Which Docker node each env worker slot goes to, kept up to date as workers die and are replaced."""

    def __init__(self, cfg: EnvPlacement, sandbox: SandboxConfig | None = None) -> None:
        self.cfg = cfg
        self.sandbox = sandbox or SandboxConfig()
        self.resource = cfg.resource(self.sandbox.backend)
        self.nodes: dict[str, DockerNode] = {}
        """every node prepared so far (orphans removed, image present), by id"""
        self.image: dict[str, str] = {}

    def alive(self) -> list[DockerNode]:
        return docker_nodes(self.resource)

    def _none(self) -> NoDockerNodes:
        return no_docker_nodes_error(self.resource, self.sandbox.backend)

    def start(self, tag: str) -> list[str]:
        """Prepare every env node; the node id of each worker slot (workers_per_node per node)."""
        nodes = self.alive()
        if not nodes:
            raise self._none()
        self._prepare(nodes, tag)
        if not self.nodes:
            raise self._none()
        return [nid for nid in self.nodes for _ in range(self.cfg.workers_per_node)]

    def _prepare(self, nodes: list[DockerNode], tag: str) -> None:
        status = prepare_nodes(nodes, tag, self.sandbox)
        for n in nodes:
            if n.node_id in status:
                self.nodes[n.node_id] = n
                self.image[n.node_id] = status[n.node_id]

    def replacements(self, alive: list[DockerNode], load: Counter[str], n: int, tag: str) -> list[str]:
        """Nodes for `n` replacement workers, each the `alive` prepared node with the fewest live workers (`load`,
        counting the replacements placed before it). If none of the nodes prepared so far is alive, the alive
        Docker nodes that joined since are prepared first."""
        candidates = [x for x in alive if x.node_id in self.nodes]
        if not candidates:
            self._prepare(alive, tag)
            candidates = [x for x in alive if x.node_id in self.nodes]
        if not candidates:
            raise self._none()
        load, targets = Counter(load), []
        for _ in range(n):
            best = min(candidates, key=lambda x: load[x.node_id]).node_id
            load[best] += 1
            targets.append(best)
        return targets

    def reap(self, only: set[str] | None = None) -> int:
        """Remove orphans on the prepared nodes still alive (`only`: of these ids). It may run in a thread while
        another prepares a node: it reads a copy of the prepared nodes."""
        ids = {n.node_id for n in self.alive()}
        nodes = [n for nid, n in list(self.nodes.items()) if nid in ids and (only is None or nid in only)]
        return reap_nodes(nodes, self.sandbox) if nodes else 0

    def summary(self, worker_nodes: list[str]) -> list[NodeWorkers]:
        """Per node with live workers (`worker_nodes`: each worker's node id), in node order."""
        count = Counter(worker_nodes)
        return [
            NodeWorkers(nid, n.ip, count[nid], self.image.get(nid, "")) for nid, n in self.nodes.items() if count[nid]
        ]
