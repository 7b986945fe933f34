"""A resumed run whose engine holds its own copy of the weights (FSDP2, here a process group of one) samples
with the checkpoint's weights, not the starting ones its copy was loaded with."""

import shutil
from pathlib import Path

import pytest
from cli import agentrl, sets

from agentrl.runs import read_jsonl

MODEL = Path(__file__).parents[1] / "data" / "run_v0" / "model"  # a tiny Qwen3-MoE with the project tokenizer
RUN = [
    "model.cpu_offload=true",
    "optim.lr=0.05",
    "rollout.group_size=2",
    "rollout.groups_per_iteration=2",
    "rollout.num_workers=1",
    "rollout.sandboxes_per_worker=2",
    "rollout.partial=false",
    "rollout.sampling.max_tokens=24",
    "eval.tasks=0",
    "checkpoint.export_final=false",
]

pytestmark = [pytest.mark.docker, pytest.mark.slow]  # the fast tier resumes a run too: tests/runs/test_compat.py


def test_a_resumed_engine_copy_gets_the_checkpoints_weights(tmp_path):
    shutil.copytree(MODEL, tmp_path / "model")
    agentrl("train", "--env", "code_sandbox", *sets("model.path=model", "out=run", "iterations=1", *RUN), cwd=tmp_path)
    agentrl("train", "--resume", "run", *sets("iterations=2"), cwd=tmp_path)
    first, resumed = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    # no partial rollouts: a parked episode's tokens would come back stale, and their mismatch is real
    # lr 0.05 moved the weights far from the start: an engine still on them would disagree with the learner
    assert first["train/mismatch_abs_logprob_diff"] < 1e-3, first
    assert resumed["train/mismatch_abs_logprob_diff"] < 1e-3, resumed
    assert resumed["policy_version"] == 2  # the checkpoint's 1 (its weights, synced to the engine copy), then 2
    assert not (tmp_path / "run" / "eval.jsonl").exists()  # eval.tasks=0: no held-out evaluation
