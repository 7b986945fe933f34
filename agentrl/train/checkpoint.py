"""Checkpoints with `torch.distributed.checkpoint`: sharded, resumable, exportable to Hugging Face.

A checkpoint folder holds the model, optimizer and learning-rate schedule state (each rank writes its own shards;
DCP reshards on load, so a run may resume on another world size), every rank's RNG state,
and `state.json`: the step, the policy version and whatever the training loop needs to
continue (the task cursor, the parked partial rollouts), written by rank 0.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import AutoModelForCausalLM, PreTrainedModel

from agentrl.models.loading import ADAPTER_MARK
from agentrl.models.lora import is_lora, peft_model
from agentrl.runs import write_whole
from agentrl.train.policy import causal_lm, gather_state, trainable_state
from agentrl.train.scoring import Scorer


class Trained(Protocol):
    """What a checkpoint holds the state of: the RL `Trainer`, or `agentrl sft`'s loop."""

    scorer: Scorer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rank: int


def save(path: str | Path, trainer: Trained, state: dict[str, Any]) -> None:
    """Every rank calls it. `state` must be JSON-serialisable (rank 0's is written)."""
    path = Path(path)
    model, optim = get_state_dict(trainer.scorer, trainer.optimizer)
    with _one_process_is_fine():
        dcp.save({"model": model, "optim": optim, "scheduler": trainer.scheduler.state_dict()}, checkpoint_id=path)
    torch.save(
        {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        path / f"rng_{trainer.rank}.pt",
    )
    if dist.is_initialized():  # every rank's RNG file is written before state.json says the checkpoint is whole
        dist.barrier()
    if trainer.rank == 0:  # last: a folder without state.json is an unfinished checkpoint
        write_whole(path / "state.json", json.dumps(state, indent=1))
    if dist.is_initialized():
        dist.barrier()


def load(path: str | Path, trainer: Trained) -> dict[str, Any]:
    """Restore model, optimizer state (AdamW's moments), the schedule's step and RNG into a trainer built like the
    saved one; returns `state`.

    The hyperparameters stay the trainer's own, as its config built them: the learning rate, betas, weight decay
    and the schedule's shape. A resume with `--set optim.lr=...` trains at the new rate from the saved step on,
    lr = lr_new · factor(step) under the new schedule, rather than the checkpoint's."""
    path = Path(path)
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"{path} is not a finished checkpoint (no state.json)")
    scheduler = trainer.scheduler
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        raise TypeError(f"checkpoints restore a LambdaLR schedule, not {type(scheduler).__name__}")
    model, optim = get_state_dict(trainer.scorer, trainer.optimizer)
    _check_same_model(path, model)
    sd = {"model": model, "optim": optim, "scheduler": scheduler.state_dict()}
    with _one_process_is_fine():
        dcp.load(sd, checkpoint_id=path)
    built = [{k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    set_state_dict(trainer.scorer, trainer.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scheduler.load_state_dict(sd["scheduler"])  # its step (and, until overwritten below, the saved base rates)
    scheduler.base_lrs = base_lrs
    step = scheduler.last_epoch
    for group, own, base, factor in zip(
        trainer.optimizer.param_groups, built, base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group.update(own, lr=base * factor(step))
    scheduler._last_lr = [group["lr"] for group in trainer.optimizer.param_groups]
    rng = path / f"rng_{trainer.rank}.pt"
    if rng.exists():  # resumed on more ranks than saved: the new ones keep their seeds
        saved = torch.load(rng, weights_only=True)
        torch.set_rng_state(saved["cpu"])
        if saved["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda"])
    return json.loads((path / "state.json").read_text())


def export_hf(scorer: Scorer, path: str | Path, *, merge_lora: bool = True, dtype: str = "float32") -> None:
    """A plain Hugging Face folder (config + safetensors, weights in `dtype`) of the scorer's policy; every
    rank calls it. A LoRA policy is merged into its base weights (`merge_lora`), or saved as a peft adapter
    (then only the adapter is gathered). The tokenizer is the caller's to save beside it.

    The weights are gathered one parameter at a time, each cast to `dtype` before its gather (a LoRA adapter
    to be merged stays float32: peft merges it, then drops it), into a model built on the meta device that
    takes them as its own: rank 0 holds what it writes, no second copy.
    """
    to = getattr(torch, dtype)
    policy = scorer.policy
    lora = is_lora(policy)
    if lora and not merge_lora:
        state = gather_state(trainable_state(policy), to, copy=True)
    else:
        keep_fp32 = (lambda name: torch.float32 if ADAPTER_MARK in name else None) if lora else None
        state = gather_state(policy.state_dict(keep_vars=True), to, dtype_of=keep_fp32, copy=True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(causal_lm(policy).config, dtype=to)
        if lora:
            model = peft_model(model, policy.peft_config["default"])
        model.load_state_dict(state, assign=True, strict=not lora or merge_lora)
        if lora and merge_lora:
            untied = _untie_adapted_embeddings(model.get_base_model())
            with warnings.catch_warnings():  # peft's advice for tied embeddings, which the untying above has taken
                warnings.filterwarnings("ignore", "Model with `tie_word_embeddings=True`", UserWarning)
                warnings.filterwarnings("ignore", "Input and output embeddings are no longer tied", UserWarning)
                model = model.merge_and_unload()
            if untied:  # saved as two tensors, and from_pretrained must not tie them again
                model.config.tie_word_embeddings = False
                model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)
        model.save_pretrained(path)
        del model, state
    if dist.is_initialized():
        dist.barrier()


def _check_same_model(path: Path, model: dict[str, torch.Tensor]) -> None:
    """Refuse, before anything loads, a checkpoint whose model tensors are not the trainer's by name and shape (a
    resume with another model or LoRA settings): DCP would fail mid-load with a BaseException holding a traceback,
    or leave out the tensors the trainer has no place for."""
    saved = {
        name.removeprefix("model."): tuple(md.size)
        for name, md in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
        if name.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    built = {name: tuple(t.shape) for name, t in model.items()}
    reshaped = {f"{n} (saved {saved[n]}, now {built[n]})" for n in built.keys() & saved.keys() if built[n] != saved[n]}
    problems = [
        f"{len(names)} {what}: {', '.join(sorted(names)[:3])}{', ...' * (len(names) > 3)}"
        for what, names in (
            ("tensors missing", built.keys() - saved.keys()),
            ("tensors not in this model", saved.keys() - built.keys()),
            ("of another shape", reshaped),
        )
        if names
    ]
    if problems:
        raise ValueError(
            f"{path} holds another model than this run builds (a changed model.path or model.lora?): "
            + "; ".join(problems)
        )


def _untie_adapted_embeddings(lm: PreTrainedModel) -> bool:
    """Where `lm`'s input and output embeddings are one tensor and LoRA adapts either, give the output head a copy of
    its own (the base's); returns whether it did. The policy's head and embedding differ by their adapters: merged
    into the shared tensor (peft merges an embedding's adapter in place), each would take the other's update too."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    embedding, head = (
        layer.get_base_layer() if isinstance(layer, BaseTunerLayer) else layer
        for layer in (lm.get_input_embeddings(), lm.get_output_embeddings())
    )
    adapted = embedding is not lm.get_input_embeddings() or head is not lm.get_output_embeddings()
    if not adapted or embedding.weight.data_ptr() != head.weight.data_ptr():
        return False
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    return True


@contextlib.contextmanager
def _one_process_is_fine() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialised: here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
