"""A small repository instance the tests build themselves, in SWE-bench's format: a package with an off-by-one bug,
its fix, a hidden test, as a git repository and a JSONL record."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from agentrl.tasks.repos import make_patch

BUGGY = {
    "mathy/__init__.py": "from .ops import clamp\n",
    "mathy/ops.py": "def clamp(x, lo, hi):\n    return max(lo, min(x, hi - 1))\n",
    "tests/test_ops.py": "from mathy import clamp\n\n\ndef test_inside():\n    assert clamp(5, 0, 10) == 5\n",
}
FIXED = {**BUGGY, "mathy/ops.py": "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"}
EDGES = "from mathy import clamp\n\n\ndef test_top():\n    assert clamp(12, 0, 10) == 10\n"
HIDDEN = {**BUGGY, "tests/test_edges.py": EDGES}


def git_repo(root: Path, files: dict[str, str]) -> str:
    """A git repository at `root` holding `files` in one commit; its hash."""
    root.mkdir(parents=True)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")  # a binary file, left out of the repository
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "base"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def record(repo: str, commit: str, **over) -> dict:
    return {
        "instance_id": "mathy__clamp-1",
        "repo": repo,
        "base_commit": commit,
        "version": "1.0",
        "problem_statement": "clamp(12, 0, 10) gives 9, not 10",
        "patch": make_patch(BUGGY, FIXED),
        "test_patch": make_patch(BUGGY, HIDDEN),
        "FAIL_TO_PASS": json.dumps(["tests/test_edges.py::test_top"]),
        "PASS_TO_PASS": ["tests/test_ops.py::test_inside"],
        **over,
    }


def write_jsonl(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
