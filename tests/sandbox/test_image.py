"""The image tag follows the content of sandboxes/, a current image is reused, not rebuilt, and an image shipped to
another daemon runs there."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import docker.errors
import pytest

from agentrl.sandbox.image import (
    content_hash,
    ensure_image,
    image_tag,
    python_version,
    saved_image_rootfs,
    unpack_saved_image,
)


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


# -- a `docker save` tarball unpacked for bwrap sandboxes --------------------------------------


def layer(*members: tuple[str, str], owner: int = 0) -> bytes:
    """A layer tar: (name, what) pairs, what being a file's text, "dir", "link:TARGET" or "hard:TARGET"; each
    owned by the user and group `owner`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, what in members:
            info = tarfile.TarInfo(name)
            info.uid = info.gid = owner
            if what == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif what.startswith(("link:", "hard:")):
                info.type = tarfile.SYMTYPE if what.startswith("link:") else tarfile.LNKTYPE
                info.linkname = what[5:]
                tar.addfile(info)
            else:
                info.size, info.mode = len(what), 0o644
                tar.addfile(info, io.BytesIO(what.encode()))
    return buf.getvalue()


def saved(path: Path, *layers: bytes) -> Path:
    """A tarball laid out as `docker save` lays one out (manifest.json naming each layer's tar), at `path`."""
    names = [f"{i}/layer.tar" for i in range(len(layers))]
    with tarfile.open(path, "w") as tar:
        for name, data in [
            ("manifest.json", json.dumps([{"Layers": names}]).encode()),
            *zip(names, layers, strict=True),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_whiteouts_delete_what_the_layers_below_left(tmp_path):
    """`.wh.NAME` deletes NAME (a file or a folder); `.wh..wh..opq` empties its folder of the lower layers' files
    and keeps its own layer's, wherever in the layer it comes."""
    base = layer(
        ("etc/gone", "x"),
        ("etc/kept", "k"),
        ("old/sub/deep", "d"),
        ("data/a", "a"),
        ("data/sub/b", "b"),
    )
    top = layer(("etc/.wh.gone", ""), ("data/new", "n"), ("data/.wh..wh..opq", ""), ("old/.wh.sub", ""))
    root = tmp_path / "root"
    unpack_saved_image(saved(tmp_path / "img.tar", base, top), root)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "data",
        "data/new",
        "etc",
        "etc/kept",
        "old",
    ]


def test_no_path_of_an_image_leads_out_of_its_root(tmp_path, monkeypatch):
    """Links are followed inside the root (as in Docker's chroot), wherever they point: an absolute link, one up
    past the root, a hard link through them. A name that leaves the root is refused, and so is what is not a
    `docker save` tarball; saved_image_rootfs then keeps nothing, nor does it for an image without python3."""
    outside = tmp_path / "outside"
    outside.mkdir()
    links = layer(("abs", f"link:{outside}"), ("up", "link:../../.."), ("etc", "dir"))
    through = layer(("abs/x", "via abs"), ("up/y", "via up"), ("etc/h", "hard:abs/x"))
    root = tmp_path / "root"
    unpack_saved_image(saved(tmp_path / "links.tar", links, through), root)
    assert list(outside.iterdir()) == []
    assert (root / str(outside)[1:] / "x").read_text() == "via abs" and (root / "y").read_text() == "via up"
    assert (root / "etc" / "h").stat().st_ino == (root / str(outside)[1:] / "x").stat().st_ino

    escape = saved(tmp_path / "escape.tar", layer(("a/../../escaped", "out")))
    with pytest.raises(ValueError, match="leaves its root"):
        unpack_saved_image(escape, tmp_path / "root2")
    assert not (tmp_path / "escaped").exists()
    plain = tmp_path / "plain.tar"
    plain.write_bytes(layer(("etc/passwd", "")))
    with pytest.raises(ValueError, match=r"not a `docker save` tarball \(no manifest.json\)"):
        unpack_saved_image(plain, tmp_path / "root3")
    (tmp_path / "text.tar").write_text("not a tar at all")
    with pytest.raises(ValueError, match="is not a tar file: make one with `docker save IMAGE -o FILE`"):
        unpack_saved_image(tmp_path / "text.tar", tmp_path / "root4")

    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    with pytest.raises(ValueError, match="leaves its root"):
        saved_image_rootfs(escape, log=lambda m: None)
    no_python = saved(tmp_path / "nopy.tar", layer(("usr/bin/python2.7", "")))
    with pytest.raises(ValueError, match=r"no python3 >= 3.9 .* \(found none\)"):
        saved_image_rootfs(no_python, log=lambda m: None)
    old = saved(tmp_path / "old.tar", layer(("usr/bin/python3.8", ""), ("usr/bin/python3", "link:python3.8")))
    with pytest.raises(ValueError, match=r"\(found python3.8\)"):
        saved_image_rootfs(old, log=lambda m: None)
    assert list((cache / "agentrl" / "rootfs").iterdir()) == []  # no rootfs kept, whole or in part
    python = layer(("usr/local/bin/python3.12", ""), ("usr/local/bin/python3", "link:/usr/local/bin/python3.12"))
    kept = saved_image_rootfs(saved(tmp_path / "good.tar", python), log=lambda m: None)
    assert python_version(kept) == (3, 12) and kept.parent == cache / "agentrl" / "rootfs"
    assert saved_image_rootfs(tmp_path / "good.tar", log=pytest.fail) == kept  # unpacked once, then found


