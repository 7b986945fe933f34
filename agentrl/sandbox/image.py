"""Build the sandbox image, online (`docker build` on python:3.12-slim) or offline.

The image is tagged with a content hash of `sandboxes/`, so an image is rebuilt
exactly when the Dockerfile or the executor changed. Offline (no registry, or
`offline=True`), the base is a Debian rootfs with python3 made by `debootstrap`
and `docker import`-ed, then the same Dockerfile is built on it with
`--build-arg BASE=...`: one definition, two bases.

The test tools of `sandboxes/python/requirements.txt` (pytest) are pure-Python wheels that pip on the host
unpacks into the build context (`site/`): nothing inside Docker needs a network, and an air-gapped host
passes a folder of those wheels (`wheels=`, `agentrl sandbox build --wheels DIR`).

bwrap sandboxes take a root filesystem as a folder: the sandbox image's (`export_rootfs`), or an instance's own
image unpacked from its `docker save` tarball with no Docker at all (`saved_image_rootfs`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
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
    tag = f"{image_tag()}-{file_sha256(tarball)[:12]}"
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


SANDBOX_MOUNTS = ("dev", "proc", "sys", "tmp", "run", "work", "code", "agentrl")
"""the folders a bwrap sandbox mounts its own over; the rest of its root filesystem is the image's, read-only"""


def make_mount_points(root: Path) -> None:
    """Make the `SANDBOX_MOUNTS` a root filesystem agentrl unpacked lacks (an image has no /code or /agentrl), so that
    bubblewrap can bind it whole (see bwrap's root arguments). An entry the image has is left as it is."""
    for name in SANDBOX_MOUNTS:
        if not os.path.lexists(root / name):
            (root / name).mkdir(mode=0o755)


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
    make_mount_points(staging)
    staging.chmod(0o755)
    staging.rename(dest)
    stamp.write_text(image_id)
    shutil.rmtree(old, ignore_errors=True)
    return dest


# -- an instance's own image (a `docker save` tarball) unpacked for bwrap ---------------------

WHITEOUT = ".wh."
"""a layer's file `.wh.NAME` deletes NAME of the layers below (the OCI image spec's whiteouts)"""
OPAQUE = ".wh..wh..opq"
"""a layer's file that empties its folder of everything the layers below put there"""
_MODE_BITS = 0o1777  # no set-id bits: bubblewrap grants no privilege by them, and on the host they would be the image's


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, as hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def saved_rootfs_dir(tarball: Path) -> Path:
    """Where `saved_image_rootfs` keeps the root filesystem of the image in `tarball`."""
    return cache_dir() / "rootfs" / f"saved-{file_sha256(tarball)[:16]}"


def saved_image_rootfs(tarball: Path, *, log: Callable[[str], None] = print) -> Path:
    """The root filesystem of the image in a `docker save` tarball, for bwrap sandboxes: unpacked once
    (`unpack_saved_image`) into `cache_dir()/rootfs/saved-SHA`, keyed by the tarball's bytes. It is unpacked beside
    and renamed into place, so a rootfs found there is whole. ValueError, in one line, when the tarball is not a
    `docker save` or its image has no python3 >= 3.9 to run the executor; then nothing is kept."""
    dest = saved_rootfs_dir(tarball)
    if dest.is_dir():
        return dest
    log(f"unpacking the image in {tarball} to {dest} (for bwrap sandboxes)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        unpack_saved_image(tarball, staging)
        version = python_version(staging)
        if version is None or version < (3, 9):
            found = "none" if version is None else f"python3.{version[1]}"
            raise ValueError(
                f"the image in {tarball} has no python3 >= 3.9 in /usr/local/bin or /usr/bin (found {found}), "
                "which a bwrap sandbox runs its executor with"
            )
        make_mount_points(staging)
        staging.chmod(0o755)
        try:
            staging.rename(dest)
        except OSError:
            if not dest.is_dir():
                raise
            shutil.rmtree(staging)  # another process unpacked the same tarball first
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def unpack_saved_image(tarball: Path, dest: Path) -> None:
    """Unpack the image of a `docker save` tarball into the folder `dest` as Docker applies it: the layers that
    manifest.json lists, in order, each a tar whose whiteouts delete what the layers below left (`.wh.NAME` deletes
    NAME, `.wh..wh..opq` empties its folder of all but this layer's own files). Device nodes and fifos are left out
    (a sandbox makes its own /dev), and so are set-id bits. ValueError, in one line, for a file that is not such a
    tarball or a member whose path leaves the root; `dest` then holds part of the image (unpack beside, as
    `saved_image_rootfs` does).

    tarfile reads the layers, but the members are written here, not by its extraction: that knows nothing of
    whiteouts, and its filters resolve symlinks on the host (a file under an absolute link such as var/run -> /run
    would be refused, or with no filter written outside `dest`). Here each path is resolved inside `dest` as if it
    were /, as Docker resolves it unpacking in a chroot."""
    if not tarfile.is_tarfile(tarball):
        raise ValueError(f"{tarball} is not a tar file: make one with `docker save IMAGE -o FILE`")
    dest.mkdir(parents=True, exist_ok=True)
    dir_modes: dict[str, int] = {}  # set last: a folder of the image may be read-only to the user unpacking it
    try:
        with tarfile.open(tarball) as outer:
            for name in _layers(outer, tarball):
                try:
                    blob = outer.extractfile(name)
                except KeyError:
                    blob = None
                if blob is None:
                    raise ValueError(f"{tarball}: manifest.json lists the layer {name}, which it does not hold")
                with blob, tarfile.open(fileobj=blob, mode="r|*") as layer:
                    _apply_layer(layer, str(dest), dir_modes)
    except tarfile.TarError as e:
        raise ValueError(f"{tarball}: a layer cannot be read ({' '.join(str(e).split())})") from None
    for path, mode in dir_modes.items():
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, mode)


