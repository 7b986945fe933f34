"""Memory-honest loading: a model built on the meta device from its config, then only this process's shards
materialised and filled from the checkpoint's safetensors files, each read in its stored dtype.

`from_pretrained` materialises the whole model in every process that calls it: with FSDP2 over 8 ranks of one
host, 8 whole copies before any is sharded. Here no process ever holds more than its own shards plus one
parameter's shard in flight (a fused MoE parameter: its per-expert slices too, until they are concatenated):

1. `meta_model`: the architecture from its config on the meta device (no memory), in the dtype each parameter
   will be held in; LoRA adapters, if any, wrapped around it and initialised by peft (they are small and real);
2. the caller shards it (FSDP2's `fully_shard`: every parameter becomes a DTensor whose local part is this
   rank's rows; `agentrl.train.policy.parallelize`);
3. `materialize`: every tensor still on the meta device gets real, empty memory of its local size, and the
   non-persistent buffers (rotary `inv_freq`) are rebuilt by the model's own `_init_weights`, as
   `from_pretrained` does after its own meta-device construction;
4. `fill_from_checkpoint`: for each parameter, only this rank's slice of each checkpoint tensor is read
   (safetensors `get_slice`; for a MoE layer stored one tensor per expert, only this rank's experts), cast to
   the parameter's dtype and copied into its local shard. Checkpoint names and layouts are mapped to the
   model's by transformers' own conversion mapping (`get_model_conversion_mapping`: transformers 5 fuses
   the experts of a MoE layer into 3D `mlp.experts.gate_up_proj` / `down_proj` in memory, while checkpoints,
   its own `save_pretrained`'s included, keep `mlp.experts.<e>.gate_proj.weight` and so on), and the slices by
   its `DtensorShardOperation`, the shard-on-read that `from_pretrained` uses for its own tensor parallelism.

A plain (non-DTensor) parameter is read whole: the same code loads an unsharded model.
"""

from __future__ import annotations

import json
import logging
import re
import socket
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from copy import deepcopy
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from agentrl.models.lora import LoraSettings, is_lora

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_BASE_LAYER = re.compile(r"\.base_layer(?=\.)")  # peft's wrapper level (nested once per wrapped parameter)
ADAPTER_MARK = "lora_"
"""peft's prefix of LoRA's own modules and parameters (`LoraModel.prefix`)"""


def model_folder(path: str) -> Path:
    """The local folder of a model: `path` itself, or a hub id's snapshot (config and safetensors only;
    under torch.distributed rank 0 downloads it first, then the others: found in the cache where they share
    rank 0's, downloaded where they run on another node)."""
    if Path(path).is_dir():
        return Path(path)
    if Path(path).is_absolute():  # a folder named by the driver, absent here: not a hub id
        raise FileNotFoundError(
            f"model folder {path} does not exist on {socket.gethostname()}: every node that "
            "loads the model needs it at the same path (or give a hub id)"
        )
    import torch.distributed as dist
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_rank() == 0:
            snapshot_download(path, allow_patterns=patterns)
        dist.barrier()
    return Path(snapshot_download(path, allow_patterns=patterns))


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder (one file, or the shards its index names)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    raise FileNotFoundError(
        f"{folder} has no model.safetensors (nor an index of shards): memory-honest loading reads safetensors only"
    )


def stored_dtype(files: list[Path]) -> torch.dtype:
    """The floating dtype most of the checkpoint's elements are stored in (from the files' headers alone)."""
    from safetensors import safe_open

    elements: dict[torch.dtype, int] = defaultdict(int)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                s = f.get_slice(key)
                if (dtype := _SAFETENSORS_DTYPES.get(s.get_dtype())) is not None:
                    elements[dtype] += int(torch.Size(s.get_shape()).numel())
    if not elements:
        raise ValueError(f"no floating-point tensors in {[str(f) for f in files]}")
    return max(elements, key=elements.__getitem__)


