"""A checkpoint after step k, resumed in a fresh trainer, reproduces step k+1; export to Hugging Face."""

import pytest
import torch
from fsdp_worker import fixed_batch
from transformers import AutoModelForCausalLM

from agentrl.models.lora import LoraSettings, with_lora
from agentrl.models.tiny import tiny_model
from agentrl.train import checkpoint
from agentrl.train.config import ModelConfig, OptimConfig, TrainerConfig, lr_factor
from agentrl.train.trainer import Trainer

LORA = LoraSettings(rank=4)


def trainer(lora: bool, **optim) -> Trainer:
    policy = tiny_model("qwen3_moe", seed=0)
    optim = {"lr": 1e-2, "minibatches": 2, "warmup_steps": 5} | optim
    cfg = TrainerConfig(model=ModelConfig(lora=LORA if lora else None), optim=OptimConfig(**optim))
    return Trainer(cfg, with_lora(policy, LORA) if lora else policy)


def second_batch():
    b = fixed_batch()
    b.advantages = -b.advantages  # another step's data
    return b


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_reproduces_the_next_step(tmp_path, lora):
    a = trainer(lora)
    a.update(fixed_batch())
    checkpoint.save(tmp_path / "step1", a, {"step": 1, "policy_version": 1, "task_cursor": 8})
    expected = a.update(second_batch())
    expected_state = {k: v.clone() for k, v in a.scorer.state_dict().items()}

    b = trainer(lora)  # a fresh process would build it the same way
    assert checkpoint.load(tmp_path / "step1", b) == {"step": 1, "policy_version": 1, "task_cursor": 8}
    got = b.update(second_batch())
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert b.scheduler.last_epoch == a.scheduler.last_epoch == 4  # 2 updates x 2 minibatches
    for name, value in b.scorer.state_dict().items():  # the optimizer's moments and the schedule came back too
        torch.testing.assert_close(value, expected_state[name], atol=1e-6, rtol=0, msg=name)


def test_a_resume_trains_with_its_own_optimizer_settings(tmp_path):
    """`agentrl train --resume RUN --set optim.lr=...` rewrites the run's config: the resumed trainer steps at the
    new rate, betas and weight decay from the saved step on (AdamW's moments and the step count are the checkpoint's),
    not at the checkpoint's."""
    a = trainer(False)
    a.update(fixed_batch())
    checkpoint.save(tmp_path / "step1", a, {"step": 1})
    b = trainer(False, lr=1e-3, warmup_steps=2, decay_steps=20, betas=(0.8, 0.9), weight_decay=0.5)
    checkpoint.load(tmp_path / "step1", b)
    [group] = b.optimizer.param_groups
    assert b.scheduler.last_epoch == 2 and b.scheduler.base_lrs == [1e-3]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3 * lr_factor(2, 2, 20, 0.1), (0.8, 0.9), 0.5)
    assert b.scheduler.get_last_lr() == [group["lr"]]
    assert group["lr"] != a.optimizer.param_groups[0]["lr"]  # the checkpoint's was 1e-2 · factor(2) of its schedule
    b.update(fixed_batch())
    assert group["lr"] == pytest.approx(1e-3 * lr_factor(4, 2, 20, 0.1))


def test_an_unfinished_checkpoint_is_refused(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match="not a finished checkpoint"):
        checkpoint.load(tmp_path / "half", trainer(False))


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (
            LoraSettings(rank=2),
            r"16 of another shape: policy\..*lora_A.default.weight \(saved \(4, 64\), now \(2, 64\)\)",
        ),
        (LoraSettings(rank=4, target_modules=["q_proj"]), r"6 tensors missing: .*; 18 tensors not in this model"),
    ],
    ids=["rank", "targets"],
)
def test_a_checkpoint_of_other_lora_settings_is_refused_before_loading(tmp_path, settings, problem):
    """One ValueError naming the tensors that differ (DCP's own is a BaseException holding a traceback), and the
    trainer untouched."""
    a = trainer(True)
    a.update(fixed_batch())
    checkpoint.save(tmp_path / "step1", a, {"step": 1})
    b = Trainer(TrainerConfig(model=ModelConfig(lora=settings)), with_lora(tiny_model("qwen3_moe", seed=0), settings))
    before = {k: v.clone() for k, v in b.scorer.state_dict().items()}
    with pytest.raises(ValueError, match=r"step1 holds another model than this run builds .*" + problem):
        checkpoint.load(tmp_path / "step1", b)
    assert all(torch.equal(v, before[k]) for k, v in b.scorer.state_dict().items())
    assert b.scheduler.last_epoch == 0


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-merged"])
def test_export_to_a_hugging_face_folder(tmp_path, lora):
    t = trainer(lora)
    t.update(fixed_batch())
    checkpoint.export_hf(t.scorer, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = fixed_batch().input_ids[:2, :16]
    with torch.no_grad():
        lp, _, _ = t.scorer(ids, torch.ones_like(ids), fixed_batch().sampling)
        logits = exported(ids).logits[:, :-1]
    from agentrl.engine.sampling import token_logprobs

    expected = token_logprobs(logits, ids[:, 1:], fixed_batch().sampling)
    torch.testing.assert_close(lp[:, 1:], expected, atol=1e-4, rtol=0)


def test_export_of_lora_on_tied_embeddings_unties_them(tmp_path):
    """Tied embeddings with an adapter on the input side: the policy's output head is the base embedding, its input
    the adapted one. Merged into the one shared tensor, the head would take the input's update too."""
    lora = LoraSettings(rank=4, target_modules=["q_proj", "embed_tokens"])
    policy = with_lora(tiny_model("qwen3", seed=0, tie_word_embeddings=True), lora)
    t = Trainer(TrainerConfig(model=ModelConfig(lora=lora), optim=OptimConfig(lr=1e-2, minibatches=2)), policy)
    t.update(fixed_batch())
    checkpoint.export_hf(t.scorer, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not exported.config.tie_word_embeddings
    ids = fixed_batch().input_ids[:2, :16]
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, policy(ids).logits, atol=1e-4, rtol=0)