def _layers(outer: tarfile.TarFile, tarball: Path) -> list[str]:
    """The layers manifest.json names, bottom first."""
    try:
        manifest = json.load(outer.extractfile("manifest.json") or io.BytesIO(b"null"))
    except KeyError:
        raise ValueError(
            f"{tarball} is not a `docker save` tarball (no manifest.json): make one with `docker save IMAGE -o FILE`"
        ) from None
    except ValueError as e:
        raise ValueError(f"{tarball}: its manifest.json is not JSON ({e})") from None
    if not (isinstance(manifest, list) and len(manifest) == 1 and isinstance(manifest[0], dict)):
        raise ValueError(f"{tarball}: its manifest.json must describe one image (`docker save IMAGE -o FILE`)")
    layers = manifest[0].get("Layers")
    if not (isinstance(layers, list) and all(isinstance(name, str) for name in layers)):
        raise ValueError(f"{tarball}: its manifest.json lists no Layers")
    return layers


def _apply_layer(layer: tarfile.TarFile, root: str, dir_modes: dict[str, int]) -> None:
    """Write one layer's members over `root`, whiteouts applied."""
    own: set[str] = set()  # what this layer wrote: an opaque whiteout keeps it
    folders: dict[str, str] = {}  # a folder of the image -> its place under root, until a link or folder changes

    def place(name: str) -> str:
        folder, base = posixpath.split(_rel(name))
        if folder not in folders:
            folders[folder] = _resolve(root, folder)
        return os.path.join(folders[folder], base)

    def remove(path: str) -> None:
        if os.path.islink(path) or os.path.isdir(path):
            folders.clear()  # a path may have led through it
        _remove(path)

    for member in layer:
        if _rel(member.name) == ".":
            continue  # the root folder itself
        path = place(member.name)
        parent, base = os.path.split(path)
        if base == OPAQUE:
            if os.path.isdir(parent):
                folders.clear()
                _empty(parent, own)
            continue
        if base.startswith(WHITEOUT):
            if not base.startswith(WHITEOUT * 2):  # `.wh..wh.*` else: aufs's own bookkeeping
                remove(os.path.join(parent, _name(base[len(WHITEOUT) :], member.name)))
            continue
        if not (member.isdir() or member.isreg() or member.issym() or member.islnk()):
            continue
        os.makedirs(parent, exist_ok=True)
        own.add(path)
        if member.isdir():
            if not os.path.isdir(path) or os.path.islink(path):
                remove(path)
                os.mkdir(path)
            os.chmod(path, member.mode & _MODE_BITS | 0o700)
            dir_modes[path] = member.mode & _MODE_BITS
        else:
            remove(path)
            if member.isreg():
                with layer.extractfile(member) as src, open(path, "xb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                os.chmod(path, member.mode & _MODE_BITS)
            elif member.issym():
                os.symlink(member.linkname, path)
                folders.clear()  # a path may lead through it now
            else:
                os.link(place(member.linkname), path, follow_symlinks=False)
            # the time a .pyc file records of its source: kept, or every interpreter start recompiles it
            os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)
        if os.geteuid() == 0:  # the image's owners, by number (names would be the host's)
            os.lchown(path, member.uid, member.gid)


def _rel(name: str) -> str:
    """A member's path relative to the root; ValueError for one that leaves it."""
    rel = posixpath.normpath(name.lstrip("/") or ".")
    if rel == ".." or rel.startswith("../"):
        raise ValueError(f"the image's file {name!r} leaves its root")
    return rel


def _name(name: str, member: str) -> str:
    if name in ("", ".", ".."):
        raise ValueError(f"the image's whiteout {member!r} names no file")
    return name


def _resolve(root: str, rel: str) -> str:
    """`rel` under `root`, each symlink on the way followed as if `root` were /: wherever a link points, the path
    stays inside."""
    todo = [p for p in rel.split("/") if p not in ("", ".")]
    done: list[str] = []
    links = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        path = os.path.join(root, *done, part)
        if os.path.islink(path):
            links += 1
            if links > 40:
                raise ValueError(f"the image's path {rel!r} has too many levels of symbolic links")
            target = os.readlink(path)
            if target.startswith("/"):
                done = []
            todo[:0] = [p for p in target.split("/") if p not in ("", ".")]
        else:
            done.append(part)
    return os.path.join(root, *done)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _empty(folder: str, keep: set[str]) -> None:
    """Remove what `folder` holds, except the paths in `keep` (and what they hold)."""
    for name in os.listdir(folder):
        child = os.path.join(folder, name)
        if child not in keep:
            _remove(child)
        elif os.path.isdir(child) and not os.path.islink(child):
            _empty(child, keep)


def python_version(root: Path) -> tuple[int, int] | None:
    """(3, minor) of the python3 a sandbox on the root filesystem `root` runs (the first on its PATH of
    /usr/local/bin and /usr/bin), read off its files: the interpreter's name (python3 -> python3.11), else its
    standard library's folder. Nothing of the image runs on the host. None when there is none."""
    for prefix in ("usr/local", "usr"):
        exe = Path(_resolve(str(root), f"{prefix}/bin/python3"))
        if not exe.is_file():
            continue
        if m := re.fullmatch(r"python3\.(\d+)", exe.name):
            return 3, int(m[1])
        stdlib = Path(_resolve(str(root), f"{prefix}/lib"))
        minors = [
            int(m[1]) for p in stdlib.glob("python3.*/os.py") if (m := re.fullmatch(r"python3\.(\d+)", p.parent.name))
        ]
        return (3, max(minors)) if minors else None
    return None


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
