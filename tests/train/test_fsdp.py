"""FSDP2 on two gloo ranks against one plain process, same batch, same update (real torch.distributed)."""

import os
import subprocess
import sys
from pathlib import Path

import fsdp_worker  # this directory is on sys.path
import pytest
import torch

from agentrl.models.tiny import tiny_model

WORKER = Path(__file__).with_name("fsdp_worker.py")
# fp32 on CPU; the ranks reduce in another order than one process sums. Measured ~5e-7.
ATOL = 1e-5


def run(out: Path, kind: str, ranks: int, *phase: str) -> dict:
    cmd = [sys.executable, str(WORKER), str(out), kind, *phase]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone", *cmd[1:]]
    # inductor compiles in this process: its pool of compile workers only cost start-up on 2 cores (32 s -> 15 s)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=600)
    return torch.load(out)


@pytest.fixture(scope="module")
def plain_moe(tmp_path_factory) -> dict:
    """The MoE update in one plain process, fp32 (this one: it joins no process group): the reference of more
    than one test."""
    out = tmp_path_factory.mktemp("plain") / "one.pt"
    fsdp_worker.main(str(out), "moe")
    return torch.load(out)


@pytest.mark.parametrize("kind", ["moe", pytest.param("lora", marks=pytest.mark.slow)])
def test_two_ranks_match_one_process(tmp_path, kind, plain_moe):
    one = plain_moe if kind == "moe" else run(tmp_path / "one.pt", kind, 1)
    two = run(tmp_path / "two.pt", kind, 2)
    assert one["state"].keys() == two["state"].keys()
    for name, value in one["state"].items():
        torch.testing.assert_close(two["state"][name], value, atol=ATOL, rtol=0, msg=name)
    # the metrics are of the whole minibatch, whichever rank scored which sequence (quantiles over both ranks' values)
    keys = ("loss", "clip_fraction", "entropy", "grad_norm", "router_aux_loss", "mismatch_seq_kl", "abs_logprob_diff")
    for key in (*keys, "mismatch_abs_logprob_diff", "ratio_p05", "ratio_p50", "ratio_p95"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7), key
    initial = {k: v for k, v in tiny_model("qwen3_moe", seed=0).state_dict().items()}
    changed = [n for n, v in one["state"].items() if n in initial and not torch.equal(v, initial[n])]
    if kind == "lora":  # only the adapters learn; lora_B starts at zero, so it must have moved
        base = {
            n.replace("base_model.model.", "", 1).replace(".base_layer", ""): v
            for n, v in one["state"].items()
            if "lora_" not in n
        }
        assert all(torch.equal(base[n], initial[n]) for n in initial if n in base)
        assert any("lora_B" in n and v.abs().sum() > 0 for n, v in one["state"].items())
    else:
        assert changed


@pytest.mark.slow  # a launch of 2 ranks; the fast tier replays in one process (tests/train/test_routing_replay.py)
def test_routing_replay_on_two_ranks_matches_one_process(tmp_path):
    """R3 (decoupled: the proximal pass replays too) on an engine record that every row shares over the prompt, so
    each rank's shared-prefix scorer replays: two ranks give one process's update, and replay the same."""
    one, two = run(tmp_path / "one.pt", "replay", 1), run(tmp_path / "two.pt", "replay", 2)
    for name, value in one["state"].items():
        torch.testing.assert_close(two["state"][name], value, atol=ATOL, rtol=0, msg=name)
    for key in ("loss", "grad_norm", "routing_replayed"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7), key
    assert 0.9 < one["metrics"]["routing_replayed"] < 1  # every real position but each row's last
    (replayed, own), (replayed2, own2) = one["replayed"], two["replayed"]
    torch.testing.assert_close(replayed2, replayed, atol=ATOL, rtol=0)
    torch.testing.assert_close(own2, own, atol=ATOL, rtol=0)
    assert (replayed - own).abs().max() > 1e-2  # the record is not the learner's routing: replay changes lp


