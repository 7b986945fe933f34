"""Loading a big model for training: the memory each rank needs until its sharded model is ready.

Saves a random-init Qwen3-MoE (harness.py's "1b" shapes, 1.56B parameters) as bfloat16 safetensors, then
builds the trainer on N gloo ranks (torchrun, one fresh set of processes per measurement, one at a time), each
way in the same run:

- `from_pretrained`: what `agentrl train` did before: every rank loads the whole model in float32, then FSDP2
  shards it (`Trainer(cfg, load_policy(cfg.model))`);
- `honest`: `Trainer.build` under torch.distributed: the model on the meta device, sharded, then each rank reads
  only its own shards from the files (agentrl.models.loading);

for full fine-tuning (float32 master weights) and LoRA (the recipe's: rank 32 on the attention projections;
the base stays bfloat16). Each rank samples its own anonymous RSS (RssAnon in /proc/self/status) every
millisecond in a background thread and reports the peak until its model is ready (sharded, loaded, optimizer
built), beside the floor: the parameters' bytes over the world size (float32 for full fine-tuning, bfloat16 for
LoRA's base). Anonymous memory is what a rank owns; the files' pages read through mmap are page cache (RssFile)
and left out. Also: seconds until the model is ready and until the first optimizer step ends (one update on 2
sequences of 64 tokens), and the bytes one weight sync moves (`Trainer.engine_weights`, bfloat16 and as trained).

    python benchmarks/load_bench.py                    # ~5 min on 2 cores; prints one JSON object
    python benchmarks/load_bench.py --size small       # a 30M-parameter model: the same code in ~1 min
    python benchmarks/load_bench.py --full-step        # also the first full fine-tuning step (16 B/param in all)

A full fine-tuning step holds weights, gradients and AdamW's two moments in float32 (16 bytes per parameter over
the ranks: 25 GB for the 1b model), more than the 24 GiB dev VM: it runs only with --full-step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # Qwen3-MoE shapes
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        vocab_size=32_000,
    ),
    "1b": harness.QWEN3_MOE_1B,
}
LORA = {"rank": 32, "alpha": 64.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def gib(kib: int) -> float:
    return kib / 2**20


def save_model(folder: Path, size: str) -> None:
    """A random-init Qwen3-MoE of `size`, saved as bfloat16 safetensors (run in a child process)."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.models.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", **SIZES[size]), dtype=torch.bfloat16)
    model.save_pretrained(folder)


