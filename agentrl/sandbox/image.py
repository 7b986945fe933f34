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

import contextlib
import errno
import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import stat
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
    were /, as Docker resolves it unpacking in a chroot: folder by folder, by descriptor, never following a link
    on the host (`_Tree`), so that whatever the members are, nothing is written, linked, removed, or has its mode
    or owner changed outside `dest`. A hard link must name a regular file of the image (ValueError else)."""
    if not tarfile.is_tarfile(tarball):
        raise ValueError(f"{tarball} is not a tar file: make one with `docker save IMAGE -o FILE`")
    dest.mkdir(parents=True, exist_ok=True)
    dir_modes: dict[str, int] = {}  # set last: a folder of the image may be read-only to the user unpacking it
    tree = _Tree(str(dest))
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
                    _apply_layer(layer, tree, dir_modes)
        # deepest first, so that a folder made read-only does not bar the way to those under it
        for path, mode in sorted(dir_modes.items(), key=lambda item: -item[0].count("/")):
            fd = tree.open_real(path)  # None when a link or a file has taken the folder's place since
            if fd is not None:
                try:
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
    except tarfile.TarError as e:
        raise ValueError(f"{tarball}: a layer cannot be read ({' '.join(str(e).split())})") from None
    finally:
        tree.close()


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


def _apply_layer(layer: tarfile.TarFile, tree: _Tree, dir_modes: dict[str, int]) -> None:
    """Write one layer's members over `tree`'s root, whiteouts applied. Every change is made by a descriptor of
    the folder it is in (`_Tree.folder`) to one name in it, never following a link that name is: so it stays in
    the root, whatever the members are. `dir_modes` gets each folder's mode by its real path in the root."""
    own: set[str] = set()  # the real paths of what this layer wrote: an opaque whiteout keeps them
    for member in layer:
        rel = _rel(member.name)
        if rel == ".":
            continue  # the root folder itself
        folder, base = posixpath.split(rel)
        if base.startswith(WHITEOUT):
            if base != OPAQUE and base.startswith(WHITEOUT * 2):
                continue  # `.wh..wh.*`: aufs's own bookkeeping
            name = None if base == OPAQUE else _name(base[len(WHITEOUT) :], member.name)
            found = tree.folder(folder, member.name, create=False)
            if found is not None:  # else there is nothing to delete
                try:
                    if name is not None:
                        tree.remove(found[0], name)
                    else:
                        tree.forget()  # what it empties may be on the way to a folder known
                        _empty(found[0], found[1], own)
                finally:
                    os.close(found[0])
            continue
        if not (member.isdir() or member.isreg() or member.issym() or member.islnk()):
            continue
        # a hard link's target first: one to what is not a regular file of the image is refused
        source = _hard_link_source(tree, member) if member.islnk() else None
        try:
            parent, real = tree.folder(folder, member.name, create=True)
            try:
                own.add(posixpath.join(real, base))
                _write(layer, member, tree, parent, base, source)
                if member.isdir():
                    dir_modes[posixpath.join(real, base)] = member.mode & _MODE_BITS
            finally:
                os.close(parent)
        finally:
            if source is not None:
                os.close(source[0])


