"""The image tag follows the content of sandboxes/, and a current image is reused, not rebuilt."""

from __future__ import annotations

import time

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
