"""Shared fixtures: a real Docker engine and the real sandbox image.

Docker tests fail (not skip) without an engine: `bash scripts/test.sh` starts one.
"""

from __future__ import annotations

import pytest

from agentrl.sandbox import SandboxError, reaper
from agentrl.sandbox.docker_sandbox import docker_client as _docker_client


def _ours(client) -> set[str]:
    return {c.name for c in client.containers.list(all=True, filters={"label": reaper.LABEL}, ignore_removed=True)}


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
