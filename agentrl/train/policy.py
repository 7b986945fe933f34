"""The policy: a Hugging Face causal LM whose logits are its output head's product (the scorer refuses one that
softcaps or scales them: `agentrl.train.logprobs.check_plain_head`), optionally with LoRA, sharded with FSDP2.

`prepare` is the one place that decides how the model is placed: under torch.distributed
`parallelize` wraps it, in this order: activation checkpointing, then `fully_shard` per decoder
layer (the MoE experts' 3D weights are sharded along their first dimension, the experts, like
any parameter), then the root. The trainer never calls `fully_shard` itself.

Loading: in one plain process `load_policy` is `from_pretrained` in float32. Under torch.distributed,
`meta_policy` builds the model on the meta device (no memory) and `prepare` shards it first, then gives
each rank memory for its own shards only and fills them from the checkpoint files
(`agentrl.models.loading`): no rank ever holds the whole model. Parameters that train are float32
master weights (full fine-tuning: params x 4 bytes / world per rank); frozen ones (LoRA's base, the KL
reference) stay in the checkpoint's stored dtype, and FSDP2 casts them to the compute dtype when it
gathers a layer. Gathering weights back (`gather_state`) goes one parameter at a time, in the dtype asked.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from agentrl.models.default import resolve_path
from agentrl.models.loading import (
    checkpoint_files,
    fill_from_checkpoint,
    has_meta_tensors,
    materialize,
    meta_model,
    model_folder,
    stored_dtype,
)
from agentrl.models.lora import is_lora, with_lora
from agentrl.train.config import ModelConfig


def load_policy(cfg: ModelConfig) -> PreTrainedModel:
    """From a local folder or a hub id, in float32 (the master weights: bf16 is FSDP2's compute dtype)."""
    model = AutoModelForCausalLM.from_pretrained(resolve_path(cfg.path), dtype=torch.float32)
    return with_lora(model, cfg.lora) if cfg.lora else model


def meta_policy(cfg: ModelConfig, *, frozen: bool = False, seed: int = 0) -> nn.Module:
    """The policy of `cfg.path` on the meta device, for `prepare` to shard and load under torch.distributed.
    Full fine-tuning: float32 master weights. LoRA: the base in the checkpoint's stored dtype (bfloat16 when
    saved so), frozen; the adapters float32, initialised (seeded by `seed`). `frozen`: the KL reference of full
    fine-tuning, in the stored dtype, no adapters, nothing trains."""
    folder = model_folder(resolve_path(cfg.path))
    trains_base = cfg.lora is None and not frozen
    dtype = torch.float32 if trains_base else stored_dtype(checkpoint_files(folder))
    model = meta_model(AutoConfig.from_pretrained(folder), dtype, lora=None if frozen else cfg.lora, seed=seed)
    return model.requires_grad_(False) if frozen else model


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if is_lora(model) else model


def gather_state(
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    *,
    dtype_of: Callable[[str], torch.dtype | None] | None = None,
    copy: bool = False,
) -> dict[str, torch.Tensor]:
    """Whole CPU copies of `tensors` (DTensor shards are gathered), one at a time: no rank holds more than
    the result and one tensor in flight. Floating tensors are cast to `dtype` (or `dtype_of(name)` where that
    is not None) on each rank before the gather, so a bfloat16 sync moves half the bytes of a float32 one.
    Every rank calls it; rank 0 keeps the result, the others get an empty dict. A tensor shared under
    two names (tied embeddings) is gathered once. `copy`: never return a live parameter's own memory."""
    keep = not dist.is_initialized() or dist.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, t in tensors.items():
        if id(t) not in done:
            want = (dtype_of(name) if dtype_of else None) or dtype
            value = t.detach()
            if want is not None and value.is_floating_point():
                value = value.to(want)
            if isinstance(value, DTensor):
                if value.device.type != value.device_mesh.device_type:  # CPU-offloaded shards: nccl gathers on GPU
                    value = value.to(value.device_mesh.device_type)
                value = value.full_tensor()
            value = value.cpu()
            if copy and not isinstance(t, DTensor) and value.data_ptr() == t.data_ptr():
                value = value.clone()
            done[id(t)] = value if keep else value.new_empty(0)
        if keep:
            state[name] = done[id(t)]
    return state


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train, by name, as FSDP2 shards them: its state-dict hooks put back the sharded
    parameters that a forward left gathered (`named_parameters()` would give the gathered compute-dtype copies)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n: t for n, t in model.state_dict(keep_vars=True).items() if n in names}


