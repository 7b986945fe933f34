"""Every engine that runs here works from every command, as the README documents it: `agentrl eval` and
`agentrl train` with the `hf` engine and with `openai` against a running `agentrl serve` (the engine from
another package: tests/engine/test_plugin_engine.py)."""

from pathlib import Path

import httpx
import pytest
from cli import agentrl, serving

from agentrl.runs import read_jsonl

MODEL = Path(__file__).parents[1] / "data" / "run_v0" / "model"  # a tiny Qwen3-MoE with the project tokenizer

pytestmark = pytest.mark.docker

TRAIN = [
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
    "eval.tasks=2",
    "--set",
    "eval.every=0",
    "--set",
    "eval.sandboxes_per_worker=2",
    "--set",
    "checkpoint.export_final=false",
]


@pytest.fixture(scope="module")
def served():
    """`agentrl serve --model MODEL` on a free port: its URL."""
    with serving("--model", MODEL) as url:
        yield url


# slow tier: `agentrl serve` and `agentrl eval` processes; the fast tier's `agentrl eval` runs the hf engine (below)
@pytest.mark.slow
@pytest.mark.parametrize("env", ["humaneval", "code_sandbox"])
def test_agentrl_eval_with_the_openai_engine_against_agentrl_serve(served, env, tmp_path):
    r = agentrl(
        "eval",
        "--env",
        env,
        "--engine",
        "openai",
        "--base-url",
        served,
        "--model",
        MODEL,
        "--tasks",
        2,
        "--set",
        "max_tokens=16",
        "--out",
        tmp_path,
        cwd=tmp_path,
    )
    assert "pass@1" in r.stdout and len(read_jsonl(tmp_path / "results.jsonl")) == 2
    assert all(t["versions"] == [0] for t in read_jsonl(tmp_path / "trajectories" / "index.jsonl"))


@pytest.mark.slow  # 46 s: the fast tier runs `agentrl eval` on its other engines and benchmarks (tests/eval)
def test_agentrl_eval_with_the_hf_engine(tmp_path):
    r = agentrl("eval", "--env", "humaneval", "--model", MODEL, "--tasks", 2, "--set", "max_tokens=16", cwd=tmp_path)
    assert "pass@1" in r.stdout


@pytest.mark.slow
def test_agentrl_train_with_the_openai_engine_syncs_weights_over_http(served, tmp_path):
    agentrl(
        "train",
        "--env",
        "code_sandbox",
        "--set",
        f"model.path={MODEL}",
        "--set",
        "engine.kind=openai",
        "--set",
        f"engine.base_url={served}",
        "--set",
        f"out={tmp_path / 'run'}",
        *TRAIN,
        cwd=tmp_path,
    )
    assert [m["policy_version"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]
    assert httpx.get(f"{served}/agentrl/version").json()["version"] == 1  # the server took the update


@pytest.mark.slow  # the fast tier refuses a GPU recipe at start-up (below)
def test_a_command_whose_engine_cannot_run_here_says_why_before_starting(tmp_path):
    r = agentrl(
        "train",
        "--env",
        "code_sandbox",
        "--set",
        f"model.path={MODEL}",
        "--set",
        "engine.kind=openai",
        "--set",
        "engine.base_url=http://127.0.0.1:9",
        cwd=tmp_path,
        check=False,
    )
    assert r.returncode == 2 and "engine.kind=openai: http://127.0.0.1:9/v1/models does not answer" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "runs").exists()


def test_a_gpu_recipe_fails_at_start_up_in_a_few_lines(tmp_path):
    """configs/qwen3_0.6b_dense.yaml wants vLLM on a GPU and a hub model: refused before any process group or
    Ray actor starts, each problem on one line with what to change."""
    recipe = Path(__file__).parents[2] / "configs" / "qwen3_0.6b_dense.yaml"
    r = agentrl("train", "--config", recipe, cwd=tmp_path, check=False, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) <= 3, r.stderr
    assert any(
        line.startswith("✗ engine.kind=vllm: the vllm engine needs vLLM: pip install 'agentrl[vllm]'") for line in lines
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # the fast tier refuses a GPU recipe at start-up (above)
def test_sft_of_a_hub_model_with_no_hub_fails_at_start_up_in_a_few_lines(tmp_path):
    """`agentrl sft` checks its model as `agentrl train` does (and takes "default", the embedded policy)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}\n')
    r = agentrl(
        "sft",
        "--data",
        data,
        "--model",
        "nosuch/model-id",
        "--out",
        tmp_path / "out",
        check=False,
        extra_env={"HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3, r.stderr
    assert "model: nosuch/model-id is a hub id, not a folder here" in r.stderr and not (tmp_path / "out").exists()
