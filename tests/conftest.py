"""Shared fixtures: a real Docker engine and the real sandbox image.

Docker tests fail (not skip) without an engine: `bash scripts/test.sh` starts one. A test that needs
Docker says so with the `docker` marker; every other test runs with Docker out of reach (DOCKER_HOST
names a socket that does not exist), so a test that reaches Docker without the marker fails; one that
uses a Docker fixture without it is refused at collection.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock
from ownership import descends_from_us

from agentrl.sandbox import BwrapSandbox, BwrapSandboxConfig, DockerSandbox, SandboxError, reaper
from agentrl.sandbox.docker_sandbox import docker_client as _docker_client

# With RAY_AUTH_MODE unset, Ray 2.60 chooses the mode at each in-process `ray.init` (token for a new local cluster,
# which it then writes into this process's environment). A pytest worker whose earlier tests had started Ray saw
# test_learners' `ray.init` start a GCS that refused its own driver (InvalidAuthToken, "RAY_AUTH_MODE is currently
# 'disabled'"): tests/train on 2 workers failed so twice in 2 runs, and passed with the mode set here. The tests' Ray
# clusters stay on this machine; `agentrl` runs in tests set it too (tests/cli.py), or leave it out where a test runs
# `agentrl` as a user's shell would.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Fixtures that need the engine: a test using one (directly or through another fixture) needs the marker.
DOCKER_FIXTURES = {"docker_client", "sandbox_image", "short_run", "ray_cluster"}
NO_DOCKER = "unix:///nonexistent/agentrl-tests-without-the-docker-marker.sock"


def _ours(client, *, orphans: bool = True) -> set[str]:
    """agentrl containers this suite may have made: all but those of a live process outside it (another job's run
    on the same engine is not a leak of ours). orphans=False: only those of a live process of ours."""
    return {
        c.name
        for c in client.containers.list(all=True, filters={"label": reaper.LABEL}, ignore_removed=True)
        if (orphans and not reaper.owner_alive(c.labels)) or descends_from_us(int(c.labels.get(reaper.PID_LABEL) or 0))
    }


def _engine_ours(**kw: bool) -> set[str] | None:
    try:
        return _ours(_docker_client(), **kw)
    except SandboxError:
        return None  # no engine: docker tests will fail on their own


# Under pytest-xdist (scripts/test.sh runs the tiers on 2 workers) each worker is a process of its own: a container
# whose owner is gone may be another worker's, between its owner's death and its removal, so those are checked
# once every worker is done, by the controller (pytest_sessionstart / pytest_sessionfinish below).
XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if XDIST_WORKER:
    # Each worker's torch (here, and in the `agentrl` processes and Ray workers it starts, which inherit this) takes
    # its share of the cores: with torch's default of a thread per core in each worker, `agentrl sft` ran 3x slower
    # beside another worker (two at once: 265 s each against 85 s with a thread each).
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    )
_BEFORE = pytest.StashKey[set[str] | None]()


def _xdist_controller(config: pytest.Config) -> bool:
    return not XDIST_WORKER and config.getoption("dist", "no") != "no"


def pytest_sessionstart(session: pytest.Session) -> None:
    if _xdist_controller(session.config):
        session.config.stash[_BEFORE] = _engine_ours()


def pytest_sessionfinish(session: pytest.Session) -> None:
    before = session.config.stash.get(_BEFORE, None)  # set by the controller only
    if before is not None:
        left = (_engine_ours() or set()) - before
        if left:
            writer = session.config.get_terminal_writer()
            writer.line()
            writer.line(f"containers left behind: {sorted(left)}", red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def docker_client():
    return _docker_client()


@pytest.fixture(scope="session")
def sandbox_image(docker_client) -> str:
    from agentrl.sandbox.image import ensure_image

    return ensure_image(docker_client)


@pytest.fixture(scope="session")
def bwrap_site() -> Path:
    """The test tools bwrap sandboxes bind in (`agentrl sandbox build` unpacks them; pip, once per machine)."""
    from agentrl.sandbox.image import ensure_site

    with FileLock(Path(tempfile.gettempdir()) / "agentrl-site.lock"):  # one pip under pytest-xdist
        return ensure_site()


@pytest.fixture(params=[pytest.param("docker", marks=pytest.mark.docker), "bwrap"])
def isolating_factory(request):
    """A factory of sandboxes of each backend that isolates, for a case run on both: Docker's default, and bwrap's
    on the host's /usr (no Docker needed; the test tools bound in)."""
    if request.param == "docker":
        request.getfixturevalue("sandbox_image")
        return DockerSandbox.create
    request.getfixturevalue("bwrap_site")
    return functools.partial(BwrapSandbox.create, BwrapSandboxConfig(rootfs="host"))


