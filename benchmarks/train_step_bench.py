"""Tokens per second of one GSPO-token update, next to the same model's plain forward+backward.

A random-init Qwen3-MoE, a synthetic batch (prompt, generated turns and an observation per
sequence), `Trainer.update` with M minibatches (chunked logprobs, loss, router aux loss,
the extra no-grad pass for the expert flip rate) against `model(ids, labels=ids).loss`
forward and backward on the same minibatches, timed in the same run:

    python benchmarks/train_step_bench.py                          # CPU, a small MoE (14M parameters, 5M active)
    python benchmarks/train_step_bench.py --device cuda --size 1b  # GPU, bf16, a 1B+ MoE, with MFU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from agentrl.engine.base import SamplingParams
from agentrl.models.tiny import tiny_config
from agentrl.train.batch import TrainBatch
from agentrl.train.config import ModelConfig, OptimConfig, TrainerConfig
from agentrl.train.trainer import Trainer

SIZES = {  # Qwen3-MoE shapes
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, vocab_size=2054),
    "1b": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
               num_experts=32, num_experts_per_tok=4, moe_intermediate_size=768, vocab_size=151_936),
}  # fmt: skip
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, per GPU


def synthetic_batch(B: int, L: int, vocab: int, device: str) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[:, : L // 4] = 0  # prompt
    mask[:, L // 2 : L // 2 + L // 16] = 0  # an observation
    return TrainBatch(
        input_ids=torch.randint(1, vocab, (B, L), generator=g).to(device),
        attention_mask=torch.ones_like(mask).to(device), loss_mask=mask.to(device),
        old_logprobs=(-torch.rand(B, L, generator=g) * 5 * mask).to(device),
        advantages=(torch.randn(B, L, generator=g) * mask).to(device), sampling=SamplingParams(),
    )  # fmt: skip


def active_params(cfg) -> float:
    """Parameters each token uses: attention, the router, top-k experts, embeddings and head."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    attn = h * cfg.head_dim * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    experts = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    return layers * (attn + experts + h * cfg.num_experts) + 2 * cfg.vocab_size * h


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("qwen3_moe", **SIZES[args.size])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(args.device)
    bf16 = args.device.startswith("cuda")
    if bf16:
        model = model.to(torch.bfloat16)
    trainer = Trainer(TrainerConfig(model=ModelConfig(dtype="bfloat16" if bf16 else "float32"),
                                    optim=OptimConfig(lr=1e-6, minibatches=args.minibatches)), model)  # fmt: skip
    batch = synthetic_batch(args.batch, args.length, cfg.vocab_size, args.device)
    tokens = int(batch.attention_mask.sum())

    def sync() -> None:
        if bf16:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        fn()  # warm-up
        sync()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        sync()
        return (time.perf_counter() - t0) / args.repeats

    def plain() -> None:
        for rows in torch.arange(args.batch).chunk(args.minibatches):
            ids = batch.input_ids[rows]
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

    update_s = timed(lambda: trainer.update(batch))
    plain_s = timed(plain)
    n_params = sum(p.numel() for p in model.parameters())
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
                   + (f", {torch.cuda.get_device_name()}" if bf16 else ""),
        "model": f"qwen3_moe {args.size}: {n_params / 1e6:.1f}M parameters, {active_params(cfg) / 1e6:.1f}M active",
        "batch": f"{args.batch} x {args.length} tokens, {args.minibatches} minibatches",
        "gspo_token_update": {"s": update_s, "tokens_per_s": tokens / update_s},
        "plain_forward_backward": {"s": plain_s, "tokens_per_s": tokens / plain_s},
        "update_vs_plain": plain_s / update_s,
    }  # fmt: skip
    if bf16:
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in torch.cuda.get_device_name()), None)
        for key, s in (("gspo_token_update", update_s), ("plain_forward_backward", plain_s)):
            flops = 6 * active_params(cfg) * tokens / s  # fwd + bwd, attention scores left out (PaLM's estimate)
            result[key]["mfu"] = flops / peak if peak else None
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
