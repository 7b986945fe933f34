"""The `agentrl` command in this process, where coverage sees it: `python -m agentrl` is the typer app, and
`agentrl envs new` writes a package whose env compiles. The real command runs as a subprocess in the other
tests (tests/cli.py); tests/env/test_plugins.py installs what `envs new` writes."""

import importlib.util
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cli import start_agentrl
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
    # it trains on its train side, so held-out evaluation has tasks it never trained on
    spec = importlib.util.spec_from_file_location("word_count_env_scaffolded", root / "word_count_env" / "env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    made = module.WordCountEnv()
    train, test = ({t.id for t in made.task_set.split(side)} for side in ("train", "test"))
    assert made.cfg.split == "train" and test and not train & test
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


RUN_V0 = Path(__file__).parent / "data" / "run_v0" / "run"


def test_view_on_a_taken_port_says_so_in_one_line_and_prints_no_url():
    """It printed its URL as if serving, then uvicorn's error, exit 3; --port 99999 was a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(app, ["view", str(RUN_V0), "--port", str(port)])
    assert r.exit_code == 1 and r.output.startswith(f"cannot listen on 127.0.0.1:{port}: "), r.output
    assert "http://" not in r.output and len(r.output.strip().splitlines()) == 1
    assert CliRunner().invoke(app, ["view", str(RUN_V0), "--port", "99999"]).exit_code == 2


def test_view_on_port_0_prints_the_url_it_serves():
    """--port 0 printed http://127.0.0.1:0/, an address nothing answers on."""
    proc = start_agentrl("view", RUN_V0, "--port", 0, stderr=subprocess.DEVNULL)
    try:
        url = proc.stdout.readline().split()[2]
        assert not url.endswith(":0/"), url
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(f"{url}api/overview", timeout=2).json()["kind"] == "run"
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


@pytest.mark.parametrize(
    ("args", "said"),
    [
        # off loopback without a key: a serve that took the option would still stop before loading a model
        (["serve", "--model", "default", "--seed", "3", "--host", "0.0.0.0"], "--seed is the weight seed of a --tiny"),
        (["serve", "--tiny", "qwen3", "--lora-alpha", "64", "--host", "0.0.0.0"], "--lora-alpha shape the LoRA"),
        (["sandbox", "exec", "PROG", "--backend", "local", "--timeout", "0"], "--timeout takes seconds > 0, got 0.0"),
        (["sandbox", "exec", "PROG", "--backend", "local", "--timeout", "nan"], "--timeout takes seconds > 0"),
    ],
)
def test_options_that_would_do_nothing_or_fail_late_are_refused_first(tmp_path, args, said):
    """Accepted and ignored (serve's --seed with --model, LoRA shape without --lora-rank), or taken for a time out
    (--timeout 0) or a sandbox failure (--timeout nan, exit 3): refused in one line, exit 2, nothing started."""
    prog = tmp_path / "p.py"
    prog.write_text("print(1)")
    r = CliRunner().invoke(app, [str(prog) if a == "PROG" else a for a in args])
    assert r.exit_code == 2 and r.output.startswith(said) and len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize(
    "args", [["serve", "--tiny", "qwen3", "--port", "70000"], ["envs", "validate-repos", "repos", "--limit", "-1"]]
)
def test_out_of_range_numbers_are_usage_errors_not_tracebacks(args):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "Invalid value" in r.output, r.output