@pytest.fixture
def bwrap_runtime(monkeypatch, bwrap_site) -> Path:
    """A bwrap runtime folder of the test's own (`agentrl.sandbox.bwrap.runtime_dir`, through TMPDIR, which the
    processes it starts inherit), so that every sandbox tree in it is the test's. Short: a Unix socket's path must
    fit in 108 bytes."""
    tmp = Path(tempfile.mkdtemp(prefix="arl-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(tmp))
    yield tmp / f"agentrl-{os.getuid()}"
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def short_run(tmp_path_factory):
    """One real 2-iteration `agentrl train` (short_run.two_iterations), shared: read it, or copy it to change it.
    Under pytest-xdist the first worker to need it runs it, the others wait and read the same folder."""
    from short_run import ShortRun, two_iterations

    if not XDIST_WORKER:
        return two_iterations(tmp_path_factory.mktemp("short-run"))
    shared = tmp_path_factory.getbasetemp().parent  # every worker's base folder is under it
    with FileLock(shared / "short-run.lock"):
        made = shared / "short-run.json"
        if not made.exists():
            (shared / "short-run").mkdir()
            made.write_text(json.dumps(two_iterations(shared / "short-run"), default=str))
        folder, stdout, stderr = json.loads(made.read_text())
        return ShortRun(Path(folder), stdout, stderr)


@pytest.fixture(scope="session", autouse=True)
def no_container_left_behind():
    """After the suite (before any atexit cleanup), no agentrl container it made may exist (under pytest-xdist: none
    of a live process of this worker's; the controller checks the orphans)."""
    before = _engine_ours(orphans=not XDIST_WORKER)
    yield
    if before is not None:
        left = (_engine_ours(orphans=not XDIST_WORKER) or set()) - before
        assert not left, f"containers left behind: {sorted(left)}, made by {_makers(left)}"


_SEEN: dict[str, str] = {}
"""container -> the Docker test after which this process first saw it: a leak's likely maker"""


@pytest.fixture(autouse=True)
def _note_new_containers(request):
    yield
    if request.node.get_closest_marker("docker") is not None:
        for name in _engine_ours(orphans=False) or ():
            _SEEN.setdefault(name, request.node.nodeid)


def _makers(names: set[str]) -> list[str]:
    """Who made each container: its owner's pid, that process's command line while it lives, and the test after
    which it was first seen."""
    out = []
    for name in sorted(names):
        pid = _docker_client().containers.get(name).labels.get(reaper.PID_LABEL, "?")
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            cmd = "(gone)"
        out.append(f"{name}: pid {pid} {cmd}, first seen after {_SEEN.get(name, 'no docker test')}")
    return out


# Under pytest-xdist's --dist loadfile a worker takes a whole file at a time, and xdist hands the files out with the
# most tests first by default: a file of one long test could come last and leave the other worker idle for as long.
# scripts/test.sh passes --no-loadscope-reorder, and the files go out longest first: those below by their summed
# durations (seconds, fast tier / slow tier, 2 workers on the dev VM on 11-29), then the rest as collected.
# Stale figures cost only balance.
LONGEST = {
    "tests/env/test_repo_fix.py": (10, 241),
    "tests/train/test_async.py": (0, 217),
    "tests/train/test_learners.py": (0, 205),
    "tests/test_gpu_check.py": (0, 150),
    "tests/train/test_pipeline.py": (0, 132),
    "tests/view/test_view.py": (0, 60),  # 132, placed after test_pipeline.py has made the short run they share
    "tests/eval/test_bench.py": (9, 113),
    "tests/tasks/test_repos.py": (20, 110),
    "tests/train/test_sft.py": (4, 87),
    "tests/engine/test_plugin_engine.py": (0, 56),
    "tests/rollout/test_agents.py": (9, 53),
    "tests/rollout/test_workers.py": (0, 50),
    "tests/train/test_logprobs.py": (2, 49),
    "tests/train/test_fsdp.py": (28, 48),
    "tests/rollout/test_controller.py": (48, 35),
    "tests/runs/test_compat.py": (31, 0),
    "tests/sandbox/test_hostile.py": (32, 0),
    "tests/engine/test_openai_serve.py": (31, 0),
    "tests/engine/test_fleet.py": (31, 0),
    "tests/sandbox/test_cli_and_reaper.py": (29, 0),
    "tests/tasks/test_procedural.py": (27, 0),
    "tests/train/test_loop.py": (25, 0),
    "tests/rollout/test_chat_serve.py": (21, 0),
    "tests/env/test_builtin_envs.py": (20, 40),
    "tests/rollout/test_local_pool.py": (16, 0),
    "tests/rollout/test_long_episodes.py": (15, 40),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = 0 if config.getoption("markexpr").strip() == "not slow" else 1
    items.sort(key=lambda i: -LONGEST.get(i.nodeid.split("::")[0], (0, 0))[tier])  # stable: files stay whole
    unmarked = [
        i.nodeid
        for i in items
        if DOCKER_FIXTURES & set(getattr(i, "fixturenames", ())) and i.get_closest_marker("docker") is None
    ]
    if unmarked:
        raise pytest.UsageError(f"these use a Docker fixture but lack @pytest.mark.docker: {unmarked}")


@pytest.fixture(autouse=True)
def docker_out_of_reach(request, monkeypatch):
    """Without the `docker` marker, no Docker: in process (the process's cached client, made for an earlier
    test, is dropped too), in subprocesses and in a Ray started by the test. A Ray actor started earlier
    keeps the environment it started with: tests/rollout/ starts Ray once per module, in modules of docker tests."""
    if request.node.get_closest_marker("docker") is None:
        monkeypatch.setenv("DOCKER_HOST", NO_DOCKER)
        _docker_client.cache_clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = (yield).get_result()
    if report.failed and item.get_closest_marker("docker") is None and "docker" in report.longreprtext.lower():
        report.sections.append(("docker", f"this test has no docker marker, so DOCKER_HOST={NO_DOCKER}"))
