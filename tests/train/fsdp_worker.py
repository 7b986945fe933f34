"""One update of a tiny policy on a fixed batch; run plainly (one process) or under torchrun (gloo).

python tests/train/fsdp_worker.py OUT {moe|lora|replay}           # reference, no torch.distributed
torchrun --nproc-per-node 2 tests/train/fsdp_worker.py OUT {moe|lora|replay}
python tests/train/fsdp_worker.py OUT bf16                  # FSDP2 on a group of one: bf16, checkpointing, offload
torchrun --nproc-per-node 2 tests/train/fsdp_worker.py OUT load CASES.json   # Trainer.build's sharded loading
python tests/train/fsdp_worker.py OUT gathers               # bf16 on a group of one: the weights' casts an update
python tests/train/fsdp_worker.py OUT bf16+compile          # any kind, with model.compile (the MLPs compiled)
torchrun --nproc-per-node 3 tests/train/fsdp_worker.py OUT pairs   # minibatches of 2 rows: a rank holds none
"""

import asyncio
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from agentrl.engine.base import SamplingParams
from agentrl.engine.hf import HFEngine
from agentrl.models.lora import LoraSettings, with_lora
from agentrl.models.tiny import tiny_model
from agentrl.train import checkpoint
from agentrl.train.batch import TrainBatch
from agentrl.train.config import AlgoConfig, ModelConfig, OptimConfig, TrainerConfig
from agentrl.train.learner import LocalLearner
from agentrl.train.policy import causal_lm, decoder_layers, gather_state, init_distributed, state_bytes
from agentrl.train.replay import position_routing
from agentrl.train.trainer import Trainer
from agentrl.train.weight_sync import weight_sync


def full_state_dict(root: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) weights of a Scorer on rank 0, under the policy's own key names."""
    return {k.removeprefix("policy."): v for k, v in gather_state(root.state_dict(keep_vars=True)).items()}


def fixed_batch(B: int = 8, L: int = 64, P: int = 36) -> TrainBatch:
    """Every row starts with the same P-token prompt, so the scorer's shared-prefix path runs under FSDP2 too."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(P + 4, L + 1, (B,), generator=g)
    ids = torch.randint(1, 2000, (B, L), generator=g)
    ids[:, :P] = ids[0, :P]
    attention = (torch.arange(L)[None] < lengths[:, None]).long()
    loss_mask = attention.clone()
    loss_mask[:, :P] = 0  # the prompt
    loss_mask[:, P + 8 : P + 12] = 0  # an observation
    return TrainBatch(
        input_ids=ids * attention,
        attention_mask=attention,
        loss_mask=loss_mask,
        old_logprobs=(-3 - torch.rand(B, L, generator=g)) * loss_mask,
        advantages=torch.randn(B, L, generator=g) * loss_mask,
        sampling=SamplingParams(temperature=0.9),
    )


def replayed_batch(P: int = 36) -> TrainBatch:
    """`fixed_batch` with an engine's routing record of the tiny Qwen3-MoE (2 layers, top-2 of 4) at every real token
    but the first: random sets, the same for every row up to the prompt's last position (as an engine's prefix
    cache gives), so the shared-prefix scorer replays too."""
    b = fixed_batch(P=P)
    g = torch.Generator().manual_seed(1)
    B, L = b.input_ids.shape
    sets = torch.rand(B, L, 2, 4, generator=g).argsort(-1)[..., :2]
    sets[:, : P + 1] = sets[:1, : P + 1]  # token t's record is position t − 1's: positions 0..P − 1 agree
    recorded = b.attention_mask.bool() & (torch.arange(L) > 0)
    b.routed_experts = torch.where(recorded[..., None, None], sets, -1).to(torch.int16)
    return b


def second_batch() -> TrainBatch:
    b = fixed_batch()
    b.advantages = -b.advantages
    return b


async def synced_engine_state(trainer: Trainer) -> tuple[int, dict[str, torch.Tensor]]:
    """What `agentrl train` does next under torch.distributed: rank 0's engine copy takes the weights."""
    async with HFEngine(tiny_model("qwen3_moe", seed=0)) as engine:
        version = await weight_sync(LocalLearner(trainer, in_thread=False), engine).push()
        return version, {k: v.clone() for k, v in engine.model.state_dict().items()}


