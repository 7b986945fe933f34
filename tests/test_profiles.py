"""The profiling benchmarks on the CPU: train_step_bench.py --profile summarises each path's ops with
benchmarks/profiling.py (the GPU's kernel summary is the same code, run on the device machine), and
decode_profile.py reports tokens/s alone (the engine's thread is outside the profiler's reach on the CPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli import env

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def run(script: str, *args: object) -> dict:
    r = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


@pytest.mark.slow  # the fast tier is at its budget
def test_train_step_bench_profiles_each_path_and_decode_profile_times_each_dtype():
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

    decode = run("decode_profile.py")
    assert set(decode["engines"]) == {"auto", "bfloat16"}
    for dtype, e in decode["engines"].items():
        assert e["tokens_per_s"] > 0 and "profile" not in e, (dtype, e)
