"""Memory-honest loading (agentrl.models.loading): a model built on the meta device and filled from its
safetensors, in one process and sharded over two FSDP2 ranks (real torch.distributed, gloo), against
`from_pretrained` of the same folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_fsdp import WORKER
from transformers import AutoConfig, AutoModelForCausalLM

from agentrl.models.loading import checkpoint_files, fill_from_checkpoint, materialize, meta_model, stored_dtype
from agentrl.models.lora import LoraSettings
from agentrl.models.tiny import save_tiny, tiny_model
from agentrl.train.scoring import Scorer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def save_bf16(path: Path, arch: str, **overrides) -> Path:
    tiny_model(arch, seed=1, **overrides).to(torch.bfloat16).save_pretrained(path)
    return path


def save_fused(path: Path) -> Path:
    """A Qwen3-MoE checkpoint that keeps transformers' in-memory layout (one 3D tensor per layer's experts)."""
    model = tiny_model("qwen3_moe", seed=2)
    model.config.save_pretrained(path)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "moe_fp32": save_tiny(root / "moe_fp32", "qwen3_moe"),  # per-expert keys, as save_pretrained writes them
        "moe_bf16": save_bf16(root / "moe_bf16", "qwen3_moe"),
        "tied_bf16": save_bf16(root / "tied_bf16", "qwen3", tie_word_embeddings=True),
        "moe_fused": save_fused(root / "moe_fused"),
    }


def pretrained(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def logprobs(model: torch.nn.Module) -> torch.Tensor:
    from fsdp_worker import fixed_batch

    b = fixed_batch()
    with torch.no_grad():
        return Scorer(model)(b.input_ids, b.attention_mask, b.sampling)[0]


def base_name(name: str) -> str:
    """A peft parameter's name in the plain model."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


@pytest.mark.parametrize("kind", ["moe_fp32", "moe_bf16", "tied_bf16", "moe_fused"])
def test_one_process_loads_what_from_pretrained_loads(folders, kind):
    """Built on the meta device, materialised, filled from the files: the same tensors as from_pretrained
    (per-expert checkpoint keys fused into 3D experts, or already fused), the rotary buffers rebuilt, tied
    embeddings one tensor."""
    path = folders[kind]
    model = meta_model(AutoConfig.from_pretrained(path), torch.float32)
    materialize(model, "cpu")
    fill_from_checkpoint(model, checkpoint_files(path))
    expected = pretrained(path)
    assert model.state_dict().keys() == expected.state_dict().keys()
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    for name, buffer in expected.named_buffers():  # inv_freq and original_inv_freq: not in the checkpoint
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
    tied = model.config.tie_word_embeddings
    assert (
        (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied == (kind == "tied_bf16")
    )
    assert stored_dtype(checkpoint_files(path)) == (torch.bfloat16 if "bf16" in kind else torch.float32)
    torch.testing.assert_close(logprobs(model), logprobs(expected), atol=0, rtol=0)


def test_lora_on_the_meta_device_keeps_the_stored_dtype_and_real_adapters(folders):
    """The base in the checkpoint's bfloat16, frozen; the adapters float32, initialised for real before any
    sharding (lora_B zero: the model starts as its base), identically under the same seed."""
    path = folders["moe_bf16"]
    config = AutoConfig.from_pretrained(path)
    lora = LoraSettings(rank=4, experts=True)
    model = meta_model(config, torch.bfloat16, lora=lora, seed=3)
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and all(not p.is_meta and p.dtype == torch.float32 and p.requires_grad for p in adapters.values())
    assert all(p.abs().sum() == 0 for n, p in adapters.items() if "lora_B" in n)
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if "lora_A" in n)
    again = dict(meta_model(config, torch.bfloat16, lora=lora, seed=3).named_parameters())
    assert all(torch.equal(again[n], p) for n, p in adapters.items())
    base = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    assert all(p.is_meta and p.dtype == torch.bfloat16 and not p.requires_grad for p in base.values())
    materialize(model, "cpu")
    fill_from_checkpoint(model, checkpoint_files(path))
    stored = AutoModelForCausalLM.from_pretrained(path).state_dict()  # bfloat16, as saved
    loaded = dict(model.named_parameters())
    for name in base:
        assert torch.equal(loaded[name], stored[base_name(name)]), name


