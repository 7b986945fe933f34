"""The image tag follows the content of sandboxes/, a current image is reused, not rebuilt, and an image shipped to
another daemon runs there."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from agentrl.sandbox.image import content_hash, ensure_image, image_tag


def test_content_hash_tracks_files_not_caches(tmp_path):
    (tmp_path / "python").mkdir()
    (tmp_path / "python" / "Dockerfile").write_text("FROM x\n")
    before = content_hash(tmp_path)
    (tmp_path / "python" / "__pycache__").mkdir()
    (tmp_path / "python" / "__pycache__" / "e.pyc").write_bytes(b"\0")
    assert content_hash(tmp_path) == before
    (tmp_path / "python" / "Dockerfile").write_text("FROM y\n")
    assert content_hash(tmp_path) != before
    (tmp_path / "python" / "Dockerfile").write_text("FROM x\n")
    assert content_hash(tmp_path) == before
    (tmp_path / "python" / "Dockerfile").rename(tmp_path / "python" / "Dockerfile2")
    assert content_hash(tmp_path) != before  # names count, not only bytes


@pytest.mark.docker
def test_current_image_is_reused(docker_client, sandbox_image):
    assert sandbox_image == image_tag()
    messages = []
    t0 = time.monotonic()
    assert ensure_image(docker_client, log=messages.append) == sandbox_image
    assert time.monotonic() - t0 < 2 and messages == [f"sandbox image {sandbox_image} is up to date"]


@pytest.mark.docker
async def test_a_process_keeps_the_image_it_started_with(sandbox_image, monkeypatch, tmp_path):
    """A checkout that changes under a run (an edit of the executor, a pull) must not stop its container starts."""
    from agentrl.sandbox import DockerSandbox, image
    from agentrl.sandbox.docker_sandbox import default_image

    shutil.copytree(image.sandboxes_dir(), tmp_path / "sandboxes")
    monkeypatch.setattr(image, "sandboxes_dir", lambda: tmp_path / "sandboxes")
    default_image.cache_clear()
    try:
        first = await DockerSandbox.create()
        await first.close()
        with open(tmp_path / "sandboxes" / "python" / "executor.py", "a") as f:
            f.write("# edited during the run\n")
        assert image_tag() != sandbox_image  # what a new process would look for, and not find
        second = await DockerSandbox.create()
        try:
            assert second.container.attrs["Config"]["Image"] == sandbox_image
            assert (await second.run(["true"])).ok
        finally:
            await second.close()
    finally:
        default_image.cache_clear()


@pytest.mark.docker
@pytest.mark.slow  # the fast tier is at its budget; tests/cluster ships the image to real nodes' daemons
async def test_an_exported_image_runs_on_a_daemon_that_lacked_it(docker_client, sandbox_image, monkeypatch):
    """What a Docker node of a cluster gets before its first episode (agentrl.rollout.placement): the image saved
    from this daemon, loaded into an empty one, runs a sandbox there."""
    from ray_cluster import Dockerd

    from agentrl.sandbox import DockerSandbox, reaper
    from agentrl.sandbox.docker_sandbox import docker_client as cached_client
    from agentrl.sandbox.image import export_image, image_exists, import_image

    with pytest.raises(RuntimeError, match="agentrl sandbox build"):
        export_image(docker_client, "agentrl-sandbox-python:no-such-tag")
    root = Path(tempfile.mkdtemp(prefix="dk-", dir="/tmp"))  # short: the daemon's socket paths live under it
    try:
        with Dockerd.start(root) as empty:
            assert not image_exists(empty.client(), sandbox_image)
            import_image(empty.client(), export_image(docker_client, sandbox_image), sandbox_image)
            reaper.install(docker_client)  # once per process: its exit cleanup is the main daemon's, not this one's
            monkeypatch.setenv("DOCKER_HOST", empty.host)
            cached_client.cache_clear()
            sb = await DockerSandbox.create()
            try:
                assert empty.client().containers.get(sb.container.id).status == "running"
                assert (await sb.run(["python3", "-c", "print(6 * 7)"], timeout_s=10)).stdout == "42\n"
            finally:
                await sb.close()
    finally:
        monkeypatch.undo()
        cached_client.cache_clear()
        shutil.rmtree(root, ignore_errors=True)
