"""An engine from another installed package (entry-point group `agentrl.engines`) is built by `agentrl eval`
and `agentrl train` like a built-in one. Both commands run here as a machine without Docker or Ray runs them:
bwrap sandboxes, env workers that are processes of the command (`rollout.env_workers: local`)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from cli import agentrl, serving, sets, start_agentrl
from ownership import RAY_PROCESSES, bwrap_trees, seen_while_running

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


pytestmark = pytest.mark.slow

NO_DAEMON = ["sandbox.backend=bwrap"]  # and env workers in processes of the command: no Docker engine, no Ray


def run_without_ray(*args: object, cwd: Path, extra_env: dict[str, str]) -> str:
    """`agentrl ARGS` to its end (exit 0) with no Ray process among its own; its stdout."""
    with (cwd / "stdout").open("w+") as out, (cwd / "stderr").open("w+") as err:  # files: polled, never read full
        proc = start_agentrl(*args, cwd=cwd, stdout=out, stderr=err, extra_env=extra_env)
        ray = seen_while_running(proc, RAY_PROCESSES)
        out.seek(0), err.seek(0)
        text, errors = out.read(), err.read()
    assert proc.returncode == 0, text[-2000:] + errors[-4000:]
    assert not ray, f"Ray processes under agentrl {args[0]}: {ray}"
    return text


def test_agentrl_eval_and_train_use_an_engine_from_another_package(site, tmp_path, bwrap_runtime):
    """Without the docker marker: Docker is out of reach, and neither command needs it."""
    mark = tmp_path / "mark"
    env = {"PYTHONPATH": str(site), "LOGGED_ENGINE_MARK": str(mark)}
    out = run_without_ray(
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
        *sets(*NO_DAEMON, "env_workers=local"),
        "--out",
        tmp_path / "eval",
        cwd=tmp_path,
        extra_env=env,
    )
    assert mark.read_text() == "logged shared=False note=None\n"
    assert len(read_jsonl(tmp_path / "eval" / "results.jsonl")) == 2 and "pass@1" in out
    out = run_without_ray(
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
        "eval.tasks=1",
        "--set",
        "checkpoint.export_final=false",
        *sets(*NO_DAEMON, "rollout.env_workers=local"),
        cwd=tmp_path,
        extra_env=env,
    )
    # one process: the plugin engine was offered the trainer's module to share (it is an hf engine, so it did)
    assert mark.read_text().splitlines()[1] == "logged shared=True note=hi"
    assert [m["policy_version"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]
    assert [e["iteration"] for e in read_jsonl(tmp_path / "run" / "eval.jsonl")] == [0, 1]  # held out, on them too
    assert out.count("bwrap sandboxes") == 1, out  # the backend's line, once
    assert not bwrap_trees(bwrap_runtime), "no sandbox is left"


@pytest.mark.docker
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
