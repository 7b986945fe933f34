"""The policy: any Hugging Face causal LM, optionally with LoRA, sharded with FSDP2.

`prepare` is the one place that decides how the model is placed: under torch.distributed
`parallelize` wraps it, in this order: activation checkpointing, then `fully_shard` per decoder
layer (the MoE experts' 3D weights are sharded along their first dimension, the experts, like
any parameter), then the root. The trainer never calls `fully_shard` itself.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import AutoModelForCausalLM, PreTrainedModel

from agentrl.models.default import resolve_path
from agentrl.models.lora import is_lora, with_lora
from agentrl.train.config import ModelConfig


def load_policy(cfg: ModelConfig) -> PreTrainedModel:
    """From a local folder or a hub id, in float32 (the master weights: bf16 is FSDP2's compute dtype)."""
    model = AutoModelForCausalLM.from_pretrained(resolve_path(cfg.path), dtype=torch.float32)
    return with_lora(model, cfg.lora) if cfg.lora else model


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if is_lora(model) else model


def full_state_dict(root: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights of `root` (the Scorer) on the CPU, under the policy's own key names (its
    `policy.` prefix removed). Every rank calls it."""
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach() for k, v in root.state_dict().items()}
    return {k.removeprefix("policy."): v for k, v in state.items()}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = causal_lm(model).get_decoder()
    if not hasattr(base, "layers"):
        raise ValueError(f"{type(base).__name__} has no `layers`: agentrl shards decoder layers one by one")
    return base.layers


def checkpoint_activations(model: nn.Module) -> None:
    """Each decoder layer's activations are recomputed in backward instead of kept."""
    lm = causal_lm(model)
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers 5's name; the old one warns there
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # transformers 4.x
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ModelConfig, *, root: nn.Module | None = None) -> nn.Module:
    """Activation checkpointing, FSDP2 per decoder layer of `model` and at `root` (a module holding
    `model`; default the model itself), with `cfg.dtype` bfloat16 mixed precision. Returns the root."""
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    mp = MixedPrecisionPolicy()
    if cfg.dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # pinned host memory needs an accelerator: without one, offload is plain CPU memory
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cfg.cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    root = root or model
    fully_shard(root, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return root


def train_device() -> torch.device:
    """Where this process trains: its GPU (torchrun's LOCAL_RANK, set by `init_distributed`), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def needs_fsdp(cfg: ModelConfig) -> bool:
    """bf16 mixed precision and CPU offload are FSDP2's policies: a single process runs them as a group of one."""
    return cfg.dtype != "float32" or cfg.cpu_offload


def prepare(model: nn.Module, cfg: ModelConfig, device: torch.device, *, root: nn.Module | None = None) -> None:
    """Ready `model` (held by `root`) for training: FSDP2 over every rank when torch.distributed is
    initialised, a group of one included; otherwise the plain module on `device`. There only activation
    checkpointing applies: FSDP2's own policies (bf16 mixed precision, CPU offload) are refused rather
    than silently left out."""
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh

        parallelize(model, init_device_mesh(device.type, (dist.get_world_size(),)), cfg, root=root)
        return
    if needs_fsdp(cfg):
        raise ValueError("model.dtype=bfloat16 and model.cpu_offload are FSDP2 policies: initialise "
                         "torch.distributed first (one rank is enough; `agentrl train` does)")  # fmt: skip
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    (root or model).to(device)


def init_distributed(cfg: ModelConfig) -> bool:
    """Join the process group (nccl on GPU, gloo on CPU) under torchrun with several ranks, or as a
    group of one when `cfg` asks for FSDP2's policies (bf16 mixed precision, CPU offload). True on rank 0."""
    if (int(os.environ.get("WORLD_SIZE", "1")) > 1 or needs_fsdp(cfg)) and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "WORLD_SIZE" in os.environ:  # torchrun's rendezvous
            dist.init_process_group(backend)
        else:  # a plain process: a group of one needs no rendezvous
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return not dist.is_initialized() or dist.get_rank() == 0


def shutdown_distributed() -> None:
    """Leave the process group `init_distributed` joined (if any)."""
    if dist.is_initialized():
        dist.destroy_process_group()