def main(out: str, kind: str, phase: str = "", ckpt: str = "") -> None:
    kind, compiled = kind.removesuffix("+compile"), kind.endswith("+compile")
    model = (
        ModelConfig(dtype="bfloat16", activation_checkpointing=True, cpu_offload=True, compile=compiled)
        if kind == "bf16"
        else ModelConfig(lora=LoraSettings(rank=4) if kind == "lora" else None, compile=compiled)
    )
    init_distributed(model)
    torch.manual_seed(0)
    policy = tiny_model("qwen3_moe", seed=0)
    if kind == "lora":
        policy = with_lora(policy, LoraSettings(rank=4, experts=True))
    seen: set[torch.dtype] = set()  # the dtype the decoder layers compute in

    def note_dtype(_, args, kwargs):
        seen.add((args[0] if args else kwargs["hidden_states"]).dtype)

    decoder_layers(policy)[0].register_forward_pre_hook(note_dtype, with_kwargs=True)
    # replay: R3, decoupled, so the proximal pass replays too
    algo = AlgoConfig(routing_replay="R3", behaviour_weight="truncate") if kind == "replay" else AlgoConfig()
    trainer = Trainer(TrainerConfig(model=model, algo=algo, optim=OptimConfig(lr=1e-3, minibatches=2)), policy)
    if phase == "save":
        trainer.update(fixed_batch())
        checkpoint.save(ckpt, trainer, {"step": 1})
        metrics = trainer.update(second_batch())
    elif phase == "resume":
        assert checkpoint.load(ckpt, trainer) == {"step": 1}
        metrics = trainer.update(second_batch())
    else:
        batches = {"replay": replayed_batch, "pairs": lambda: fixed_batch().select([0, 1, 2, 3])}
        metrics = trainer.update(batches.get(kind, fixed_batch)())
    state = full_state_dict(trainer.scorer)
    engine_state = asyncio.run(synced_engine_state(trainer)) if kind == "bf16" else None
    replayed = None
    if kind == "replay":  # lp after the update, the record replayed and not (every rank: FSDP's collectives)
        b = replayed_batch()
        with torch.no_grad():
            replayed = [
                trainer.scorer(b.input_ids, b.attention_mask, b.sampling, routing=routing)[0]
                for routing in (position_routing(b.routed_experts), None)
            ]
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(
            {
                "metrics": metrics,
                "state": {k: v.detach().clone() for k, v in state.items()},
                "world": dist.get_world_size() if dist.is_initialized() else 0,
                "compute": seen,
                "checkpointing": [layer.gradient_checkpointing for layer in decoder_layers(policy)],
                "compiled": [layer.mlp._compiled_call_impl is not None for layer in decoder_layers(policy)],
                "shares_module": LocalLearner(trainer, in_thread=False).shared_module is not None,
                "engine": engine_state,
                "replayed": replayed,
            },
            out,
        )
    if dist.is_initialized():
        dist.destroy_process_group()


def load_cases(out: str, cases: str) -> None:
    """`Trainer.build` under torch.distributed (the meta-device, shard-by-shard loader) for each case of the JSON
    list `cases` ({name, path, lora: null | {..LoraSettings}, dtype, kl_coef, checkpoint: null | folder}): what
    it loaded (dtypes, this rank's share, ties, rotary buffers, logprobs, the gathered weights), one update, the
    bytes of a weight sync, and for a case with `checkpoint`: save, export to Hugging Face in bfloat16, and a
    fresh build resumed from it."""
    dist.init_process_group("gloo")
    rank, records = dist.get_rank(), []
    for case in json.loads(Path(cases).read_text()):
        lora = LoraSettings(**case["lora"]) if case["lora"] else None
        model = ModelConfig(
            path=case["path"],
            lora=lora,
            dtype=case["dtype"],
            activation_checkpointing=case.get("activation_checkpointing", False),
            cpu_offload=case.get("cpu_offload", False),
        )
        cfg = TrainerConfig(
            model=model, algo=AlgoConfig(kl_coef=case["kl_coef"]), optim=OptimConfig(lr=1e-2, minibatches=1)
        )
        trainer = Trainer.build(cfg)
        params = dict(trainer.policy.named_parameters())
        lm = causal_lm(trainer.policy)
        local = sum(p.to_local().numel() for p in params.values())
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, local / sum(p.numel() for p in params.values()))
        b = fixed_batch()
        with torch.no_grad():
            lp = trainer.scorer(b.input_ids, b.attention_mask, b.sampling)[0]
        record = {
            "name": case["name"],
            "shares": shares,
            "lp": lp,
            "base_dtypes": {p.dtype for n, p in params.items() if "lora_" not in n},
            "adapter_dtypes": {p.dtype for n, p in params.items() if "lora_" in n},
            "reference_dtypes": None
            if trainer.reference is None
            else {p.dtype for p in trainer.reference.parameters()},
            "tied": lm.get_output_embeddings().weight is lm.get_input_embeddings().weight,
            "inv_freq": lm.model.rotary_emb.inv_freq.clone(),
            "loaded": full_state_dict(trainer.scorer),
        }
        record["metrics"] = trainer.update(fixed_batch())
        record["after"] = full_state_dict(trainer.scorer)
        with torch.no_grad():
            record["lp_after"] = trainer.scorer(b.input_ids, b.attention_mask, b.sampling)[0]
        record["sync_bytes"] = {}
        for dtype in (None, torch.bfloat16):
            state = trainer.engine_weights(dtype)
            if rank == 0:
                record["sync_bytes"][str(dtype)] = state_bytes(state)
                record["sync_keys"] = sorted(state)
                record["sync_dtypes"] = record.get("sync_dtypes", set()) | {v.dtype for v in state.values()}
        if case.get("checkpoint"):
            ckpt = case["checkpoint"]
            checkpoint.save(f"{ckpt}/step1", trainer, {"step": 1})
            checkpoint.export_hf(trainer.scorer, f"{ckpt}/hf", dtype="bfloat16")
            resumed = Trainer.build(cfg)
            assert checkpoint.load(f"{ckpt}/step1", resumed) == {"step": 1}
            record["resumed"] = full_state_dict(resumed.scorer)
            record["next"] = [t.update(second_batch())["loss"] for t in (trainer, resumed)]
        records.append(record)
    if rank == 0:
        torch.save(records, out)
    dist.destroy_process_group()


