"""The profiling benchmarks on the CPU: train_step_bench.py --profile summarises each path's ops with
benchmarks/profiling.py (the GPU's kernel summary is the same code, run on the device machine), and
decode_bench.py sets tokens/s against the memory-bandwidth roofline of the same requests (it profiles on a GPU
only: the engine's thread is outside the profiler's reach on the CPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli import env

from agentrl.models.tokenizer import load_tokenizer

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def run(script: str, *args: object, **extra_env: str) -> dict:
    r = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(**extra_env),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


@pytest.mark.slow  # the fast tier is at its budget
def test_train_step_bench_profiles_each_path():
    top = 4
    result = run(
        "train_step_bench.py",
        "--profile",
        top,
        "--rounds",
        1,
        "--repeats",
        1,
        "--batch",
        2,
        "--length",
        64,
        "--minibatches",
        1,
    )
    assert set(result["profile"]) == {"update", "plain"}
    for path in result["profile"].values():
        assert set(path) == {"wall_s", "top"} and path["wall_s"] > 0  # no GPU figures on the CPU
        shares = [row["share"] for row in path["top"]]
        assert len(shares) == top and shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1
        # Mostly aten ops, but on a busy CPU time preempted inside the autograd engine counts as its own entries'
        # self time ("autograd::engine::evaluate_function: AddBackward0"), which can reach the top few.
        assert all(row["name"] and row["calls"] > 0 for row in path["top"]), path["top"]
    names = {p: {row["name"] for row in result["profile"][p]["top"]} for p in ("update", "plain")}
    assert "aten::mm" in names["update"] & names["plain"]


def test_decode_bench_sets_tokens_per_s_against_the_bandwidth_roofline():
    """The CPU run of decode_bench.py (tiny model, 4 requests x 16 tokens after 32-token prompts): its roofline
    counts the tiny Qwen3-MoE's weights and KV as the docstring says, and tokens/s is a share of that bound."""
    # one thread: two threads spinning on two cores that other tests share can take 20x as long
    result = run("decode_bench.py", "--bandwidth-gbs", 20, OMP_NUM_THREADS="1")
    (r,) = result["runs"]
    assert (r["dtype"], r["requests"], result["prompt_tokens"], result["new_tokens"]) == ("float32", 4, 32, 16)
    assert r["tokens_per_s"] > 0 and "gpu_busy_share" not in r  # no GPU figures on the CPU
    roof = r["roofline"]
    assert roof["experts_read_share"] == 1 - (1 - 2 / 4) ** 4  # 4 rows choosing 2 of 4 experts
    # per token of context: 2 layers x (K and V) x 2 KV heads x 16 dims x 4 bytes; mean context 32 + 16 / 2
    assert roof["kv_bytes"] == 4 * (32 + 8) * 2 * 2 * 2 * 16 * 4
    # the output head (vocabulary x 64, fp32) is read whole, the input embedding, as large, only in 4 rows
    head = len(load_tokenizer()) * 64 * 4
    assert head < roof["weight_bytes"] < 2 * head
    assert roof["tokens_per_s_bound"] == pytest.approx(4 * 20e9 / (roof["weight_bytes"] + roof["kv_bytes"]))
    assert r["share_of_bound"] == pytest.approx(r["tokens_per_s"] / roof["tokens_per_s_bound"])
