"""Shared fixtures: a real Docker engine and the real sandbox image.

Docker tests fail (not skip) without an engine: `bash scripts/test.sh` starts one. A test that needs
Docker says so with the `docker` marker; every other test runs with Docker out of reach (DOCKER_HOST
names a socket that does not exist), so a test that reaches Docker without the marker fails; one that
uses a Docker fixture without it is refused at collection.
"""

from __future__ import annotations

import pytest
from ownership import descends_from_us

from agentrl.sandbox import SandboxError, reaper
from agentrl.sandbox.docker_sandbox import docker_client as _docker_client

# Fixtures that need the engine: a test using one (directly or through another fixture) needs the marker.
DOCKER_FIXTURES = {"docker_client", "sandbox_image", "short_run", "ray_cluster"}
NO_DOCKER = "unix:///nonexistent/agentrl-tests-without-the-docker-marker.sock"


def _ours(client) -> set[str]:
    """agentrl containers this suite may have made: all but those of a live process outside it (another job's run
    on the same engine is not a leak of ours)."""
    return {
        c.name
        for c in client.containers.list(all=True, filters={"label": reaper.LABEL}, ignore_removed=True)
        if not reaper.owner_alive(c.labels) or descends_from_us(int(c.labels.get(reaper.PID_LABEL) or 0))
    }


@pytest.fixture(scope="session")
def docker_client():
    return _docker_client()


@pytest.fixture(scope="session")
def sandbox_image(docker_client) -> str:
    from agentrl.sandbox.image import ensure_image

    return ensure_image(docker_client)


@pytest.fixture(scope="session")
def short_run(tmp_path_factory):
    """One real 2-iteration `agentrl train` (short_run.two_iterations), shared: read it, or copy it to change it."""
    from short_run import two_iterations

    return two_iterations(tmp_path_factory.mktemp("short-run"))


@pytest.fixture(scope="session", autouse=True)
def no_container_left_behind():
    """After the suite (before any atexit cleanup), no agentrl container it made may exist."""
    try:
        before = _ours(_docker_client())
    except SandboxError:
        before = None  # no engine: docker tests will fail on their own
    yield
    if before is not None:
        left = _ours(_docker_client()) - before
        assert not left, f"containers left behind: {sorted(left)}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = [i.nodeid for i in items if DOCKER_FIXTURES & set(getattr(i, "fixturenames", ()))
                and i.get_closest_marker("docker") is None]  # fmt: skip
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
