"""Build the sandbox image, online (`docker build` on python:3.12-slim) or offline.

The image is tagged with a content hash of `sandboxes/`, so an image is rebuilt
exactly when the Dockerfile or the executor changed. Offline (no registry, or
`offline=True`), the base is a Debian rootfs with python3 made by `debootstrap`
and `docker import`-ed, then the same Dockerfile is built on it with
`--build-arg BASE=...`: one definition, two bases.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import docker
import docker.errors

IMAGE_REPO = "agentrl-sandbox-python"
ONLINE_BASE = "python:3.12-slim"
OFFLINE_BASE_REPO = "agentrl-base-debian"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SUITE = "bookworm"
# docker import keeps no image config, so the base gets a PATH (and a CMD) here.
_IMPORT_CHANGES = [
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    'CMD ["python3"]',
]


def sandboxes_dir() -> Path:
    """`sandboxes/` of a source checkout, or the copy packaged into the wheel."""
    pkg = Path(__file__).parents[1]  # the agentrl package
    for candidate in (pkg / "_sandboxes", pkg.parent / "sandboxes"):
        if (candidate / "python" / "Dockerfile").is_file():
            return candidate
    raise FileNotFoundError(f"sandboxes/ not found next to {pkg}: broken install?")


def content_hash(root: Path) -> str:
    """sha256 over every file's relative path and bytes, in sorted order."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def image_tag(root: Path | None = None) -> str:
    """Tag of the image built from `sandboxes/python/` (its build context, nothing else)."""
    return f"{IMAGE_REPO}:{content_hash(root or sandboxes_dir() / 'python')[:12]}"


def image_exists(client: docker.DockerClient, tag: str) -> bool:
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def ensure_image(
    client: docker.DockerClient,
    *,
    offline: bool = False,
    base: str | None = None,
    force: bool = False,
    mirror: str = DEBIAN_MIRROR,
    suite: str = DEBIAN_SUITE,
    log: Callable[[str], None] = print,
) -> str:
    """Return the tag of an up-to-date sandbox image, building it if needed.

    base: a base image to build on (must have python3 >= 3.9). Default: pull
    python:3.12-slim, or bootstrap a Debian base offline when that fails.
    """
    tag = image_tag()
    if not force and image_exists(client, tag):
        log(f"sandbox image {tag} is up to date")
        return tag
    if base is None:
        base = ONLINE_BASE if not offline and _pull(client, ONLINE_BASE, log) else None
        if base is None:
            base = bootstrap_base(client, mirror=mirror, suite=suite, log=log)
    log(f"building {tag} on {base}")
    try:
        client.images.build(
            path=str(sandboxes_dir() / "python"), tag=tag, buildargs={"BASE": base}, rm=True, pull=False
        )
    except docker.errors.BuildError as e:
        lines = "".join(chunk.get("stream", "") for chunk in e.build_log)
        raise RuntimeError(f"building {tag} on {base} failed: {e.msg}\n{lines[-4000:]}") from e
    return tag


def _pull(client: docker.DockerClient, ref: str, log: Callable[[str], None]) -> bool:
    if image_exists(client, ref):
        return True
    log(f"pulling {ref} ...")
    try:
        client.images.pull(ref)
        return True
    except docker.errors.APIError as e:
        log(f"cannot pull {ref} ({e.explanation or e}); building the base offline")
        return False


def bootstrap_base(
    client: docker.DockerClient,
    *,
    mirror: str = DEBIAN_MIRROR,
    suite: str = DEBIAN_SUITE,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> str:
    """debootstrap a minimal Debian with python3 and `docker import` it; reused once made."""
    tag = f"{OFFLINE_BASE_REPO}:{suite}"
    if not force and image_exists(client, tag):
        return tag
    if shutil.which("debootstrap") is None:
        raise RuntimeError(
            "building the sandbox base offline needs debootstrap: `apt-get install debootstrap` "
            "(or pass --base IMAGE with an image that has python3)"
        )
    with tempfile.TemporaryDirectory(prefix="agentrl-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        log(f"debootstrap {suite} from {mirror} (about a minute) ...")
        cmd = ["debootstrap", "--variant=minbase", "--include=python3", suite, str(rootfs), mirror]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed (needs root):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(rootfs / cache, ignore_errors=True)
        log(f"docker import {tag}")
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            client.api.import_image(src=tar.stdout, repository=OFFLINE_BASE_REPO, tag=suite, changes=_IMPORT_CHANGES)
        finally:
            tar.stdout.close()
            if tar.wait() != 0:
                raise RuntimeError(f"tar of {rootfs} failed")
    return tag


def export_image(client: docker.DockerClient, tag: str) -> bytes:
    """The image as a `docker save` tar (with its tag), to load into another daemon (`import_image`).

    Raises RuntimeError naming `agentrl sandbox build` when this daemon lacks it."""
    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        raise RuntimeError(
            f"sandbox image {tag} is not on this Docker daemon either, so it cannot be shipped to the nodes that "
            "lack it: run `agentrl sandbox build` here (or on every Docker node)"
        ) from None
    return b"".join(image.save(named=True))


def import_image(client: docker.DockerClient, data: bytes, tag: str) -> None:
    """Load a `docker save` tar (`export_image`) into this daemon and check that it brought `tag`."""
    client.images.load(data)
    if not image_exists(client, tag):
        raise RuntimeError(f"loading the shipped sandbox image did not produce {tag}")