def rank_main(out: Path, folder: Path, loader: str, mode: str, dtype: str, step: bool) -> None:
    """One rank of one measurement (under torchrun): load, report memory and times, optionally step and sync."""
    sys.setswitchinterval(0.0005)  # the sampler thread gets the GIL between the loader's Python steps
    import torch
    import torch.distributed as dist

    from agentrl.models.lora import LoraSettings
    from agentrl.train.config import ModelConfig, OptimConfig, TrainerConfig
    from agentrl.train.policy import load_policy, state_bytes
    from agentrl.train.trainer import Trainer

    # the kernel keeps the peak of VmRSS alone (VmHWM), which counts the file pages read through mmap: RssAnon's is
    # sampled every millisecond
    with harness.PeakSampler(lambda: harness.proc_kib("RssAnon"), every=0.001) as sampler:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        baseline = harness.proc_kib("RssAnon")  # torch, transformers and agentrl imported, the process group joined
        model = ModelConfig(path=str(folder), dtype=dtype, lora=LoraSettings(**LORA) if mode == "lora" else None)
        cfg = TrainerConfig(model=model, optim=OptimConfig(lr=1e-5, minibatches=1))
        sampler.reset()
        t0 = time.perf_counter()
        trainer = Trainer.build(cfg) if loader == "honest" else Trainer(cfg, load_policy(cfg.model))
        dist.barrier()
        result = {
            "rank": rank,
            "baseline_anon_gib": gib(baseline),
            "ready_s": time.perf_counter() - t0,
            "ready_peak_anon_gib": gib(sampler.sample()),
            "ready_anon_gib": gib(harness.proc_kib("RssAnon")),
            "ready_vm_hwm_gib": gib(harness.proc_kib("VmHWM")),
        }
        result["params"] = sum(p.numel() for p in trainer.policy.parameters())
        result["trainable"] = sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad)
        result["held_bytes"] = sum(p.to_local().numel() * p.element_size() for p in trainer.policy.parameters())
        if step:
            trainer.update(harness.synthetic_batch(2 * world, 64, trainer.policy.config.vocab_size, "cpu"))
            dist.barrier()
            result["first_step_s"] = time.perf_counter() - t0
            result["step_peak_anon_gib"] = gib(sampler.sample())
        if loader == "honest":
            for name, sync_dtype in (("bfloat16", torch.bfloat16), ("as_trained", None)):
                s0 = time.perf_counter()
                state = trainer.engine_weights(sync_dtype)
                if rank == 0:
                    result[f"sync_{name}"] = {
                        "bytes": state_bytes(state),
                        "tensors": len(state),
                        "s": time.perf_counter() - s0,
                    }
                del state
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(folder: Path, loader: str, mode: str, world: int, dtype: str, step: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(world),
            "--standalone",
            __file__,
            "--rank-run",
            tmp,
            "--folder",
            str(folder),
            "--loader",
            loader,
            "--mode",
            mode,
            "--dtype",
            dtype,
        ] + (["--step"] if step else [])
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"{loader}/{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="1b")
    p.add_argument("--world", type=int, default=2, help="gloo ranks")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="compute dtype")
    p.add_argument("--folder", type=Path, help="where the model is saved (reused if there); default runs/load_bench/")
    p.add_argument("--full-step", action="store_true", help="also run the first full fine-tuning step")
    p.add_argument("--rank-run", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--loader", choices=("from_pretrained", "honest"), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("full", "lora"), help=argparse.SUPPRESS)
    p.add_argument("--step", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_run:
        rank_main(args.rank_run, args.folder, args.loader, args.mode, args.dtype, args.step)
        return
    folder = args.folder or ROOT / "runs" / "load_bench" / f"qwen3_moe_{args.size}_bf16"
    if not (folder / "config.json").exists():
        t0 = time.perf_counter()
        import multiprocessing

        child = multiprocessing.get_context("spawn").Process(target=save_model, args=(folder, args.size))
        child.start()
        child.join()
        if child.exitcode:
            sys.exit(f"saving the model failed ({child.exitcode})")
        print(f"saved {folder} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    import torch

    from agentrl.models.loading import checkpoint_files, stored_dtype

    n_params = json.loads((folder / "bench.json").read_text())["params"] if (folder / "bench.json").exists() else None
    if n_params is None:
        from safetensors import safe_open

        n_params = 0
        for file in checkpoint_files(folder):
            with safe_open(str(file), framework="pt") as f:
                n_params += sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())  # noqa: SIM118
        (folder / "bench.json").write_text(json.dumps({"params": n_params}))
    if args.size == "1b" and n_params < 1e9:
        sys.exit(f"the 1b model has {n_params / 1e9:.2f}B parameters, under 1e9: enlarge SIZES['1b']")
    stored = stored_dtype(checkpoint_files(folder))
    world = args.world
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    result = {
        "machine": harness.machine("torch") | {"memory_gib": round(ram)},
        "model": f"qwen3_moe {args.size}: {n_params / 1e9:.3f}B parameters, stored {str(stored).split('.')[-1]}",
        "setup": f"{world} gloo ranks (torchrun), compute {args.dtype}; peak RssAnon sampled every 1 ms per rank, "
        "from after imports and the process group to the model ready",
    }
    for mode in ("full", "lora"):
        size = 4 if mode == "full" else stored.itemsize
        row: dict = {
            "floor_gib_per_rank": n_params * size / world / 2**30,
            "floor": f"{n_params / 1e9:.3f}B x {size} B / {world}",
        }
        step = mode == "lora" or args.full_step
        for loader in ("from_pretrained", "honest"):
            ranks = measure(folder, loader, mode, world, args.dtype, step)
            peak = max(r["ready_peak_anon_gib"] for r in ranks)
            above = max(r["ready_peak_anon_gib"] - r["baseline_anon_gib"] for r in ranks)
            row[loader] = {
                "peak_anon_gib_per_rank": peak,
                "peak_above_baseline_gib": above,
                "baseline_anon_gib": max(r["baseline_anon_gib"] for r in ranks),
                "peak_vs_floor": peak / row["floor_gib_per_rank"],
                "peak_above_baseline_vs_floor": above / row["floor_gib_per_rank"],
                "ready_anon_gib": max(r["ready_anon_gib"] for r in ranks),
                "held_param_gib_per_rank": max(r["held_bytes"] for r in ranks) / 2**30,
                "ready_s": max(r["ready_s"] for r in ranks),
                "first_step_s": max(r["first_step_s"] for r in ranks) if step else None,
                "step_peak_anon_gib": max(r["step_peak_anon_gib"] for r in ranks) if step else None,
            }
            for key in ("sync_bfloat16", "sync_as_trained"):
                if key in ranks[0]:
                    row[loader][key] = ranks[0][key]
            print(f"{mode} {loader}: {json.dumps(row[loader])}", file=sys.stderr)
        new, old = row["honest"], row["from_pretrained"]
        row["honest_vs_from_pretrained"] = new["peak_anon_gib_per_rank"] / old["peak_anon_gib_per_rank"]
        above = new["peak_above_baseline_gib"] / old["peak_above_baseline_gib"]
        row["honest_vs_from_pretrained_above_baseline"] = above
        row["goal"] = "<= 0.6" if mode == "full" else "<= 0.35"
        result[mode] = row
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
