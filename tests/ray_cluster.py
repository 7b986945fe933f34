"""A real multi-node Ray cluster on this machine, for tests: `ray start` processes (the GCS at 127.0.0.1:PORT; Ray
reports each node at the machine's IP), and a Docker daemon of its own for each worker node that asks for one.

    cluster = RayCluster.start({"a": NodeSpec(docker=True), "b": NodeSpec(docker=True)})  # ~10 s here
    ray.init(address=cluster.address)
    cluster.nodes["a"].node_id, .raylet_pid, .docker_host, .docker_client()
    cluster.kill_node("b")  # its raylet, SIGKILL: the node dies as on a lost machine (its dockerd lives on)
    cluster.stop()

The head (the driver's node: `ray.init(address=...)` on this machine attaches to it) uses the machine's main
Docker daemon and has only the custom resources its NodeSpec gives. A worker node with `docker=True` gets the
resource `{"docker": 1}` plus `{"node_<name>": 1}` and its own `dockerd` (`Dockerd`: own data root, exec root and
so its own containerd, no bridge, no iptables), started empty: no image. Its `ray start` runs with DOCKER_HOST
naming that daemon, so every Ray worker process of the node, and every sandbox it starts, uses it.

Every process the cluster starts carries AGENTRL_TEST_CLUSTER=<its root dir> in its environment (Ray's
processes and their children inherit it): `stop()` removes the containers on its daemons, stops them, then finds
exactly those processes and kills them by pid. Nothing is stopped by name, and `ray stop` is never run, so other
Ray instances and daemons on the machine are left alone. The root dir lives under /tmp (Unix socket paths must
stay short) and is deleted at the end. Ray's memory monitor is off on its nodes: on a shared machine another
process's memory use would get the cluster's workers killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import docker

from agentrl.sandbox.reaper import process_alive

MARK = "AGENTRL_TEST_CLUSTER"
RAY = str(Path(sys.executable).with_name("ray"))
OBJECT_STORE = 400 * 2**20  # holds the shipped sandbox image (about 170 MB)


@dataclass
class NodeSpec:
    docker: bool = False
    """its own Docker daemon (started empty) and the resource {"docker": 1}"""
    num_cpus: int = 1
    resources: dict[str, float] = field(default_factory=dict)


@dataclass
class Node:
    name: str
    node_id: str
    ip: str
    """as Ray reports it (NodeManagerAddress)"""
    raylet_pid: int
    temp_dir: Path
    docker_host: str | None
    """None: the machine's default daemon (the head)"""
    dockerd_pid: int | None = None
    alive: bool = True

    def docker_client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.docker_host) if self.docker_host else docker.from_env()


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    """n distinct free ports: every socket stays bound until all are chosen, so none is handed out twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


_PORT_LOCK = threading.Lock()  # worker nodes start in parallel threads: one draws its ports at a time


def _ports(head: bool) -> list[str]:
    """Every port a node listens on, free ones: two nodes on one machine (or another Ray here) must not collide."""
    names = [
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--metrics-export-port",
    ]
    if head:
        names += ["--ray-client-server-port", "--dashboard-port"]
    with _PORT_LOCK:
        ports = _free_ports(len(names))
    return [arg for name, port in zip(names, ports, strict=True) for arg in (name, str(port))]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


class Dockerd:
    """A Docker daemon of its own, started empty under `root` (its own data root, exec root and so containerd; no
    bridge, no iptables), beside the machine's main one. `stop()` removes its containers and stops it (SIGTERM,
    then SIGKILL), by pid. Also usable alone: `with Dockerd.start(root) as d: d.client() ...`."""

    def __init__(self, root: Path, proc: subprocess.Popen) -> None:
        self.root = root
        self.host = f"unix://{root}/docker.sock"
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, root: Path, env: dict[str, str] | None = None, *, wait: bool = True) -> Dockerd:
        root.mkdir(parents=True, exist_ok=True)
        host = f"unix://{root}/docker.sock"
        cmd = [
            "dockerd",
            "--data-root",
            f"{root}/data",
            "--exec-root",
            f"{root}/exec",
            "-H",
            host,
            "--pidfile",
            f"{root}/docker.pid",
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
        ]
        with open(root / "dockerd.log", "wb") as log:
            proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        d = cls(root, proc)
        if wait:
            d.wait()
        return d

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.host)

    def wait(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client().ping()
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.root / "dockerd.log").read_text()[-3000:]
                    raise RuntimeError(f"dockerd in {self.root} did not answer:\n{log}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            for c in self.client().containers.list(all=True):
                c.remove(force=True, v=True)
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
        _unmount_under(self.root)

    def __enter__(self) -> Dockerd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _unmount_under(root: Path) -> None:
    """A killed dockerd can leave mounts under its roots (overlay, netns): unmount them, deepest first."""
    mounts = [
        line.split()[1]
        for line in Path("/proc/mounts").read_text().splitlines()
        if line.split()[1].startswith(str(root) + "/")
    ]
    for m in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)


class RayCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.address = ""
        self.nodes: dict[str, Node] = {}
        self.daemons: dict[str, Dockerd] = {}
        self.setup_s: dict[str, float] = {}
        """seconds each stage of `start` took"""

    # -- start ------------------------------------------------------------------------

    @classmethod
    def start(cls, nodes: dict[str, NodeSpec], *, head: NodeSpec | None = None) -> RayCluster:
        root = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
        cluster = cls(root)
        try:
            cluster._start(head or NodeSpec(), nodes)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _env(self, docker_host: str | None = None) -> dict[str, str]:
        # no memory monitor: on a shared machine another process's memory would get this cluster's workers killed
        env = {
            **os.environ,
            MARK: str(self.root),
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_memory_monitor_refresh_ms": "0",
        }
        env.pop("RAY_ADDRESS", None)
        if docker_host:
            env["DOCKER_HOST"] = docker_host
        else:
            env.pop("DOCKER_HOST", None)  # the machine's default daemon
        return env

    def _start(self, head: NodeSpec, workers: dict[str, NodeSpec]) -> None:
        t0 = time.monotonic()
        self.daemons = daemons = {
            name: Dockerd.start(self.root / f"docker-{name}", self._env(), wait=False)
            for name, spec in workers.items()
            if spec.docker
        }
        for d in daemons.values():
            d.wait()
        self.setup_s["dockerd"] = time.monotonic() - t0

        t1 = time.monotonic()
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        head_args = ["--head", "--port", str(port), "--include-dashboard", "false"]
        if head.resources:
            head_args += ["--resources", json.dumps(head.resources)]
        self._ray_start("head", head, head_args, None)
        with ThreadPoolExecutor(len(workers) or 1) as pool:  # the worker nodes join at once
            starts = []
            for name, spec in workers.items():
                host = daemons[name].host if name in daemons else None
                resources = {**spec.resources, f"node_{name}": 1} | ({"docker": 1} if spec.docker else {})
                args = ["--address", self.address, "--resources", json.dumps(resources)]
                starts.append(pool.submit(self._ray_start, name, spec, args, host))
            for f in starts:
                f.result()
        self.setup_s["ray"] = time.monotonic() - t1

        info = self._ray_nodes(len(workers) + 1)
        for name in ["head", *workers]:
            temp = self.root / name
            match = [n for n in info if n["RayletSocketName"].startswith(str(temp) + "/")]
            assert len(match) == 1, f"node {name} not found among {[n['RayletSocketName'] for n in info]}"
            sock = match[0]["RayletSocketName"]
            raylet = [p for p in _pids() if f"--raylet_socket_name={sock} " in _cmdline(p) + " "]
            assert len(raylet) == 1, f"raylet of node {name}: {raylet}"
            d = daemons.get(name)
            info_ = match[0]
            self.nodes[name] = Node(
                name, info_["NodeID"], info_["NodeManagerAddress"], raylet[0], temp, d and d.host, d and d.pid
            )
        self.setup_s["total"] = time.monotonic() - t0

    def _ray_start(self, name: str, spec: NodeSpec, args: list[str], docker_host: str | None) -> None:
        cmd = [
            RAY,
            "start",
            *args,
            "--temp-dir",
            str(self.root / name),
            "--num-cpus",
            str(spec.num_cpus),
            "--object-store-memory",
            str(OBJECT_STORE),
            "--node-ip-address",
            "127.0.0.1",
            "--disable-usage-stats",
            *_ports(name == "head"),
        ]
        out = subprocess.run(
            cmd, env=self._env(docker_host), capture_output=True, text=True, timeout=120, start_new_session=True
        )
        if out.returncode != 0:
            raise RuntimeError(f"ray start of node {name} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")

    def _ray_nodes(self, n: int, timeout_s: float = 60) -> list[dict]:
        """ray.nodes() once `n` nodes are alive, read in a subprocess (this one stays without a Ray connection)."""
        code = (
            f"import json, ray; ray.init(address={self.address!r}, log_to_driver=False); "
            "print(json.dumps([x for x in ray.nodes() if x['Alive']]))"
        )
        deadline = time.monotonic() + timeout_s
        while True:
            out = subprocess.run(
                [sys.executable, "-c", code], env=self._env(), capture_output=True, text=True, timeout=120
            )
            nodes = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []
            if len(nodes) >= n or time.monotonic() > deadline:
                assert len(nodes) >= n, f"{len(nodes)} of {n} nodes alive:\n{out.stderr[-3000:]}"
                return nodes
            time.sleep(0.5)

    # -- during a test ----------------------------------------------------------------

    def docker_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.dockerd_pid is not None]

    def kill_node(self, name: str) -> None:
        """SIGKILL the node's raylet, as when its machine is lost: Ray's processes of the node exit (its worker
        processes without running atexit). Its Docker daemon lives on, as a machine's would after a raylet
        crash, so a test can see what the node left there."""
        node = self.nodes[name]
        os.kill(node.raylet_pid, signal.SIGKILL)
        node.alive = False
        deadline = time.monotonic() + 30
        while process_alive(node.raylet_pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def processes(self) -> list[int]:
        """Every process this cluster started that is still running (Ray's, dockerd's, and their children)."""
        me = os.getpid()
        return [p for p in _pids() if p != me and _environ(p).get(MARK) == str(self.root) and process_alive(p)]

    # -- stop -------------------------------------------------------------------------

    @staticmethod
    def _kill(pids: list[int], sig: signal.Signals, wait_s: float) -> None:
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + wait_s
        while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        """Remove the containers on the cluster's daemons and stop them, kill every process the cluster started
        (by pid: SIGKILL, as `ray stop --force`; on SIGTERM Ray's processes take 10 s and more), delete its dir."""
        for d in self.daemons.values():
            d.stop()
        for _ in range(3):
            self._kill(self.processes(), signal.SIGKILL, 10)
        _unmount_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)