def _write(
    layer: tarfile.TarFile,
    member: tarfile.TarInfo,
    tree: _Tree,
    parent: int,
    base: str,
    source: tuple[int, str, os.stat_result] | None,
) -> None:
    """Put the member (a folder, a file, a symlink or a hard link to `source`) at the name `base` of the folder
    `parent` (a descriptor), in place of what is there; owned as in the image when run as root."""
    root_owner = os.geteuid() == 0  # then the image's owners, by number (names would be the host's)
    if member.isdir():
        if not _is_real_dir(parent, base):
            tree.remove(parent, base)
            os.mkdir(base, 0o700, dir_fd=parent)
        fd = os.open(base, _DIR_FLAGS, dir_fd=parent)  # a folder, not a link: just made or checked so
        try:
            os.fchmod(fd, member.mode & _MODE_BITS | 0o700)  # its own mode last (`unpack_saved_image`)
            if root_owner:
                os.fchown(fd, member.uid, member.gid)
        finally:
            os.close(fd)
        return
    if member.isreg():
        tree.remove(parent, base)
        # O_EXCL: a name that is there again (nothing should be) fails, and is not written through
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(os.open(base, flags, 0o600, dir_fd=parent), "wb") as dst, layer.extractfile(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
            dst.flush()
            os.fchmod(dst.fileno(), member.mode & _MODE_BITS)
            if root_owner:
                os.fchown(dst.fileno(), member.uid, member.gid)
            # the time a .pyc file records of its source: kept, or every interpreter start recompiles it
            os.utime(dst.fileno(), (member.mtime, member.mtime))
        return
    if source is None:  # a symlink
        tree.remove(parent, base)
        os.symlink(member.linkname, base, dir_fd=parent)
        tree.forget()  # a folder's path may lead through it now
    else:
        src_fd, src_name, src_stat = source
        there = _lstat(parent, base)
        if there is None or not os.path.samestat(there, src_stat):  # else: already that file
            tree.remove(parent, base)
            try:
                os.link(src_name, base, src_dir_fd=src_fd, dst_dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:  # it was in the folder the link replaced
                raise ValueError(
                    f"the image's hard link {member.name!r} names {member.linkname!r}, which it removes"
                ) from None
    if root_owner:
        os.chown(base, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
    os.utime(base, (member.mtime, member.mtime), dir_fd=parent, follow_symlinks=False)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""open a folder, and fail (ELOOP, ENOTDIR) for a symlink or anything else"""
_MAX_LINKS = 40  # as the kernel's, in a path
_KNOWN_FOLDERS = 64  # the folders of a layer `_Tree` keeps open: its members come folder by folder


class _Tree:
    """A root folder whose paths are resolved as if it were / (a chroot): by descriptors, from the root's, one
    name at a time opened with O_NOFOLLOW, a symlink met on the way read and followed by hand (an absolute one from
    the root, `..` never above it). So every descriptor it gives is of a real folder under the root, whatever
    links and files the image holds. The folders last resolved are kept open; any change that could alter where a
    path leads (a link or folder removed, a link made) forgets them."""

    def __init__(self, root: str) -> None:
        self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.known: dict[str, tuple[int, str]] = {}  # a folder of the image -> (its descriptor, its real path)

    def close(self) -> None:
        self.forget()
        os.close(self.fd)

    def forget(self) -> None:
        for fd, _ in self.known.values():
            os.close(fd)
        self.known.clear()

    def folder(self, rel: str, member: str, *, create: bool) -> tuple[int, str] | None:
        """The folder `rel` of the image (a normalized path, "" for the root): a new descriptor of it, for the
        caller to close, and its real path under the root ("" for the root). Missing folders on the way are made
        with `create`; without it, None when one is missing or is not a folder. ValueError naming `member` for a
        path through a file, or through too many links."""
        found = self._known(rel, member, create)
        return None if found is None else (os.dup(found[0]), found[1])

    def _known(self, rel: str, member: str, create: bool) -> tuple[int, str] | None:
        """As `folder`, but the descriptor is the tree's, closed when it forgets it."""
        if rel == "":
            return self.fd, ""
        if (hit := self.known.pop(rel, None)) is not None:
            self.known[rel] = hit  # the most recently used last
            return hit
        up, name = posixpath.split(rel)
        above = self._known(up, member, create)
        if above is None:
            return None
        found = self._walk(above, [name], member, create)
        if found is not None:
            if len(self.known) >= _KNOWN_FOLDERS:
                oldest = next(iter(self.known))
                os.close(self.known.pop(oldest)[0])
            self.known[rel] = found
        return found

    def _walk(self, start: tuple[int, str], todo: list[str], member: str, create: bool) -> tuple[int, str] | None:
        """Resolve the names `todo` from the folder `start` (a descriptor not closed here, its real path): a new
        descriptor of where they lead and its real path, or None (see `folder`)."""
        fd, real = start
        parts = real.split("/") if real else []
        owned = False  # whether `fd` was opened here

        def go(new: int) -> None:
            nonlocal fd, owned
            if owned:
                os.close(fd)
            fd, owned = new, True

        links = 0
        todo = todo[::-1]  # popped from the end
        found = False
        try:
            while todo:
                part = todo.pop()
                if part in ("", "."):
                    continue
                if part == "..":  # the real parent, never above the root
                    if parts:
                        parts.pop()
                        go(self._open_parts(parts))
                    continue
                try:
                    new = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        return None
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    new = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    if not stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                        if not create:
                            return None
                        raise ValueError(
                            f"the image's file {member!r} lies under {'/'.join([*parts, part])!r}, which is no folder"
                        ) from None
                    links += 1
                    if links > _MAX_LINKS:
                        raise ValueError(f"the image's path {member!r} has too many levels of symbolic links") from None
                    target = os.readlink(part, dir_fd=fd)
                    if target.startswith("/"):
                        parts = []
                        go(os.dup(self.fd))
                    todo.extend(reversed(target.split("/")))
                    continue
                go(new)
                parts.append(part)
            if not owned:
                go(os.dup(fd))
            found = True
            return fd, "/".join(parts)
        finally:
            if owned and not found:  # None, or an error
                os.close(fd)

    def _open_parts(self, parts: list[str]) -> int:
        """A descriptor of the real folder at `parts` under the root (OSError if it is not one, links not followed)."""
        fd = os.dup(self.fd)
        try:
            for part in parts:
                new = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = new
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_real(self, real: str) -> int | None:
        """A new descriptor of the folder at the real path `real` under the root, or None when it is not one now
        (a link on the way, or a file, or nothing)."""
        try:
            return self._open_parts(real.split("/") if real else [])
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                return None
            raise

    def remove(self, parent: int, name: str) -> None:
        """Remove the name `name` from the folder `parent` (a folder with all it holds, links not followed)."""
        st = _lstat(parent, name)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            self.forget()  # a path may have led through it
            shutil.rmtree(name, dir_fd=parent)
        else:
            if stat.S_ISLNK(st.st_mode):
                self.forget()
            os.unlink(name, dir_fd=parent)


def _lstat(parent: int, name: str) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        return None


def _is_real_dir(parent: int, name: str) -> bool:
    st = _lstat(parent, name)
    return st is not None and stat.S_ISDIR(st.st_mode)


def _hard_link_source(tree: _Tree, member: tarfile.TarInfo) -> tuple[int, str, os.stat_result]:
    """The file a hard link member names, resolved in the root (a new descriptor of its folder, its name, its lstat):
    ValueError naming the member unless it is a regular file of the image (not a link, a folder or nothing)."""
    target = _rel(member.linkname)
    folder, name = posixpath.split(target)
    found = tree.folder(folder, member.name, create=False) if target != "." else None
    st = _lstat(found[0], name) if found is not None else None
    if st is None or not stat.S_ISREG(st.st_mode):
        if found is not None:
            os.close(found[0])
        raise ValueError(
            f"the image's hard link {member.name!r} names {member.linkname!r}, which is not a regular file of the image"
        )
    return found[0], name, st


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


def _empty(folder: int, real: str, keep: set[str]) -> None:
    """Remove what the folder `folder` (a descriptor; `real`, its real path) holds, except the real paths in `keep`
    (and what they hold). Links are not followed."""
    for name in os.listdir(folder):
        child = posixpath.join(real, name)
        if child not in keep:
            if _is_real_dir(folder, name):
                shutil.rmtree(name, dir_fd=folder)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=folder)
        elif _is_real_dir(folder, name):
            fd = os.open(name, _DIR_FLAGS, dir_fd=folder)
            try:
                _empty(fd, child, keep)
            finally:
                os.close(fd)


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