def shell_image(client, tag: str) -> None:
    """An image of /bin/sh, rm and mkdir with their libraries, a folder and two files (`docker import`): a base a
    few MB big to RUN on, where the sandbox image would be 160 MB to save and unpack."""
    buf = io.BytesIO()
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=buf, mode="w") as tar:
        root = Path(tmp)
        for prog in ("/bin/sh", "/bin/rm", "/bin/mkdir"):
            ldd = subprocess.run(["ldd", prog], capture_output=True, text=True, check=True).stdout
            for path in [prog, *re.findall(r"(/\S+) \(0x", ldd)]:
                (root / path[1:]).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, root / path[1:])
        for path in ("etc/gone", "data/old", "data/sub/older"):
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text("old\n")
        tar.add(root, arcname=".")
    repository, name = tag.split(":")
    client.api.import_image_from_data(buf.getvalue(), repository=repository, tag=name)


@pytest.mark.docker
def test_a_saved_image_unpacks_as_docker_ran_it(docker_client, tmp_path):
    """A real 2-layer image whose second layer deletes a file and replaces a folder (an opaque whiteout), saved
    with `docker save` and unpacked without Docker: what a container of it sees."""
    base, tag = "agentrl-test-shell:1", "agentrl-test-whiteouts:1"
    step = "rm /etc/gone && rm -r /data && mkdir /data && echo new > /data/only"
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text(f'FROM {base}\nRUN ["/bin/sh", "-c", "{step}"]\n')
    try:
        shell_image(docker_client, base)
        docker_client.images.build(path=str(tmp_path / "ctx"), tag=tag, rm=True, network_mode="none")
        with open(tmp_path / "img.tar", "wb") as f:
            for chunk in docker_client.images.get(tag).save(named=True):
                f.write(chunk)
    finally:
        for t in (tag, base):
            with contextlib.suppress(docker.errors.ImageNotFound):
                docker_client.images.remove(t, force=True)
    with tarfile.open(tmp_path / "img.tar") as outer:
        (top,) = json.load(outer.extractfile("manifest.json"))[0]["Layers"][1:]
        with tarfile.open(fileobj=outer.extractfile(top)) as diff:
            whiteouts = sorted(m.name for m in diff if ".wh." in m.name)
    assert whiteouts == ["data/.wh..wh..opq", "etc/.wh.gone"]  # what the test is about: both kinds
    root = tmp_path / "root"
    unpack_saved_image(tmp_path / "img.tar", root)
    assert not (root / "etc" / "gone").exists() and (root / "etc").is_dir()
    assert [p.name for p in (root / "data").iterdir()] == ["only"] and (root / "data" / "only").read_text() == "new\n"
    assert (root / "bin" / "sh").is_file() and python_version(root) is None


