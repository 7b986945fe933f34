"""Build the sandbox image, online (`docker build` on python:3.12-slim) or offline.

The image is tagged with a content hash of `sandboxes/`, so an image is rebuilt
exactly when the Dockerfile or the executor changed. Offline (no registry, or
`offline=True`), the base is a Debian rootfs with python3 made by `debootstrap`
and `docker import`-ed, then the same Dockerfile is built on it with
`--build-arg BASE=...`: one definition, two bases.

The test tools of `sandboxes/python/requirements.txt` (pytest) are pure-Python wheels that pip on the host
unpacks into the build context (`site/`): nothing inside Docker needs a network, and an air-gapped host
passes a folder of those wheels (`wheels=`, `agentrl sandbox build --wheels DIR`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
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
    wheels: Path | None = None,
    log: Callable[[str], None] = print,
) -> str:
    """Return the tag of an up-to-date sandbox image, building it if needed.

    base: a base image to build on (must have python3 >= 3.9). Default: pull
    python:3.12-slim, or bootstrap a Debian base offline when that fails.
    wheels: a folder holding requirements.txt's wheels, for a host without a package index.
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
    _build(client, tag, base, wheels)
    return tag


def _build(client: docker.DockerClient, tag: str, base: str, wheels: Path | None) -> None:
    with tempfile.TemporaryDirectory(prefix="agentrl-build-") as tmp:
        context = build_context(Path(tmp) / "context", wheels=wheels)
        try:
            # network_mode none: every file the build needs is in its context (wheels installed on the host), and a
            # build that reaches no network does not depend on the engine's bridge either
            client.images.build(
                path=str(context), tag=tag, buildargs={"BASE": base}, rm=True, pull=False, network_mode="none"
            )
        except docker.errors.BuildError as e:
            lines = "".join(chunk.get("stream", "") for chunk in e.build_log)
            raise RuntimeError(f"building {tag} on {base} failed: {e.msg}\n{lines[-4000:]}") from e


def instance_image(
    client: docker.DockerClient, tarball: Path, *, wheels: Path | None = None, log: Callable[[str], None] = print
) -> str:
    """The sandbox image for a repository instance's own image (a `docker save` tarball with its dependencies and
    python3): the sandbox's Dockerfile built on it, so its containers run the executor, locked down as every
    sandbox is. Tagged by the sandbox definition and the tarball's bytes; built once."""
    h = hashlib.sha256()
    with open(tarball, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    tag = f"{image_tag()}-{h.hexdigest()[:12]}"
    if image_exists(client, tag):
        return tag
    with open(tarball, "rb") as f:
        loaded = client.images.load(f)
    if not loaded:
        raise RuntimeError(f"{tarball} holds no image (make it with `docker save IMAGE -o FILE`)")
    log(f"building {tag} on {loaded[0].id} (from {tarball})")
    _build(client, tag, loaded[0].id, wheels)
    return tag


def build_context(dest: Path, *, wheels: Path | None = None) -> Path:
    """`sandboxes/python/` copied to `dest`, with requirements.txt's packages unpacked into `dest/site` by this
    interpreter's pip (from its index, or only from the folder `wheels`). RuntimeError with pip's own words when
    it cannot get them."""
    shutil.copytree(sandboxes_dir() / "python", dest, ignore=shutil.ignore_patterns("__pycache__"))
    _unpack_requirements(dest / "requirements.txt", dest / "site", wheels)
    return dest


def _unpack_requirements(requirements: Path, dest: Path, wheels: Path | None) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary=:all:",
        "--no-compile",
        "--target",
        str(dest),
        "-r",
        str(requirements),
    ]
    if wheels is not None:
        cmd += ["--no-index", "--find-links", str(wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        where = f"the folder {wheels}" if wheels is not None else "the package index"
        raise RuntimeError(
            f"could not get the sandbox's test tools (sandboxes/python/requirements.txt) from {where}:\n"
            f"{proc.stderr[-2000:]}\nOn a host without an index, download those wheels elsewhere "
            "(`pip download --no-deps --only-binary=:all: -r requirements.txt -d DIR`) and pass --wheels DIR."
        )


# -- what bwrap sandboxes bind in: a root filesystem and the test tools -----------------------


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrl"


def rootfs_dir() -> Path:
    """The sandbox image's root filesystem for bwrap sandboxes (`export_rootfs`). Not keyed by the image's tag: the
    executor and the test tools are bound in from this checkout (`site_dir`), so the root need only hold python3
    and its libraries, and an edit of the executor does not leave bwrap without it."""
    return cache_dir() / "rootfs" / "sandbox-python"


def site_dir() -> Path:
    """requirements.txt's packages unpacked for bwrap sandboxes (bound in read-only), keyed by that file's bytes."""
    requirements = sandboxes_dir() / "python" / "requirements.txt"
    return cache_dir() / "site" / hashlib.sha256(requirements.read_bytes()).hexdigest()[:12]


def ensure_site(*, wheels: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """`site_dir()`, unpacked by pip if it is not there yet (RuntimeError with pip's words when it cannot be)."""
    dest = site_dir()
    if dest.is_dir():
        return dest
    log(f"unpacking the sandbox's test tools into {dest}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        _unpack_requirements(sandboxes_dir() / "python" / "requirements.txt", Path(tmp) / "site", wheels)
        (Path(tmp) / "site").rename(dest)
    return dest


def export_rootfs(
    client: docker.DockerClient, tag: str, *, force: bool = False, log: Callable[[str], None] = print
) -> Path:
    """The image `tag`'s filesystem unpacked at `rootfs_dir()` (a container's `docker export`), for bwrap sandboxes.
    Redone when the image changed (its id is kept beside it) or with `force`."""
    dest = rootfs_dir()
    image_id = client.images.get(tag).id
    stamp = dest.parent / f"{dest.name}.image"
    if not force and dest.is_dir() and stamp.is_file() and stamp.read_text() == image_id:
        return dest
    log(f"exporting {tag}'s root filesystem to {dest} (for bwrap sandboxes)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    container = client.containers.create(tag, entrypoint=["true"], network_mode="none")
    try:
        tar = subprocess.Popen(["tar", "-x", "--numeric-owner", "-C", str(staging)], stdin=subprocess.PIPE)
        try:
            for chunk in container.export():
                tar.stdin.write(chunk)
        finally:
            tar.stdin.close()
            if tar.wait() != 0:
                raise RuntimeError(f"unpacking {tag}'s filesystem into {staging} failed")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        container.remove(force=True)
    old = dest.parent / f".{dest.name}-old"
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    staging.chmod(0o755)
    staging.rename(dest)
    stamp.write_text(image_id)
    shutil.rmtree(old, ignore_errors=True)
    return dest


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def size_bytes(size: str | int) -> int:
    """Docker's size notation ("512m", "1g", "65536"), binary units, as bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)b?", str(size).strip().lower())
    if m is None:
        raise ValueError(f"not a size: {size!r} (bytes, or a number with k, m, g or t)")
    return int(float(m[1]) * _UNITS[m[2]])


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
