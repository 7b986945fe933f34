"""scripts/gpu_check.sh, the one command for every CUDA path: CI runs its CPU dry run, which must pass every check;
without a GPU its GPU run fails each check with the reason, skips what cannot run here, and goes on."""

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cli import env

SCRIPT = Path(__file__).parents[1] / "scripts" / "gpu_check.sh"
CHECKS = [
    "fsdp_bf16",
    "hf_engine",
    "logprob_parity",
    "agentrl_train",
    "default_recipe",
    "train_step_bench",
    "decode_bench",
]


def gpu_check(*args: object, timeout: float, **extra_env: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = Path(args[args.index("--out") + 1])
    r = subprocess.run(
        ["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env(**extra_env)
    )
    report = json.loads(out.read_text())
    assert json.loads(r.stdout) == report  # printed as written
    return r, report


@pytest.mark.slow  # ~1 min on 2 cores; the GPU run's failures below take seconds
def test_the_cpu_dry_run_passes_every_check(tmp_path, bwrap_site):
    """agentrl_train runs as on a GPU host: bubblewrap sandboxes and env workers of the run, Docker out of reach."""
    r, report = gpu_check("--cpu-dry-run", "--out", tmp_path / "report.json", timeout=600)
    summary = [(c["name"], c["status"], c["error"] or c["reason"]) for c in report["checks"]]
    assert r.returncode == 0 and report["ok"], (summary, r.stderr[-4000:])
    assert [(name, status) for name, status, _ in summary] == [(name, "ok") for name in CHECKS], summary
    assert report["mode"] == "cpu-dry-run" and report["counts"] == {"ok": 7, "failed": 0, "skipped": 0}
    figures = {c["name"]: c["figures"] for c in report["checks"]}
    fsdp = figures["fsdp_bf16"]
    assert fsdp["process_group"] == "gloo, world size 1" and fsdp["compute_dtypes"] == ["bfloat16"]
    assert fsdp["max_abs_weight_change"] > 0
    engines = figures["hf_engine"]["engines"]
    assert {k: f["weights"] for k, f in engines.items()} == {"auto": "float32 on cpu", "bfloat16": "bfloat16 on cpu"}
    pairs = figures["logprob_parity"]["pairs"]
    assert pairs["fp32"]["max_abs_diff"] < 1e-4  # the same math (tests/engine/test_hf.py's bound)
    assert all(0 < p["mean_abs_diff"] < 0.1 for name, p in pairs.items() if name != "fp32")  # bf16 rounding shows
    assert [i["policy_version"] for i in figures["agentrl_train"]["iterations"]] == [1, 2]
    assert figures["agentrl_train"]["bwrap"]["unavailable"] is None
    assert figures["agentrl_train"]["bwrap"]["host"].startswith("bwrap sandboxes as root")
    recipe = figures["default_recipe"]
    assert "--env code_sandbox" in recipe["command"] and "rollout.env_workers=local" in recipe["command"]
    assert recipe["summary"]["iterations"] == 1 and recipe["summary"]["tasks"] == 2
    assert sorted(recipe["summary"]["curve"]) == ["0", "1"]  # held out before the iteration and after it
    assert figures["train_step_bench"]["result"]["setup"] == "bfloat16, FSDP2 over 1 rank(s)"
    assert figures["train_step_bench"]["big_step"]["tokens_per_step"] == 256
    assert [figures["train_step_bench"][k]["compile"] for k in ("big_step", "compiled")] == [False, True]
    assert [r["requests"] for r in figures["decode_bench"]["result"]["runs"]] == [4]


@pytest.mark.slow  # the fast tier is at its budget; the dry run above covers the same code
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the GPU run would run")
def test_without_a_gpu_the_gpu_run_fails_each_check_and_goes_on(tmp_path):
    """No GPU: each check that needs one fails with the reason, agentrl_train after its bubblewrap probe; the exit
    status is 1."""
    only = ["fsdp_bf16", "agentrl_train", "train_step_bench"]
    r, report = gpu_check("--only", *only, "--out", tmp_path / "report.json", timeout=300)
    assert r.returncode == 1 and report["mode"] == "gpu" and not report["ok"]
    said = [(c["name"], c["status"], c["error"] or c["reason"]) for c in report["checks"]]
    assert [(name, status) for name, status, _ in said] == [
        ("fsdp_bf16", "failed"),
        ("agentrl_train", "failed"),
        ("train_step_bench", "failed"),
    ], said
    assert report["counts"] == {"ok": 0, "failed": 3, "skipped": 0}
    fsdp, train, bench = report["checks"]
    assert all("torch.cuda.is_available() is False" in c["error"] for c in (fsdp, train, bench))
    assert train["figures"]["bwrap"]["unavailable"] is None
    assert all(c["seconds"] > 0 for c in report["checks"])


# Put first on PYTHONPATH, it makes the packages BLOCKED names impossible to import, as on a machine without them.
BLOCKER = """
import os, sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in os.environ["BLOCKED"].split(","):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Blocker())
"""


@pytest.mark.slow  # the fast tier is at its budget
def test_a_check_whose_optional_package_is_missing_is_skipped_with_the_reason(tmp_path):
    """A GPU machine may lack Ray (no internet to install it): a check that imports it is skipped, naming the
    package (and where agentrl imports it); the exit status stays 0."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    r, report = gpu_check(
        "--cpu-dry-run",
        "--only",
        "fsdp_bf16",
        "agentrl_train",
        "--out",
        tmp_path / "report.json",
        timeout=300,
        PYTHONPATH=str(tmp_path),
        BLOCKED="ray",
    )
    assert r.returncode == 0 and report["ok"] and report["counts"]["failed"] == 0, report
    fsdp, train = report["checks"]
    assert train["status"] == "skipped"
    assert train["reason"] == "`agentrl train` needs the package ray, not installed here"
    # the Trainer imports Ray today (agentrl.train.batch imports agentrl.rollout): skipped, saying where
    assert fsdp["status"] == "skipped" and fsdp["error"] is None
    assert re.fullmatch(
        r"needs the package ray, not installed here \(imported at agentrl/\S+\.py:\d+\)", fsdp["reason"]
    ), fsdp["reason"]


@pytest.mark.slow  # the fast tier is at its budget
def test_a_check_past_the_time_limit_asked_is_killed_and_fails_saying_so(tmp_path):
    """--time-limit (a machine lent for minutes): a check still running at the limit is killed, with whatever it
    started, and fails with its output's tail; the report is written after each check, so a command killed in turn
    (a lent machine's call past its limit) keeps the checks that ran."""
    out = tmp_path / "report.json"
    cmd = ["bash", str(SCRIPT), "--cpu-dry-run", "--only", "fsdp_bf16", "hf_engine", "--time-limit", "2", "--out", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    partial = None
    while proc.poll() is None and partial is None:
        if out.exists() and not (report := json.loads(out.read_text()))["complete"]:
            partial = report
        time.sleep(0.05)
    stdout, _ = proc.communicate(timeout=120)
    report = json.loads(out.read_text())
    assert json.loads(stdout) == report and proc.returncode == 1 and not report["ok"], report
    assert partial is not None and [c["name"] for c in partial["checks"]] == ["fsdp_bf16"]
    assert report["complete"] and [c["name"] for c in report["checks"]] == ["fsdp_bf16", "hf_engine"]
    for check in report["checks"]:
        assert check["status"] == "failed" and check["error"].startswith("ran past its time limit of 2.0 s (killed)")
        assert 2 <= check["seconds"] < 20


def test_a_check_the_budget_leaves_no_time_for_is_not_started(tmp_path):
    """--budget (the whole command's seconds): a check is not started with under 30 s of it left."""
    r, report = gpu_check(
        "--cpu-dry-run",
        "--only",
        "fsdp_bf16",
        "decode_bench",
        "--budget",
        "20",
        "--out",
        tmp_path / "r.json",
        timeout=60,
    )
    assert r.returncode == 0 and report["ok"] and report["complete"], report
    assert report["counts"] == {"ok": 0, "failed": 0, "skipped": 2}
    for check in report["checks"]:
        assert re.fullmatch(r"\d+ s left of --budget 20: not started", check["reason"]), check
