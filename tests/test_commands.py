"""The `agentrl` command in this process, where coverage sees it: `python -m agentrl` is the typer app, and
`agentrl envs new` writes a package whose env compiles. The real command runs as a subprocess in the other
tests (tests/cli.py); tests/env/test_plugins.py installs what `envs new` writes."""

import runpy
import sys

import pytest
from typer.testing import CliRunner

from agentrl.cli import app


def test_python_dash_m_agentrl_is_the_command(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["agentrl", "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("agentrl", run_name="__main__")
    assert e.value.code == 0
    shown = capsys.readouterr().out
    assert all(command in shown for command in ("train", "eval", "view", "serve", "sandbox", "envs", "sft"))


def test_envs_new_writes_the_package_in_process(tmp_path):
    result = CliRunner().invoke(app, ["envs", "new", "word_count", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    root = tmp_path / "word_count"
    assert {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} == {
        "pyproject.toml",
        "README.md",
        "word_count_env/__init__.py",
        "word_count_env/env.py",
        "tests/test_env.py",
    }
    pyproject = (root / "pyproject.toml").read_text()
    assert 'name = "agentrl-env-word-count"' in pyproject and '[project.entry-points."agentrl.envs"]' in pyproject
    env = (root / "word_count_env" / "env.py").read_text()
    compile(env, "env.py", "exec")
    assert "class WordCountEnv" in env
    again = CliRunner().invoke(app, ["envs", "new", "word_count", "--dir", str(tmp_path)])
    assert again.exit_code == 1 and "already exists" in again.output


def test_envs_new_agent_writes_an_agent_package(tmp_path):
    result = CliRunner().invoke(app, ["envs", "new", "--agent", "bash_loop", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    root = tmp_path / "bash_loop"
    pyproject = (root / "pyproject.toml").read_text()
    assert 'bash_loop = "bash_loop_agent.agent:AGENT"' in pyproject
    agent = (root / "bash_loop_agent" / "agent.py").read_text()
    compile(agent, "agent.py", "exec")
    assert "async def run(task" in agent and 'env="repo_fix"' in agent