def meta_model(
    config: PretrainedConfig, dtype: torch.dtype, *, lora: LoraSettings | None = None, seed: int = 0
) -> nn.Module:
    """The causal LM of `config` on the meta device, its parameters in `dtype` (what they will be held in),
    wrapped with LoRA if `lora`: peft makes the adapters float32 whatever the base's dtype, and they are
    initialised here for real (peft's own init, the same on every rank under the same seed): they are small,
    and `fully_shard` then shards their values like any parameter's."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()  # as from_pretrained returns it
    if lora is None:
        return model
    from agentrl.models.lora import with_lora

    model = with_lora(model, lora)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            if hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A"):
                for name in module.adapter_layer_names:
                    adapters = getattr(module, name)
                    if any(t.is_meta for t in adapters.parameters()):
                        adapters.to_empty(device="cpu")
                # an embedding's adapters are its lora_embedding_A/B (its lora_A is empty): left out, they kept
                # to_empty's garbage
                for adapter in [*module.lora_A, *module.lora_embedding_A]:
                    module.reset_lora_parameters(adapter, model.peft_config[adapter].init_lora_weights)
    return model


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(model))


@torch.no_grad()
def materialize(
    model: nn.Module, device: torch.device | str, *, buffer_device: torch.device | str | None = None
) -> None:
    """Give every meta tensor of `model` empty memory on `device` (a DTensor: its local shard only; buffers on
    `buffer_device`, default `device`), keeping tied parameters tied, and rebuild the non-persistent buffers
    with the model's own `_init_weights` (rotary `inv_freq`). The parameters and persistent buffers hold
    garbage until `fill_from_checkpoint`."""
    from torch.distributed.tensor import DTensor

    buffer_device = buffer_device or device
    new: dict[int, torch.Tensor] = {}  # a tied parameter is one object in two modules: it stays one

    def empty(t: torch.Tensor, where) -> torch.Tensor:
        if isinstance(t, DTensor):
            local = torch.empty(t.to_local().shape, dtype=t.dtype, device=where)
            return DTensor.from_local(
                local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        return torch.empty(t.shape, dtype=t.dtype, device=where)

    rebuilt: list[tuple[nn.Module, str]] = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(empty(p, device), requires_grad=p.requires_grad)
                module._parameters[name] = new[id(p)]
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = empty(b, buffer_device)
                if name in module._non_persistent_buffers_set:
                    if module._buffers[name].is_floating_point():
                        module._buffers[name].fill_(float("nan"))  # a buffer _init_weights does not rebuild shows
                    rebuilt.append((module, name))
    lm = _causal_lm(model)
    for module in {id(m): m for m, _ in rebuilt}.values():
        lm._init_weights(module)
    for module, name in rebuilt:
        if module._buffers[name].is_floating_point() and module._buffers[name].isnan().any():
            raise NotImplementedError(
                f"{type(lm).__name__}._init_weights does not rebuild the non-persistent "
                f"buffer {name!r} of {type(module).__name__}: it cannot be loaded from the "
                "meta device"
            )


@torch.no_grad()
def fill_from_checkpoint(model: nn.Module, files: list[Path]) -> None:
    """Copy this rank's part of every parameter and persistent buffer of `model` (LoRA adapters aside) from
    the safetensors `files`, each tensor read as a slice in its stored dtype and cast to the parameter's.
    Raises if the checkpoint lacks one of them; checkpoint tensors the model has no place for are logged."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    from transformers.distributed.sharding_utils import DtensorShardOperation

    lm = _causal_lm(model)
    targets = _load_targets(lm)  # transformers' names (as in the checkpoint, after conversion) -> tensor
    transforms = get_model_conversion_mapping(lm)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    tied = set(getattr(lm, "all_tied_weights_keys", None) or {})

    def read(source, target: torch.Tensor, index: int | None = None):
        """A loader of this rank's part of the checkpoint tensor `source` (a safetensors slice)."""
        if isinstance(target, DTensor):
            op = DtensorShardOperation(target)
            return lambda: op.shard_tensor(source, tensor_idx=index, dtype=target.dtype)
        return lambda: source[...].to(target.dtype)

    filled: set[str] = set()
    unexpected: list[str] = []
    with ExitStack() as files_open:
        handles = [files_open.enter_context(safe_open(str(f), framework="pt")) for f in files]
        keys = sorted(((k, h) for h in handles for k in h.keys()), key=lambda kh: dot_natural_key(kh[0]))  # noqa: SIM118
        pending: dict[str, WeightConverter] = {}
        for key, handle in keys:
            name, pattern = rename_source_key(key, renamings, converters, lm.base_model_prefix, targets)
            if name not in targets:
                if name not in tied:
                    unexpected.append(key)
                continue
            target = targets[name]
            if pattern is None:  # a plain tensor (perhaps renamed): read this rank's rows now
                _put(target, read(handle.get_slice(key), target)())
                filled.add(name)
                continue
            # several checkpoint tensors make this one (a MoE layer's experts): collected, then converted once
            converter = pending.setdefault(name, deepcopy(by_pattern[pattern]))
            index = len(converter.collected_tensors.get(pattern, []))
            converter.add_tensor(name, key, pattern, read(handle.get_slice(key), target, index))
        for name, converter in pending.items():
            for target_name, value in converter.convert(name, model=lm, config=lm.config).items():
                _put(targets[target_name], value[0] if isinstance(value, list) else value)
                filled.add(target_name)
    if missing := sorted(set(targets) - filled):
        raise ValueError(
            f"the checkpoint lacks {len(missing)} of the model's tensors: {', '.join(missing[:8])}"
            + (", ..." if len(missing) > 8 else "")
        )
    if unexpected:
        log.warning(
            "%d checkpoint tensors have no place in the model, left out: %s", len(unexpected), ", ".join(unexpected[:8])
        )


def _put(target: torch.Tensor, value: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    local = target.to_local() if isinstance(target, DTensor) else target
    if local.shape != value.shape:
        raise ValueError(f"a checkpoint slice of shape {tuple(value.shape)} for a shard of {tuple(local.shape)}")
    local.copy_(value)


def _load_targets(lm: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint fills, under transformers' names: parameters (a tied one once) and persistent
    buffers; peft's `base_layer` levels dropped from the names, its adapters left out."""
    targets: dict[str, torch.Tensor] = {}
    persistent = set(lm.state_dict(keep_vars=True))
    tensors = [*lm.named_parameters(), *((n, b) for n, b in lm.named_buffers() if n in persistent)]
    for name, tensor in tensors:
        if ADAPTER_MARK in name:
            continue
        targets[_BASE_LAYER.sub("", name)] = tensor
    return targets


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    return model.get_base_model() if is_lora(model) else model


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
