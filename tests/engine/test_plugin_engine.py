"""An engine from another installed package (entry-point group `agentrl.engines`) is built by `agentrl eval`
and `agentrl train` like a built-in one."""

import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from cli import agentrl, serving

from agentrl.runs import read_jsonl

MODEL = Path(__file__).parents[1] / "data" / "run_v0" / "model"  # a tiny Qwen3-MoE with the project tokenizer

# The hf engine under another name, which leaves a mark where it was built (and how), so the test sees it used.
ENGINE = """
import os
from agentrl.engine.hf import HFEngine


class LoggedEngine(HFEngine):
    name = "logged"

    @classmethod
    def from_config(cls, cfg, model, *, version=0, seed=0):
        with open(os.environ["LOGGED_ENGINE_MARK"], "a") as f:
            f.write(f"{cfg.kind} shared={model.module is not None} note={cfg.options.get('note')}\\n")
        return super().from_config(cfg, model, version=version, seed=seed)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The package, installed into a folder of its own (PYTHONPATH), not into the test's environment."""
    pkg = tmp_path_factory.mktemp("pkg")
    (pkg / "logged_engine").mkdir()
    (pkg / "logged_engine" / "__init__.py").write_text(ENGINE)
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent("""
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"
        [project]
        name = "agentrl-logged-engine"
        version = "0.0.1"
        [project.entry-points."agentrl.engines"]
        logged = "logged_engine:LoggedEngine"
        [tool.hatch.build.targets.wheel]
        packages = ["logged_engine"]
    """)
    )
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(pkg),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return site


pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_agentrl_eval_and_train_use_an_engine_from_another_package(site, tmp_path):
    mark = tmp_path / "mark"
    env = {"PYTHONPATH": str(site), "LOGGED_ENGINE_MARK": str(mark)}
    r = agentrl(
        "eval",
        "--env",
        "humaneval",
        "--model",
        MODEL,
        "--engine",
        "logged",
        "--tasks",
        "2",
        "--set",
        "max_tokens=16",
        "--out",
        tmp_path / "eval",
        cwd=tmp_path,
        extra_env=env,
    )
    assert mark.read_text() == "logged shared=False note=None\n"
    assert len(read_jsonl(tmp_path / "eval" / "results.jsonl")) == 2 and "pass@1" in r.stdout
    agentrl(
        "train",
        "--env",
        "code_sandbox",
        "--set",
        f"model.path={MODEL}",
        "--set",
        "engine.kind=logged",
        "--set",
        "engine.options.note=hi",
        "--set",
        f"out={tmp_path / 'run'}",
        "--set",
        "iterations=1",
        "--set",
        "rollout.group_size=2",
        "--set",
        "rollout.groups_per_iteration=2",
        "--set",
        "rollout.num_workers=1",
        "--set",
        "rollout.sandboxes_per_worker=2",
        "--set",
        "rollout.sampling.max_tokens=24",
        "--set",
        "eval.tasks=0",
        "--set",
        "checkpoint.export_final=false",
        cwd=tmp_path,
        extra_env=env,
    )
    # one process: the plugin engine was offered the trainer's module to share (it is an hf engine, so it did)
    assert mark.read_text().splitlines()[1] == "logged shared=True note=hi"
    assert [m["policy_version"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_agentrl_serve_serves_an_engine_from_another_package(site, tmp_path):
    mark = tmp_path / "mark"
    env = {"PYTHONPATH": str(site), "LOGGED_ENGINE_MARK": str(mark)}
    with serving("--model", MODEL, "--engine", "logged", extra_env=env) as url:
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "return_token_ids": True},
            timeout=60,
        )
        assert len(reply.json()["choices"][0]["token_ids"]) == 4
        assert mark.read_text() == "logged shared=False note=None\n"


def test_an_unknown_engine_is_refused_with_the_known_ones(tmp_path):
    r = agentrl("eval", "--env", "humaneval", "--model", MODEL, "--engine", "loged", cwd=tmp_path, check=False)
    assert r.returncode == 2 and "no engine named 'loged'" in r.stderr and "Known engines: hf, openai" in r.stderr