def hostile(tmp_path: Path, *members: tuple[str, str]) -> tuple[Path, Path]:
    """A one-layer image of `members` (as `layer` takes them, owned by 4242: as root, chowned so) and the folder
    to unpack it into."""
    return saved(tmp_path / "hostile.tar", layer(*members, owner=4242)), tmp_path / "root"


def test_a_hard_link_to_a_symlink_turns_no_folder_into_a_way_out(tmp_path):
    """A folder made a hard link to a symlink to a host folder (after a member made the
    folder's place known), and a file written under it. Refused, naming the member, and nothing lands outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    tarball, root = hostile(
        tmp_path,
        ("evil", f"link:{outside}"),
        ("a", "plain file"),
        ("a/.wh..wh..opq", ""),
        ("a", "hard:evil"),
        ("a/pwned", "written outside the rootfs"),
    )
    with pytest.raises(ValueError, match=r"hard link 'a' .*'evil'.* not a regular file"):
        unpack_saved_image(tarball, root)
    assert list(outside.iterdir()) == []


def test_a_hard_link_reaches_no_host_file(tmp_path):
    """A hard link whose target would be a host file (found through a folder turned into a link to the host) is
    refused: its lchown, as root, would give the host's file to the image's owner. One through a link to the host's
    folder is to the image's own file there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host\n")
    before = (outside / "secret").stat()
    tarball, root = hostile(
        tmp_path,
        ("evil", f"link:{outside}"),
        ("a", "plain file"),
        ("a/.wh..wh..opq", ""),
        ("a", "hard:evil"),
        ("h", "hard:a/secret"),
    )
    with pytest.raises(ValueError, match="hard link"):
        unpack_saved_image(tarball, root)
    assert (outside / "secret").stat().st_nlink == 1 and not (root / "h").exists()
    after = (outside / "secret").stat()
    assert (after.st_uid, after.st_mode, after.st_mtime) == (before.st_uid, before.st_mode, before.st_mtime)
    tarball, root = hostile(tmp_path, ("evil", f"link:{outside}"), ("evil/secret", "image"), ("h", "hard:evil/secret"))
    unpack_saved_image(tarball, root)
    assert (root / "h").read_text() == "image" and (outside / "secret").read_text() == "host\n"
    assert (root / "h").stat().st_ino == (root / str(outside)[1:] / "secret").stat().st_ino


def test_a_folder_replaced_by_a_symlink_leads_nothing_out(tmp_path):
    """A folder of the image replaced by a symlink to a host folder (by a whiteout, in the same layer or a later
    one): members under it land inside the root, and the folder modes set last reach no host folder."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub").chmod(0o700)
    (outside / "file").write_text("host\n")
    (outside / "file").chmod(0o600)
    base = layer(("d", "dir"), ("d/sub", "dir"), ("d/file", "lower"))
    top = layer(("d/x", "x"), ("d", f"link:{outside}"), ("d/y", "y"), ("d/file", "upper"))
    root = tmp_path / "root"
    unpack_saved_image(saved(tmp_path / "img.tar", base, top), root)
    assert sorted(p.name for p in outside.iterdir()) == ["file", "sub"]
    assert (outside / "file").read_text() == "host\n" and (outside / "file").stat().st_mode & 0o777 == 0o600
    assert (outside / "sub").stat().st_mode & 0o777 == 0o700  # d/sub's 0o755 was not set on it
    inside = root / str(outside)[1:]
    assert (inside / "y").read_text() == "y" and (inside / "file").read_text() == "upper"
    assert (root / "d").is_symlink() and not (root / str(outside)[1:] / "x").exists()
    # a later layer's whiteout and symlink in its place
    root2 = tmp_path / "root2"
    unpack_saved_image(saved(tmp_path / "img2.tar", base, layer(("d", f"link:{outside}"))), root2)
    assert (outside / "sub").stat().st_mode & 0o777 == 0o700 and (root2 / "d").is_symlink()