def test_lora_on_the_embeddings_starts_from_peft_init_on_the_meta_device(folders):
    """An embedding's adapters (peft's lora_embedding_A/B, not lora_A/B) are initialised too: A zero, so the model
    starts as its base, B normal; not the garbage of their empty memory."""
    config = AutoConfig.from_pretrained(folders["tied_bf16"])
    lora = LoraSettings(rank=4, target_modules=["q_proj", "embed_tokens"])
    model = meta_model(config, torch.bfloat16, lora=lora, seed=3)
    embedding = model.get_base_model().get_input_embeddings()
    a, b = embedding.lora_embedding_A["default"], embedding.lora_embedding_B["default"]
    assert torch.equal(a, torch.zeros_like(a))
    assert b.isfinite().all() and 0.8 < b.std() < 1.2  # nn.init.normal_
    again = meta_model(config, torch.bfloat16, lora=lora, seed=3).get_base_model().get_input_embeddings()
    assert torch.equal(again.lora_embedding_B["default"], b)


def test_a_checkpoint_missing_a_tensor_is_refused(folders, tmp_path):
    from safetensors.torch import load_file

    path = folders["moe_fp32"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    state = load_file(path / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = meta_model(AutoConfig.from_pretrained(tmp_path), torch.float32)
    materialize(model, "cpu")
    with pytest.raises(ValueError, match=r"lacks 1 of the model's tensors: model\.norm\.weight"):
        fill_from_checkpoint(model, checkpoint_files(tmp_path))


@pytest.mark.slow  # one 2-rank launch (~11 s here); the fast tier loads the same files in one process (above)
def test_two_ranks_load_their_shards_like_from_pretrained(folders, tmp_path):
    """`Trainer.build` under torch.distributed: each rank holds about half of every parameter, loaded exactly
    (logprobs to 1e-6 against from_pretrained of the same file, fp32 and bf16-saved); LoRA keeps the base in
    bf16 and trains fp32 adapters; tied weights and rotary buffers are right; an update runs; a weight sync
    sends the state dict in the asked dtype, or the adapter alone; checkpoints save, resume and export."""
    lora = {"rank": 4, "experts": True}
    cases = [
        {
            "name": "moe fp32 full",
            "path": "moe_fp32",
            "lora": None,
            "dtype": "float32",
            "kl_coef": 0.0,
            "checkpoint": str(tmp_path / "full"),
        },
        {
            "name": "moe bf16 lora",
            "path": "moe_bf16",
            "lora": lora,
            "dtype": "float32",
            "kl_coef": 0.0,
            "checkpoint": str(tmp_path / "lora"),
        },
        {"name": "tied bf16 full kl", "path": "tied_bf16", "lora": None, "dtype": "float32", "kl_coef": 0.1},
        {"name": "tied bf16 lora", "path": "tied_bf16", "lora": {"rank": 4}, "dtype": "float32", "kl_coef": 0.0},
        {
            "name": "moe bf16 lora bf16 compute",
            "path": "moe_bf16",
            "lora": lora,
            "dtype": "bfloat16",
            "kl_coef": 0.0,
            "activation_checkpointing": True,
            "cpu_offload": True,
        },
        {"name": "moe fused full", "path": "moe_fused", "lora": None, "dtype": "float32", "kl_coef": 0.0},
    ]
    for case in cases:
        case["path"] = str(folders[case["path"]])
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "records.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(WORKER),
        str(out),
        "load",
        str(tmp_path / "cases.json"),
    ]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    records = torch.load(out, weights_only=False)
    for case, r in zip(cases, records, strict=True):
        name, lora_case, path = case["name"], case["lora"] is not None, Path(case["path"])
        expected = pretrained(path)
        stored = stored_dtype(checkpoint_files(path))
        # each rank holds its own half of every parameter (the shards partition it)
        assert sum(r["shares"]) == pytest.approx(1.0) and max(r["shares"]) < 0.6, name
        assert r["base_dtypes"] == ({stored} if lora_case else {torch.float32}), name
        assert r["adapter_dtypes"] == ({torch.float32} if lora_case else set()), name
        assert r["reference_dtypes"] == ({stored} if case["kl_coef"] else None), name
        assert r["tied"] == expected.config.tie_word_embeddings == ("tied" in name), name
        assert torch.equal(r["inv_freq"], expected.model.rotary_emb.inv_freq), name
        loaded = {base_name(k): v for k, v in r["loaded"].items() if "lora_" not in k}
        assert loaded.keys() == expected.state_dict().keys(), name
        for k, v in expected.state_dict().items():
            assert torch.equal(loaded[k].float(), v), (name, k)
        if case["dtype"] == "float32":  # the same numbers as from_pretrained's float32 model (LoRA's B is zero)
            torch.testing.assert_close(r["lp"], logprobs(expected), atol=1e-6, rtol=0, msg=name)
        else:
            torch.testing.assert_close(r["lp"], logprobs(expected), atol=5e-2, rtol=0, msg=name)
        # one update: the adapters (only them) or every weight moved
        assert r["metrics"]["grad_norm"] > 0, name
        moved = {k for k, v in r["after"].items() if not torch.equal(v, r["loaded"][k])}
        if lora_case:
            assert moved and all("lora_" in k for k in moved), name
            assert any("lora_B" in k for k in moved), name
        else:
            assert len(moved) > len(r["after"]) // 2, name
        if case["kl_coef"]:
            assert r["metrics"]["kl_ref"] == pytest.approx(0.0, abs=1e-9), name  # the reference is the start
        # a weight sync: the state dict (or the adapter) in the asked dtype; bfloat16 halves it
        params = {id(p): p for p in expected.parameters()}.values()
        adapter = [v for k, v in r["after"].items() if "lora_" in k]
        numel = sum(v.numel() for v in adapter) if lora_case else sum(p.numel() for p in params)
        assert r["sync_bytes"] == {"None": 4 * numel, "torch.bfloat16": 2 * numel}, name
        assert r["sync_dtypes"] == {torch.float32, torch.bfloat16}, name
        if lora_case:
            assert r["sync_keys"] and all("lora_" in k and ".default." not in k for k in r["sync_keys"]), name
        else:
            assert r["sync_keys"] == sorted(expected.state_dict()), name
        if case.get("checkpoint"):  # DCP save and load into a fresh build, then the same next step
            for k, v in r["after"].items():
                assert torch.equal(r["resumed"][k], v), (name, k)
            assert r["next"][0] == pytest.approx(r["next"][1], abs=1e-6), name
            exported = AutoModelForCausalLM.from_pretrained(Path(case["checkpoint"]) / "hf").eval()
            assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}, name
            if not lora_case:  # the trained weights, rounded to bfloat16
                for k, v in exported.state_dict().items():
                    assert torch.equal(v, r["after"][k].to(torch.bfloat16)), (name, k)
            torch.testing.assert_close(logprobs(exported.float()), r["lp_after"], atol=5e-2, rtol=0, msg=name)


def test_lora_settings_that_would_never_train_are_refused():
    """An adapter on the output head: the learner's logprobs come from the head's base weight (the scorer's chunked
    product), so it would never move (its lora_B stayed 0 over an update), while an engine's forward would use it.
    Adapters on expert parameters: peft takes no dropout there, and said so only when the model was wrapped."""
    from agentrl.models.lora import with_lora

    with pytest.raises(ValueError, match=r"lora\.target_modules: lm_head is the output head"):
        with_lora(tiny_model("qwen3", seed=0), LoraSettings(rank=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match=r"lora\.experts with lora\.dropout=0\.1: .* set lora\.dropout=0"):
        LoraSettings(experts=True, dropout=0.1)
    with_lora(tiny_model("qwen3", seed=0), LoraSettings(rank=2, target_modules=["q_proj", "embed_tokens"]))
