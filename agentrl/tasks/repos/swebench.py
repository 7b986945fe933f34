"""Load SWE-bench-style instances from a JSONL file (`swebench:PATH`), for `repo_fix` on real repositories.

One JSON object per line (docs/design.md, "Repository tasks", has the format):

    instance_id        unique id
    repo               the repository: a folder that is a git repository (read at `base_commit` with `git archive`),
                       or a tarball (.tar, .tar.gz, .tgz) of the tree at base_commit; relative to the file's folder
    base_commit        the commit the instance starts from
    problem_statement  the issue the agent reads
    patch              the gold patch (a unified diff of non-test files)
    test_patch         the diff that adds the hidden tests
    FAIL_TO_PASS       pytest node ids that the fix must make pass (a list, or SWE-bench's JSON-encoded list)
    PASS_TO_PASS       pytest node ids that must keep passing (same)
    image              optional: a `docker save` tarball of an image with the repository's dependencies (and
                       python3), relative to the file's folder; sandboxes of that instance run it, locked down as
                       every sandbox is

Other keys (SWE-bench's `version`, `created_at`, ...) are ignored. A tarball whose members all sit in one top folder
(GitHub's archives) is read from inside that folder. Files that are not UTF-8 text are left out of the repository.
Loading checks the fields; whether the tests grade what they claim is `agentrl envs validate-repos`'s job (it runs
them in sandboxes).
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentrl.tasks.repos.instance import RepoInstance
from agentrl.tasks.repos.taskset import LoadedRepos

log = logging.getLogger(__name__)

FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "patch",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)


def load_swebench(path: str | Path) -> LoadedRepos:
    """The instances of a SWE-bench-style JSONL file; ValueError naming the line and the field that is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    instances = []
    # A file's own lines: str.splitlines would also break at U+2028, U+2029 and U+0085, which JSON strings may hold.
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    instances.append(instance_from_record(json.loads(line), path.parent))
                except (ValueError, OSError) as e:
                    raise ValueError(f"{path}:{number}: {e}") from None
    return LoadedRepos(instances, name=f"swebench:{path.name}", description=f"repository instances from {path}")


def instance_from_record(record: dict[str, Any], root: Path) -> RepoInstance:
    if not isinstance(record, dict):
        raise ValueError(f"a record is a JSON object, not {type(record).__name__}")
    missing = [f for f in FIELDS if f not in record]
    if missing:
        raise ValueError(f"missing field(s) {missing}; a record has {list(FIELDS)} and optionally image")
    image = record.get("image")
    if not all(isinstance(v, str) for v in (record["repo"], record["base_commit"], "" if image is None else image)):
        raise ValueError("repo, base_commit and image are strings")
    repo = root / record["repo"]
    files = read_tree(repo, record["base_commit"])
    if image is not None and not (root / image).is_file():
        raise ValueError(f"image {image}: no such file under {root}")
    fields = {f: record[f] for f in FIELDS if f != "repo"}
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        if isinstance(fields[key], str):  # SWE-bench stores these lists JSON-encoded
            fields[key] = json.loads(fields[key])
    try:
        return RepoInstance(**fields, repo=files, image=str(root / image) if image else None)
    except ValidationError as e:
        raise ValueError(str(e)) from None


def read_tree(repo: Path, commit: str) -> dict[str, str]:
    """The text files of a git folder at `commit`, or of a tarball."""
    if repo.is_dir():
        if not (repo / ".git").exists():
            raise ValueError(f"{repo} is a folder but not a git repository")
        proc = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit], capture_output=True)
        if proc.returncode != 0:
            raise ValueError(f"git archive {commit} in {repo} failed: {proc.stderr.decode(errors='replace').strip()}")
        return _tar_files(tarfile.open(fileobj=io.BytesIO(proc.stdout)), str(repo))
    if repo.is_file():
        return _tar_files(tarfile.open(repo), str(repo))
    raise ValueError(f"repo {repo}: no such folder or tarball")


def _tar_files(tar: tarfile.TarFile, name: str) -> dict[str, str]:
    with tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        tops = {m.name.removeprefix("./").split("/")[0] for m in members}
        strip = len(tops) == 1 and all("/" in m.name.removeprefix("./") for m in members)
        files, binary = {}, []
        for m in members:
            path = m.name.removeprefix("./")
            path = path.split("/", 1)[1] if strip else path
            data = tar.extractfile(m).read()
            try:
                files[path] = data.decode("utf-8")
            except UnicodeDecodeError:
                binary.append(path)
    if binary:
        log.warning("%s: %d file(s) that are not UTF-8 text left out: %s", name, len(binary), ", ".join(binary[:5]))
    if not files:
        raise ValueError(f"{name} holds no text file")
    return files