def gather_once_a_step(model: nn.Module) -> None:
    """An FSDP2 `model` over one rank keeps each layer's gathered compute-dtype copy through its backwards too (a
    no-op on a plain module): the forwards and backwards of one optimizer step (its micro-batches, a shared prefix
    scored apart from its suffixes) compute with the same weights, gathered once. Its trainer must `reshard` it
    before each step changes the weights, or the next forward would compute with the old copy."""
    if isinstance(model, FSDPModule):
        model.set_reshard_after_backward(False)


def reshard(model: nn.Module) -> None:
    """Drop every gathered copy of an FSDP2 `model`'s weights, registering the sharded parameters again."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """The bytes a state dict holds (what a weight sync moves); a tensor under two names counts once."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = causal_lm(model).get_decoder()
    if not hasattr(base, "layers"):
        raise ValueError(f"{type(base).__name__} has no `layers`: agentrl shards decoder layers one by one")
    return base.layers


def checkpoint_activations(model: nn.Module) -> None:
    """Each decoder layer's activations are recomputed in backward instead of kept."""
    lm = causal_lm(model)
    if hasattr(lm, "activation_checkpointing_enable"):  # its name from transformers 5.24; the old one warns there
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_mlps(model: nn.Module) -> None:
    """torch.compile each decoder layer's MLP (an MoE block: its router and experts) in place (`Module.compile`: the
    state dict's names stay), over dynamic shapes: the update's lengths change every minibatch.

    Not the whole layer: its attention writes the scorer's KV cache of a shared prefix at the layer's index, and
    dynamo specialises a compiled layer to each index (a 12-layer Qwen3-MoE went past its limit of 8 recompiles and
    ran the rest eagerly). Nor the norms: their one `forward` takes 3D and 4D inputs (the q and k norms) in both
    grad modes and came within one of that limit. The MLPs recompile only per grad mode and for a batch of one row.
    """
    for layer in decoder_layers(model):
        if not isinstance(getattr(layer, "mlp", None), nn.Module):
            raise ValueError(f"{type(layer).__name__} has no `mlp` for model.compile to compile")
        layer.mlp.compile(dynamic=True)


def _ready_layers(model: nn.Module, cfg: ModelConfig) -> None:
    """What both placements (FSDP2, a plain process) do to the decoder layers first: activation checkpointing, then
    compiled MLPs (`cfg.compile`), each where `cfg` asks for it."""
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    if cfg.compile:
        compile_mlps(model)


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ModelConfig, *, root: nn.Module | None = None) -> nn.Module:
    """Activation checkpointing, compiled MLPs (`cfg.compile`), FSDP2 per decoder layer of `model` and at `root` (a
    module holding `model`; default the model itself), with `cfg.dtype` bfloat16 mixed precision. Returns the root."""
    _ready_layers(model, cfg)
    # parameters are gathered in the compute dtype (frozen bfloat16 ones too under float32 compute: LoRA's base,
    # the reference), gradients reduced in float32; FSDP2 skips a cast to the dtype a parameter already has
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.dtype), reduce_dtype=torch.float32)
    # pinned host memory needs an accelerator: without one, offload is plain CPU memory
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cfg.cpu_offload else OffloadPolicy()
    # One rank shards nothing: a layer keeps its gathered compute-dtype copy from its forward to its backward instead
    # of casting and gathering it again there (FSDP2 still drops it after the backward, before the optimizer step).
    # Over more ranks that copy would be the whole layer on every rank for the whole forward and backward.
    reshard = mesh.size() > 1
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
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
    than silently left out. A model on the meta device (`meta_policy`) is sharded first, then loaded: each
    rank materialises and reads only its own shards."""
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh

        parallelize(model, init_device_mesh(device.type, (dist.get_world_size(),)), cfg, root=root)
        if has_meta_tensors(model):
            # CPU offload keeps the sharded parameters on the CPU; buffers live where the compute is
            materialize(model, torch.device("cpu") if cfg.cpu_offload else device, buffer_device=device)
            fill_from_checkpoint(model, checkpoint_files(model_folder(resolve_path(cfg.path))))
        return
    if has_meta_tensors(model):
        raise ValueError("a model on the meta device is loaded into its FSDP2 shards: initialise torch.distributed")
    if needs_fsdp(cfg):
        raise ValueError(
            "model.dtype=bfloat16 and model.cpu_offload are FSDP2 policies: initialise "
            "torch.distributed first (one rank is enough; `agentrl train` does)"
        )
    _ready_layers(model, cfg)
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
