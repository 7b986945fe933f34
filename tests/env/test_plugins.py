"""Envs from other installed packages: `agentrl envs new`, pip install, entry-point discovery."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli import agentrl

BIN = Path(sys.executable).parent


def run(*argv, cwd=None, check=True) -> subprocess.CompletedProcess:
    """A program that is not agentrl (pip, ruff, pytest, python -c)."""
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        pytest.fail(f"{argv} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def pip_install():
    installed = []

    def install(path: Path, dist: str) -> None:
        run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(path))
        installed.append(dist)

    yield install
    for dist in installed:
        run(sys.executable, "-m", "pip", "uninstall", "-q", "-y", dist)


@pytest.mark.slow  # the fast tier installs an env package and lists it below
def test_scaffolded_env_installs_lists_makes_and_passes_its_own_test(tmp_path, pip_install):
    out = agentrl("envs", "new", "wordcount", "--dir", str(tmp_path)).stdout
    root = tmp_path / "wordcount"
    assert f"created {root}" in out
    assert {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} == {
        "pyproject.toml",
        "README.md",
        "wordcount_env/__init__.py",
        "wordcount_env/env.py",
        "tests/test_env.py",
    }
    run(BIN / "ruff", "check", "--no-cache", str(root))
    pip_install(root, "agentrl-env-wordcount")

    listing = agentrl("envs", "list", cwd=tmp_path).stdout
    row = next(line for line in listing.splitlines() if "wordcount" in line)
    assert "agentrl-env-wordcount" in row and "cannot load" not in listing

    episode = textwrap.dedent("""
        import json, gymnasium, agentrl
        env = gymnasium.make("agentrl/wordcount-v0")
        obs, info = env.reset(seed=4)
        word, letter = info["task_id"].split("/")[1:]
        call = json.dumps({"name": "count", "arguments": {"text": word, "letter": letter}})
        obs, *_ = env.step(f"<tool_call>{call}</tool_call>")
        print(env.step(f"<answer>{obs[0]['content']}</answer>")[1:3])
    """)
    assert run(sys.executable, "-c", episode, cwd=tmp_path).stdout.strip() == "(1.0, True)"
    tests = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=root).stdout
    assert "3 passed" in tests

    shown = agentrl("envs", "show", "wordcount", cwd=tmp_path).stdout
    assert "count(text: string, letter: string)" in shown and "wordcount (" in shown


@pytest.mark.slow  # tests/test_commands.py writes the package in process; this one installs it
def test_a_scaffolded_agent_installs_lists_and_passes_its_own_test(tmp_path, pip_install):
    out = agentrl("envs", "new", "--agent", "bashloop", "--dir", str(tmp_path)).stdout
    root = tmp_path / "bashloop"
    assert f"created {root}" in out
    assert {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} == {
        "pyproject.toml",
        "README.md",
        "bashloop_agent/__init__.py",
        "bashloop_agent/agent.py",
        "tests/test_agent.py",
    }
    run(BIN / "ruff", "check", "--no-cache", str(root))
    assert "not in a sandbox" in (root / "bashloop_agent" / "agent.py").read_text()
    assert "restarted, not replayed" in (root / "README.md").read_text()
    pip_install(root, "agentrl-agent-bashloop")
    listing = agentrl("envs", "list", cwd=tmp_path).stdout
    row = next(line for line in listing.splitlines() if "bashloop" in line)
    assert "agentrl-agent-bashloop" in row and "cannot load" not in listing
    tests = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=root).stdout
    assert "2 passed" in tests


def test_a_package_whose_env_fails_to_import_is_reported_by_name(tmp_path, pip_install):
    pkg = tmp_path / "brokenenv"
    (pkg / "brokenenv_pkg").mkdir(parents=True)
    (pkg / "brokenenv_pkg" / "__init__.py").write_text("")
    (pkg / "brokenenv_pkg" / "env.py").write_text("raise ImportError('needs libfoo, which is not installed')\n")
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent("""
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"
        [project]
        name = "agentrl-env-brokenenv"
        version = "0.0.1"
        [project.entry-points."agentrl.envs"]
        brokenenv = "brokenenv_pkg.env:Env"
        [tool.hatch.build.targets.wheel]
        packages = ["brokenenv_pkg"]
    """)
    )
    pip_install(pkg, "agentrl-env-brokenenv")
    listing = agentrl("envs", "list", cwd=tmp_path).stdout
    assert "cannot load: ImportError: needs libfoo" in next(
        line for line in listing.splitlines() if "brokenenv" in line
    )
    assert "code_sandbox" in listing and "humaneval" in listing  # the others still list
    make = "import agentrl\ntry:\n    agentrl.make('brokenenv')\nexcept ImportError as e:\n    print(e)"
    out = run(sys.executable, "-c", make, cwd=tmp_path).stdout
    assert "agentrl/brokenenv-v0 (from agentrl-env-brokenenv) failed to import: needs libfoo" in out


def test_envs_new_refuses_bad_names_and_existing_directories(tmp_path):
    bad = agentrl("envs", "new", "Bad-Name", "--dir", str(tmp_path), check=False)
    assert bad.returncode == 1 and "must be lowercase" in bad.stderr
    agentrl("envs", "new", "twice", "--dir", str(tmp_path))
    again = agentrl("envs", "new", "twice", "--dir", str(tmp_path), check=False)
    assert again.returncode == 1 and "already exists" in again.stderr