class ParameterCasts(TorchDispatchMode):
    """Counts the casts to bfloat16 of the sharded float32 parameters (FSDP2 casts each once a gather)."""

    def __init__(self, root: torch.nn.Module) -> None:
        super().__init__()
        self.storages = {p.to_local().untyped_storage().data_ptr() for p in root.parameters()}
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            self.casts += args[0].untyped_storage().data_ptr() in self.storages
        return func(*args, **kwargs)


def gathers(out: str) -> None:
    """One update of 2 optimizer steps over a group of one in bf16, as whole minibatches and as micro-batches of
    one row: how many times its weights were cast to bf16 for a gather, and how many weights there are."""
    model = ModelConfig(dtype="bfloat16")
    init_distributed(model)
    casts = {}
    for name, tokens in (("minibatches", 0), ("micro_batches", 64)):
        torch.manual_seed(0)
        policy = tiny_model("qwen3_moe", seed=0)
        optim = OptimConfig(lr=1e-3, minibatches=2, microbatch_tokens=tokens)
        trainer = Trainer(TrainerConfig(model=model, optim=optim), policy)
        with ParameterCasts(trainer.scorer) as count:
            trainer.update(fixed_batch())
        casts[name] = count.casts
    # LoRA: after an update the layers hold their gathered bf16 copies; the adapter an engine gets is still the
    # float32 master weights
    lora = ModelConfig(dtype="bfloat16", lora=LoraSettings(rank=4))
    trainer = Trainer(
        TrainerConfig(model=lora, optim=OptimConfig(lr=1e-2)), with_lora(tiny_model("qwen3_moe"), lora.lora)
    )
    trainer.update(fixed_batch())
    adapter = trainer.engine_weights(torch.float32)
    trained = [v for k, v in adapter.items() if "lora_B" in k]
    synced = {"float32": {str(v.dtype) for v in adapter.values()} == {"torch.float32"}}
    synced["bf16_values_only"] = all(torch.equal(v, v.bfloat16().float()) for v in trained)
    synced["trained"] = any(bool(v.abs().sum() > 0) for v in trained)
    # full fine-tuning's KL reference: no backward drops what its forwards gathered; the trainer does
    cfg = TrainerConfig(model=model, algo=AlgoConfig(kl_coef=0.1), optim=OptimConfig(lr=1e-3))
    trainer = Trainer(cfg, tiny_model("qwen3_moe", seed=0), tiny_model("qwen3_moe", seed=0))
    trainer.update(fixed_batch())
    reference_sharded = all(isinstance(p, DTensor) for p in trainer.reference.parameters())
    torch.save(
        {
            "casts": casts,
            "parameters": len(list(policy.parameters())),
            "lora_sync": synced,
            "reference_sharded": reference_sharded,
        },
        out,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[2:3] == ["load"]:
        load_cases(sys.argv[1], sys.argv[3])
    elif sys.argv[2:3] == ["gathers"]:
        gathers(sys.argv[1])
    else:
        main(*sys.argv[1:])