@pytest.mark.slow  # a launch of 3 ranks; the fast tier runs FSDP2 over two (above)
def test_a_rank_that_holds_no_row_of_a_minibatch_changes_nothing(tmp_path):
    """Minibatches of 2 rows over 3 ranks: the third scores a stand-in row, which must count nowhere, the router's
    load-balancing loss included (its token counts are summed over ranks)."""
    one, three = run(tmp_path / "one.pt", "pairs", 1), run(tmp_path / "three.pt", "pairs", 3)
    for name, value in one["state"].items():
        torch.testing.assert_close(three["state"][name], value, atol=ATOL, rtol=0, msg=name)
    for key in ("loss", "grad_norm", "router_aux_loss"):
        assert three["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7), key


@pytest.mark.slow  # the fast tier runs FSDP2 over two ranks (above)
def test_bf16_mixed_precision_on_a_group_of_one(tmp_path, plain_moe):
    """model.dtype bfloat16 in a plain process: a process group of one, FSDP2 computing in bf16 with
    float32 master weights, activation checkpointing and CPU offload on; the update agrees with fp32
    to bf16 precision, and the engine's copy takes the new weights."""
    fp32, bf16 = plain_moe, run(tmp_path / "bf16.pt", "bf16", 1)
    assert (fp32["world"], fp32["compute"], any(fp32["checkpointing"])) == (0, {torch.float32}, False)
    assert (bf16["world"], bf16["compute"], all(bf16["checkpointing"])) == (1, {torch.bfloat16}, True)
    assert all(v.dtype == torch.float32 for v in bf16["state"].values())
    for key in ("loss", "grad_norm", "router_aux_loss"):
        assert bf16["metrics"][key] == pytest.approx(fp32["metrics"][key], rel=2e-2), key
    initial = tiny_model("qwen3_moe", seed=0).state_dict()
    step = {
        k: torch.cat([(r["state"][n] - initial[n]).flatten() for n in initial])
        for k, r in (("fp32", fp32), ("bf16", bf16))
    }
    assert torch.cosine_similarity(step["fp32"], step["bf16"], dim=0) > 0.9  # the same update, in direction
    version, engine = bf16["engine"]
    assert version == 1 and engine.keys() == bf16["state"].keys()
    for name, value in bf16["state"].items():
        assert torch.equal(engine[name], value), name


@pytest.mark.slow  # the fast tier runs FSDP2 over two ranks (above)
def test_one_rank_gathers_its_weights_once_an_optimizer_step(tmp_path):
    """bf16 over a group of one: nothing is sharded, so the weights' gathered bf16 copy serves every forward and
    backward of an optimizer step (a shared prompt scored apart from its suffixes, micro-batches) and is dropped
    before the step. An update of 2 steps (and the expert flip rate's forward after them) casts each weight 3
    times, in whole minibatches and in micro-batches of one row alike; resharding after each forward and backward
    cast the layers' 10 and 17 times (229 and 401 casts in all, at b5c53ee). A LoRA adapter synced after an
    update, when the layers hold their bf16 copies, is still the float32 master weights. The KL reference, which
    has no backward, holds no gathered copy after an update."""
    result = run(tmp_path / "gathers.pt", "gathers", 1)
    n = result["parameters"]
    assert result["casts"] == {"minibatches": 3 * n, "micro_batches": 3 * n}
    assert result["lora_sync"] == {"float32": True, "bf16_values_only": False, "trained": True}
    assert result["reference_sharded"]


@pytest.mark.slow  # inductor compiles for 10-40 s on 2 cores; the fast tier runs every update eagerly
def test_compiled_mlps_update_as_eager(tmp_path):
    """model.compile, each decoder layer's MoE block compiled, gives the eager update (fp32, a plain process, to
    1e-5): under R3 routing replay, whose hooks on the router run inside the compiled block, over a shared prompt
    (the scorer's KV cache), with the proximal pass and the expert flip rate's forwards (no grad). The module is
    no longer shared with an engine. (scripts/gpu_check.sh's dry run compiles under FSDP2 in bf16.)"""
    eager, compiled = (run(tmp_path / f"{kind}.pt", kind, 1) for kind in ("replay", "replay+compile"))
    assert (all(compiled["compiled"]), any(eager["compiled"])) == (True, False)
    assert (eager["shares_module"], compiled["shares_module"]) == (True, False)
    assert compiled["state"].keys() == eager["state"].keys()  # compiled in place: the names stay
    for name, value in eager["state"].items():
        torch.testing.assert_close(compiled["state"][name], value, atol=ATOL, rtol=0, msg=name)
    for key in ("loss", "grad_norm", "router_aux_loss", "routing_replayed", "expert_flip_rate"):
        assert compiled["metrics"][key] == pytest.approx(eager["metrics"][key], rel=1e-4, abs=1e-7), key


@pytest.mark.slow  # three launches; the fast tier resumes a checkpoint in tests/train/test_checkpoint.py
def test_a_sharded_checkpoint_resumes_on_two_ranks_and_on_one(tmp_path):
    """Saved by two FSDP2 ranks; resumed by two ranks and by a plain process (DCP reshards)."""
    ckpt = str(tmp_path / "ckpt")
    saved = run(tmp_path / "saved.pt", "moe", 2, "save", ckpt)
    for ranks in (2, 1):
        resumed = run(tmp_path / f"resumed{ranks}.pt", "moe", ranks, "resume", ckpt)
        assert resumed["metrics"]["loss"] == pytest.approx(saved["metrics"]["loss"], abs=1e-5)
        for name, value in saved["state"].items():
            torch.testing.assert_close(resumed["state"][name], value, atol=ATOL, rtol=0, msg=name)
