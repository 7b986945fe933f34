"""Every CUDA path of agentrl in one command, written as one JSON report (`bash scripts/gpu_check.sh`).

    bash scripts/gpu_check.sh [--out gpu_check.json]      # on a GPU machine: every check on CUDA
    bash scripts/gpu_check.sh --cpu-dry-run               # the same code paths on the CPU, shrunk (CI runs it)
    bash scripts/gpu_check.sh --only hf_engine logprob_parity
    bash scripts/gpu_check.sh --budget 560 --workdir /tmp/gc --out $OUT/gc.json   # within a 10-minute device call

The checks, in order, each in a process of its own (a crash, a hang past its time limit or a CUDA error in
one leaves the others running; the exit status is 1 if any failed):

1. fsdp_bf16: a few `Trainer.update` steps of a small random-init Qwen3-MoE, bf16 mixed precision by FSDP2
   over a process group of one (as `agentrl train` shards a single GPU): finite losses, weights changed,
   float32 master weights, decoder layers computing in bf16.
2. hf_engine: the `hf` engine loading a random-init Qwen3-MoE folder (benchmarks/harness.py's "1b" shapes, which
   `train_step_bench.py --size 1b` times) onto CUDA, float32 (its default) and bfloat16, and bfloat16 with its
   decode steps replayed as CUDA graphs, decoding a batch of sampled requests: tokens per second, every logprob
   finite, and the graphs' mean logprob within 0.05 of the eager bfloat16 engine's (same seeds and weights).
3. logprob_parity: the engine's logprob of each token it sampled against the learner's score of the same
   tokens (`Trainer.scorer`, the forward pass the update uses), max and mean |difference|: float32 engine
   against float32 learner, and against the bf16 FSDP2 learner each engine dtype (float32, `agentrl
   train`'s default; bfloat16; bfloat16_weights).
4. agentrl_train: `agentrl train --env tool_use` for 3 iterations on that "1b" model, bf16, the engine's copy
   on the learner's GPU, its sandboxes bubblewrap's and its env workers processes of the run (no Docker daemon,
   no Ray runtime: what GPU hosts lack): rollout tokens/s, update, sync and peak GPU memory per iteration. It
   first probes bubblewrap (its namespaces, and a cgroup) and records what it found; where bubblewrap cannot run
   the check is skipped, with the reason.
5. default_recipe: the default recipe, `agentrl train --env code_sandbox` on the default policy, on CUDA, the same
   way daemonless: its held-out success must gain 20 points over its 10 iterations, as it does on the CPU.
6. train_step_bench: `benchmarks/train_step_bench.py --device cuda --size 1b`, its JSON (with MFU) included, and
   again at 32,768 tokens an optimizer step (8,192-token micro-batches), profiled, eager and with model.compile.
7. decode_bench: `benchmarks/decode_bench.py --device cuda`: the hf engine's tokens/s at 16 and 64 concurrent
   requests of the "1b" model in bf16, one decode step a window, 8, and 8 as CUDA graphs, beside the
   memory-bandwidth roofline, with the GPU's busy share.
   The 10 minutes a device call may take do not hold all seven: `--only` splits them over calls.

--cpu-dry-run runs the same steps on the CPU (gloo instead of nccl), with tiny models instead of the 1B one
and shrunk benchmarks, so that every line of this script runs without a GPU. A check whose Python packages
are missing is skipped, with the missing package named. Nothing is estimated: every figure is measured.

Report: {"mode", "ok", "complete", "counts", "seconds", "started", "machine", "checks": [{"name", "status" (ok |
failed | skipped), "seconds", "figures", "error" (failed: the error text), "reason" (skipped: why)}]}, written
after each check ("complete": false until the last). `--budget S` bounds the whole command: each check gets at most
what is left, and one with under 30 s left is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "train_step_bench.py"
DECODE_BENCH = ROOT / "benchmarks" / "decode_bench.py"
CHECKS = (
    "fsdp_bf16",
    "hf_engine",
    "logprob_parity",
    "agentrl_train",
    "default_recipe",
    "train_step_bench",
    "decode_bench",
)
TIMEOUT_S = {  # per check, GPU run / dry run
    "fsdp_bf16": (600, 300),
    "hf_engine": (900, 300),
    "logprob_parity": (900, 300),
    "agentrl_train": (1800, 300),
    "default_recipe": (1800, 300),
    "train_step_bench": (1800, 300),
    "decode_bench": (1200, 300),
}
MIN_CHECK_S = 30
"""with --budget, a check is started only with at least this many seconds left"""
FP32_PARITY_MAX = 5e-3
"""float32 engine against float32 learner: the same math in other kernels and batch shapes (~1e-6 measured on
CPU, tests/engine/test_hf.py); beyond this the two do not compute the same distribution"""
BF16_PARITY_MEAN_MAX = 0.1
"""a sanity bound on the mean |difference| with bf16 on either side, not a target: above it something other
than rounding differs"""


OPTIONAL_PACKAGES = {"ray", "docker", "gymnasium"}
"""agentrl's dependencies that a GPU machine may lack (no internet to install them): a check that needs one is
skipped. Any other missing package (torch, transformers, ...) fails the check: those are what it checks."""


class Skip(Exception):
    """The check cannot run here (a missing package, no Docker engine): skipped, with this reason."""


class CheckFailed(Exception):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass
class Ctx:
    dry: bool
    workdir: Path
    time_limit: float | None = None
    """seconds each check may run (--time-limit), instead of its own limit in TIMEOUT_S"""

    def limit(self, name: str) -> float:
        return self.time_limit or TIMEOUT_S[name][self.dry]

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def small(self) -> str:
        """The small model of fsdp_bf16: harness.SIZES' "small" Qwen3-MoE on GPU."""
        return "tiny" if self.dry else "small"

    @property
    def big(self) -> str:
        """The model of hf_engine, logprob_parity and agentrl_train: harness.SIZES' "1b" on GPU."""
        return "tiny" if self.dry else "1b"


# -- shared pieces (in a check's process) --------------------------------------------------------------


def need_cuda(ctx: Ctx) -> None:
    import torch

    if not ctx.dry and not torch.cuda.is_available():
        raise CheckFailed(
            f"torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}): no GPU to check; --cpu-dry-run runs the CPU variant"
        )


def generate(engine, requests: list[list[int]], params, *, warm_up: bool = False) -> tuple[list, float]:
    """Every request at once through `engine` (started and closed here); the generations and the seconds they
    took (`warm_up`: after the same requests once untimed, so that start-up and the choice of kernels for each
    batch shape are not timed: a 4-token warm-up left bf16's first generation 2.5x slower on an H200)."""

    async def go():
        async with engine:
            if warm_up:
                await harness.generate_all(engine, requests, params)
            t0 = time.perf_counter()
            gens = await harness.generate_all(engine, requests, params)
            return gens, time.perf_counter() - t0

    return asyncio.run(go())


def gpu_memory(figures: dict[str, Any]) -> None:
    if (peak := harness.gpu_peak_gib()) is not None:
        figures["peak_gpu_memory_gib"] = peak


def free_memory() -> None:
    """Give back what the models just dropped held (on the GPU, to the next model of the check)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def full_params(module) -> dict[str, Any]:
    """Every parameter, unsharded (a DTensor under FSDP2), float32 on the CPU."""
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
        for n, p in module.named_parameters()
    }


# -- the checks -----------------------------------------------------------------------------------------


def check_fsdp_bf16(ctx: Ctx, figures: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from agentrl.train.config import ModelConfig, OptimConfig, TrainerConfig
    from agentrl.train.policy import init_distributed, shutdown_distributed
    from agentrl.train.trainer import Trainer

    need_cuda(ctx)
    model_cfg = ModelConfig(dtype="bfloat16")
    init_distributed(model_cfg)
    try:
        expect(dist.is_initialized(), "model.dtype=bfloat16 did not start a process group")
        figures["process_group"] = f"{dist.get_backend()}, world size {dist.get_world_size()}"
        policy = harness.random_model(ctx.small)
        figures["model"] = harness.describe_model(policy.config)
        computed: set[str] = set()  # the dtype the first decoder layer computes in

        def note_dtype(_, args, kwargs) -> None:
            computed.add(str((args[0] if args else kwargs["hidden_states"]).dtype).removeprefix("torch."))

        policy.model.layers[0].register_forward_pre_hook(note_dtype, with_kwargs=True)
        trainer = Trainer(TrainerConfig(model=model_cfg, optim=OptimConfig(lr=1e-4, minibatches=2)), policy)
        figures["trainer_device"] = str(trainer.device)
        expect(trainer.device.type == ctx.device, f"the trainer took {trainer.device}, not {ctx.device}")
        B, L = (8, 128) if not ctx.dry else (4, 32)
        batch = harness.synthetic_batch(B, L, policy.config.vocab_size, str(trainer.device))
        figures["batch"] = f"{B} x {L} tokens, 2 minibatches"
        before = full_params(trainer.scorer)
        figures["master_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in trainer.scorer.parameters()})
        steps = []
        for _ in range(3):
            t0 = time.perf_counter()
            m = trainer.update(batch)
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            steps.append({"loss": m["loss"], "grad_norm": m["grad_norm"], "s": time.perf_counter() - t0})
        figures["updates"] = steps
        after = full_params(trainer.scorer)
        change = {n: float((after[n] - before[n]).abs().max()) for n in before}
        figures["max_abs_weight_change"] = max(change.values())
        figures["tensors_changed"] = f"{sum(c > 0 for c in change.values())} of {len(change)}"
        figures["compute_dtypes"] = sorted(computed)
        gpu_memory(figures)
        expect(all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps), "a non-finite loss")
        expect(figures["max_abs_weight_change"] > 0, "the weights did not change")
        expect(figures["master_dtypes"] == ["float32"], f"master weights in {figures['master_dtypes']}")
        expect(figures["compute_dtypes"] == ["bfloat16"], f"decoder layers computed in {figures['compute_dtypes']}")
    finally:
        shutdown_distributed()


def check_hf_engine(ctx: Ctx, figures: dict[str, Any]) -> None:
    from agentrl.engine import EngineConfig, EngineModel, build_engine
    from agentrl.engine.base import SamplingParams

    need_cuda(ctx)
    path = harness.model_folder(ctx.workdir, ctx.big, ctx.device)
    figures["model"] = harness.describe_model(harness.model_config(ctx.big))
    n, T = (16, 128) if not ctx.dry else (4, 16)
    params = SamplingParams(temperature=1.0, max_tokens=T)
    requests = harness.prompts(n)
    engines = figures["engines"] = {}  # by engine.dtype, "+graphs" with engine.cuda_graphs
    variants = [("auto", False), ("bfloat16", False)] + ([("bfloat16", True)] if not ctx.dry else [])
    for dtype, graphs in variants:
        name = dtype + "+graphs" * graphs
        t0 = time.perf_counter()
        cfg = EngineConfig(kind="hf", dtype=dtype, cuda_graphs=graphs)
        engine = build_engine(cfg, EngineModel(path=str(path), device=ctx.device))
        load_s = time.perf_counter() - t0
        weights = next(engine.model.parameters())
        gens, seconds = generate(engine, requests, params, warm_up=True)
        tokens = sum(len(g.token_ids) for g in gens)
        lps = [lp for g in gens for lp in g.logprobs]
        engines[name] = {
            "weights": f"{str(weights.dtype).removeprefix('torch.')} on {weights.device}",
            "decode_window": engine.decode_window,
            "graphs_captured": engine.graphs_captured,
            "load_s": load_s,
            "requests": n,
            "max_tokens": T,
            "generated_tokens": tokens,
            "generate_s": seconds,
            "tokens_per_s": tokens / seconds,
            "finish_reasons": sorted({g.finish_reason for g in gens}),
            "mean_logprob": sum(lps) / len(lps),
        }
        expect(weights.device.type == ctx.device, f"engine {name}: weights on {weights.device}")
        expect(tokens == n * T, f"engine {name}: {tokens} tokens generated, {n * T} asked")
        expect(all(math.isfinite(lp) and lp <= 0 for lp in lps), f"engine {name}: a logprob not in (-inf, 0]")
        del engine, weights
        free_memory()
    if "bfloat16+graphs" in engines:  # the same seeds and weights: a graph's step samples what the eager one does
        eager, graphs = engines["bfloat16"]["mean_logprob"], engines["bfloat16+graphs"]["mean_logprob"]
        expect(engines["bfloat16+graphs"]["graphs_captured"] > 0, "engine.cuda_graphs captured no graph")
        expect(abs(eager - graphs) < 0.05, f"mean logprob {graphs:.4f} with CUDA graphs, {eager:.4f} without")
    gpu_memory(figures)


def check_logprob_parity(ctx: Ctx, figures: dict[str, Any]) -> None:
    """Engine (own copy, a dtype each) against learner (Trainer.scorer) on the tokens the engine sampled."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.engine import EngineConfig, EngineModel, build_engine
    from agentrl.engine.base import SamplingParams
    from agentrl.train.config import ModelConfig, OptimConfig, TrainerConfig
    from agentrl.train.policy import init_distributed, shutdown_distributed
    from agentrl.train.trainer import Trainer

    need_cuda(ctx)
    figures["model"] = harness.describe_model(harness.model_config(ctx.big))
    folder = harness.model_folder(ctx.workdir, ctx.big, ctx.device)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    n, T = (16, 64) if not ctx.dry else (4, 16)
    params = SamplingParams(temperature=1.0, max_tokens=T)
    requests = harness.prompts(n)
    figures["tokens_per_pair"] = n * T
    figures["sampling"] = "temperature 1.0, no top-k / top-p"
    if torch.cuda.is_available():
        figures["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32

    def engine_tokens(dtype: str) -> list:
        """An engine of its own, loaded by the factory in `dtype` (an `engine.dtype` value) from the same folder."""
        engine = build_engine(EngineConfig(kind="hf", dtype=dtype), EngineModel(path=str(folder), device=ctx.device))
        gens = generate(engine, requests, params)[0]
        del engine
        free_memory()
        return gens

    def compare(trainer: Trainer, gens: list) -> dict[str, Any]:
        L = max(len(p) + len(g.token_ids) for p, g in zip(requests, gens, strict=True))
        ids = torch.zeros(n, L, dtype=torch.long)
        mask = torch.zeros(n, L, dtype=torch.long)
        for i, (p, g) in enumerate(zip(requests, gens, strict=True)):
            ids[i, : len(p) + len(g.token_ids)] = torch.tensor(p + g.token_ids)
            mask[i, : len(p) + len(g.token_ids)] = 1
        with torch.no_grad():
            lp = trainer.scorer(ids.to(trainer.device), mask.to(trainer.device), params)[0].float().cpu()
        learner = torch.cat(
            [lp[i, len(p) : len(p) + len(g.token_ids)] for i, (p, g) in enumerate(zip(requests, gens, strict=True))]
        )
        engine = torch.tensor([x for g in gens for x in g.logprobs])
        d = (learner - engine).abs()
        finite = torch.isfinite(d)
        kept = d[finite] if finite.any() else torch.tensor([math.nan])
        return {
            "tokens": len(d),
            "max_abs_diff": float(kept.max()),
            "mean_abs_diff": float(kept.mean()),
            "tokens_outside_learner_support": int((~finite).sum()),
            "mean_engine_logprob": float(engine.mean()),
        }

    pairs = figures["pairs"] = {}
    # float32 learner: a plain module (no process group), as `agentrl train` runs model.dtype=float32
    trainer = Trainer(TrainerConfig(model=ModelConfig(), optim=OptimConfig()), copy.deepcopy(base))
    pairs["fp32"] = {"learner": f"float32 on {trainer.device}", "engine": "float32"} | compare(
        trainer, engine_tokens("float32")
    )
    del trainer
    free_memory()
    # bf16 learner: FSDP2 mixed precision over a group of one, against each engine dtype
    bf16 = ModelConfig(dtype="bfloat16")
    init_distributed(bf16)
    try:
        trainer = Trainer(TrainerConfig(model=bf16, optim=OptimConfig()), copy.deepcopy(base))
        for name, dtype in (
            ("bf16", "bfloat16"),
            ("bf16_learner_fp32_engine", "float32"),
            ("bf16_learner_bf16_weights_engine", "bfloat16_weights"),
        ):
            pairs[name] = {"learner": f"bfloat16 FSDP2 on {trainer.device}", "engine": dtype} | compare(
                trainer, engine_tokens(dtype)
            )
        gpu_memory(figures)
    finally:
        shutdown_distributed()
    for name, pair in pairs.items():
        expect(pair["tokens_outside_learner_support"] == 0, f"{name}: a sampled token the learner scores -inf")
    expect(
        pairs["fp32"]["max_abs_diff"] <= FP32_PARITY_MAX,
        f"fp32: max |engine - learner| {pairs['fp32']['max_abs_diff']:.3g} > {FP32_PARITY_MAX}",
    )
    for name in ("bf16", "bf16_learner_fp32_engine", "bf16_learner_bf16_weights_engine"):
        mean = pairs[name]["mean_abs_diff"]
        expect(mean <= BF16_PARITY_MEAN_MAX, f"{name}: mean |engine - learner| {mean:.3g} > {BF16_PARITY_MEAN_MAX}")


def probe_sandbox(figures: dict[str, Any]) -> str:
    """What `agentrl train` needs on a GPU host without Docker or Ray: its packages (Skip without one), and a sandbox
    backend: bubblewrap, whose probe (its namespaces, a cgroup) goes into `figures` ("bwrap"); where it cannot run,
    `local` (no isolation: the issue's fallback for a host that refuses the namespaces), said in "sandbox_backend"."""
    import importlib

    for package in sorted(OPTIONAL_PACKAGES):
        try:
            importlib.import_module(package)
        except ModuleNotFoundError:
            raise Skip(f"`agentrl train` needs the package {package}, not installed here") from None
    from agentrl.sandbox import SandboxConfig

    sandbox = SandboxConfig(backend="bwrap")
    why = sandbox.unavailable()
    figures["bwrap"] = {"unavailable": why, "host": None if why else sandbox.describe()}
    figures["sandbox_backend"] = "bwrap" if why is None else "local"
    return figures["sandbox_backend"]


def train_run(ctx: Ctx, figures: dict[str, Any], name: str, args: list[str], settings: list[str]) -> tuple[list, list]:
    """`agentrl train ARGS` with `settings` into the run folder `name` of the workdir, within the check's limit and
    daemonless (the backend `probe_sandbox` chose, env workers in processes of the run: no Docker engine, no Ray):
    its command, wall, peak GPU memory (every process's, by nvidia-smi) and per-iteration figures into `figures`, and
    its metrics.jsonl and eval.jsonl rows."""
    run = ctx.workdir / name
    shutil.rmtree(run, ignore_errors=True)
    daemonless = [f"sandbox.backend={figures['sandbox_backend']}", "rollout.env_workers=local"]
    args = ["train", *args, *harness.sets([*daemonless, f"out={run}", *settings])]
    figures["command"] = " ".join(["agentrl", *args])
    log = ctx.workdir / f"{name}.log"
    # every process's GPU memory: the run's engine and learner are outside this process's allocator
    sampler = harness.PeakSampler(harness.gpu_used_mib, every=1.0)  # no nvidia-smi (the dry run): no figure
    try:
        with sampler:
            figures["wall_s"] = harness.agentrl(
                *args, log=log, cwd=ctx.workdir, env=child_env(ctx), timeout=max(ctx.limit(name) - 60, 1)
            )
    except subprocess.CalledProcessError as e:
        raise CheckFailed(f"agentrl train exited {e.returncode}:\n{log.read_text(errors='replace')[-6000:]}") from None
    finally:
        if sampler.peak is not None:
            figures["gpu_memory_used_peak_mib"] = sampler.peak
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "grad_norm", "mismatch_abs_logprob_diff", "entropy")
    figures["iterations"] = [
        {"iteration": m["iteration"], "policy_version": m["policy_version"]}
        | {k: m.get(f"train/{k}") for k in keys}
        | {
            "rollout_tokens_per_s": m["rollout/tokens_per_s"],
            "generated_tokens": m["rollout/generated_tokens"],
            "rollout_s": m["time/rollout_s"],
            "update_s": m["time/update_s"],
            "sync_s": m["time/sync_s"],
        }
        for m in rows
    ]
    evals = run / "eval.jsonl"
    held_out = [json.loads(line) for line in evals.read_text().splitlines()] if evals.exists() else []
    if held_out:
        figures["held_out"] = held_out
    expect(all(math.isfinite(m["train/loss"]) for m in rows), "a non-finite loss")
    return rows, held_out


def check_agentrl_train(ctx: Ctx, figures: dict[str, Any]) -> None:
    """3 iterations of `agentrl train --env tool_use` (2 in the dry run), bf16, on the check's model: what an
    iteration of the "1b" shape costs (rollout tokens/s, update, sync, peak GPU memory)."""
    probe_sandbox(figures)
    need_cuda(ctx)
    path = harness.model_folder(ctx.workdir, ctx.big, ctx.device)
    figures["model"] = harness.describe_model(harness.model_config(ctx.big))
    G, groups, T, tasks, iterations = (4, 2, 64, 4, 3) if not ctx.dry else (2, 2, 16, 2, 2)
    settings = [
        f"iterations={iterations}",
        f"model.path={path}",
        "model.dtype=bfloat16",
        f"rollout.group_size={G}",
        f"rollout.groups_per_iteration={groups}",
        "rollout.num_workers=1",
        "rollout.sandboxes_per_worker=2",
        f"rollout.sampling.max_tokens={T}",
        f"eval.tasks={tasks}",
        "eval.every=0",
        "eval.sandboxes_per_worker=2",
        f"eval.max_tokens={T}",
        "log.tensorboard=false",
        'log.wandb="off"',
        # one checkpoint, at the end: the 1B model's holds ~18 GB (fp32 weights and AdamW's two moments)
        "checkpoint.every=0",
        "checkpoint.keep=1",
        "checkpoint.export_final=false",
    ]
    rows, _ = train_run(ctx, figures, "agentrl_train", ["--env", "tool_use"], settings)
    expect(
        [m["iteration"] for m in rows] == list(range(iterations)),
        f"iterations logged: {[m['iteration'] for m in rows]}",
    )
    expect(rows[-1]["policy_version"] == iterations, f"policy version {rows[-1]['policy_version']} after {iterations}")


DEFAULT_RECIPE_GAIN_PP = 20
"""the default recipe's held-out gain on a GPU must reach what the CPU's runs reach (27-40.5 points in BENCHMARKS.md;
the goal there is 20)"""


def check_default_recipe(ctx: Ctx, figures: dict[str, Any]) -> None:
    """The default recipe, `agentrl train --env code_sandbox` on the default policy, on CUDA for its 10 iterations:
    held-out success before and after, which must gain DEFAULT_RECIPE_GAIN_PP points as on the CPU. The dry run: one
    iteration of one small group, on the tiny model, 2 held-out tasks (its path, not its learning)."""
    probe_sandbox(figures)
    need_cuda(ctx)
    settings = ['log.wandb="off"']
    if ctx.dry:
        settings += [
            f"model.path={harness.model_folder(ctx.workdir, ctx.big, ctx.device)}",
            "iterations=1",
            "rollout.group_size=2",
            "rollout.groups_per_iteration=1",
            "rollout.num_workers=1",
            "rollout.sandboxes_per_worker=2",
            "rollout.sampling.max_tokens=16",
            "eval.tasks=2",
            "eval.sandboxes_per_worker=2",
            "eval.max_tokens=16",
            "checkpoint.export_final=false",
        ]
    rows, held_out = train_run(ctx, figures, "default_recipe", ["--env", "code_sandbox"], settings)
    expect(len(held_out) >= 2, f"{len(held_out)} held-out evaluations: one before the first iteration and one after")
    summary = figures["summary"] = harness.run_summary(held_out, rows, figures["wall_s"])
    if not ctx.dry:
        expect(
            summary["gain_pp"] >= DEFAULT_RECIPE_GAIN_PP,
            f"held-out gain {summary['gain_pp']} points < {DEFAULT_RECIPE_GAIN_PP}",
        )


def check_train_step_bench(ctx: Ctx, figures: dict[str, Any]) -> None:
    """Three runs: the earlier reports' step (16 x 512 tokens in 4 minibatches: 2,048 tokens a step), for continuity,
    and a step of 32,768 tokens (2 of them, 8,192-token micro-batches), the size an RL update steps at, eager and
    with model.compile (last: its cold compile is the run most likely to meet the deadline)."""
    need_cuda(ctx)
    if ctx.dry:
        tiny = ["--dtype", "bfloat16", "--size", "tiny", "--length", "64", "--rounds", "1", "--repeats", "1"]
        runs = {
            "result": [*tiny, "--batch", "4", "--minibatches", "2"],
            "big_step": [*tiny, "--step-tokens", "256", "--microbatch-tokens", "128", "--minibatches", "2"],
        }
    else:
        big = ["--step-tokens", "32768", "--microbatch-tokens", "8192", "--minibatches", "2", "--rounds", "2"]
        runs = {
            "result": ["--device", "cuda", "--size", "1b"],
            "big_step": ["--device", "cuda", "--size", "1b", *big, "--repeats", "1", "--profile", "15"],
        }
    runs["compiled"] = [*runs["big_step"], "--compile"]
    deadline = time.monotonic() + ctx.limit("train_step_bench") - 30
    for key, args in runs.items():
        figures[f"{key}_command" if key != "result" else "command"] = " ".join(
            ["benchmarks/train_step_bench.py", *args]
        )
        r = subprocess.run(
            [sys.executable, str(BENCH), *args],
            capture_output=True,
            text=True,
            env=child_env(ctx),
            timeout=max(deadline - time.monotonic(), 1),
        )
        missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", r.stderr) if r.returncode else None
        if missing and missing[1].split(".")[0] in OPTIONAL_PACKAGES:
            raise Skip(f"train_step_bench needs the package {missing[1]}, not installed here")
        expect(r.returncode == 0, f"train_step_bench exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        result = figures[key] = json.loads(r.stdout)
        for path in ("gspo_token_update", "plain_forward_backward"):
            expect(math.isfinite(result[path]["tokens_per_s_per_device"]), f"{key} {path}: no throughput")
            if not ctx.dry:
                expect("mfu" in result[path], f"{key} {path}: no MFU on CUDA")


def check_decode_bench(ctx: Ctx, figures: dict[str, Any]) -> None:
    need_cuda(ctx)
    args = ["--device", "cuda"] if not ctx.dry else []  # the dry run: the tiny model, 4 requests x 16 tokens
    figures["command"] = " ".join(["benchmarks/decode_bench.py", *args])
    r = subprocess.run(
        [sys.executable, str(DECODE_BENCH), *args],
        capture_output=True,
        text=True,
        env=child_env(ctx),
        timeout=max(ctx.limit("decode_bench") - 30, 1),
    )
    expect(r.returncode == 0, f"decode_bench exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    result = figures["result"] = json.loads(r.stdout)
    expect(bool(result["runs"]), "decode_bench measured nothing")
    for run in result["runs"]:
        expect(run["tokens_per_s"] > 0, f"decode_bench: no throughput in {run}")


CHECK_FUNCTIONS = {
    "fsdp_bf16": check_fsdp_bf16,
    "hf_engine": check_hf_engine,
    "logprob_parity": check_logprob_parity,
    "agentrl_train": check_agentrl_train,
    "default_recipe": check_default_recipe,
    "train_step_bench": check_train_step_bench,
    "decode_bench": check_decode_bench,
}


# -- the check's process --------------------------------------------------------------------------------


def child_env(ctx: Ctx) -> dict[str, str]:
    """The environment of a check's process and of what it starts: harness.child_env's; the dry run sees no GPU, and
    compiles in its own process (inductor's pool of compile workers only costs its start on a small CPU)."""
    dry = {"CUDA_VISIBLE_DEVICES": "", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    return harness.child_env(**(dry if ctx.dry else {}))


def run_check(name: str, ctx: Ctx, result: Path) -> None:
    """In the check's own process: run it, write {status, figures, error, reason} to `result`."""
    figures: dict[str, Any] = {}
    status, error, reason = "ok", None, None
    try:
        CHECK_FUNCTIONS[name](ctx, figures)
    except Skip as e:
        status, reason = "skipped", str(e)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL_PACKAGES:
            ours = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).is_relative_to(ROOT)]
            at = f" (imported at {Path(ours[-1].filename).relative_to(ROOT)}:{ours[-1].lineno})" if ours else ""
            status, reason = "skipped", f"needs the package {e.name}, not installed here{at}"
        else:
            status, error = "failed", traceback.format_exc()
    except Exception as e:
        status, error = "failed", str(e) if isinstance(e, CheckFailed) else traceback.format_exc()
    result.write_text(json.dumps({"status": status, "figures": finite(figures), "error": error, "reason": reason}))


# -- the driver -----------------------------------------------------------------------------------------


def finite(x: Any) -> Any:
    """JSON without NaN / Infinity: a non-finite float becomes its string ("nan", "inf", "-inf")."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


def drive(name: str, ctx: Ctx) -> dict[str, Any]:
    """Run one check in its own process, within its time limit: its entry of the report."""
    result = ctx.workdir / f"{name}.result.json"
    result.unlink(missing_ok=True)
    logfile = ctx.workdir / f"{name}.log"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        name,
        "--result",
        str(result),
        "--workdir",
        str(ctx.workdir),
        *(["--cpu-dry-run"] if ctx.dry else []),
        *(["--time-limit", str(ctx.time_limit)] if ctx.time_limit else []),
    ]
    timeout = ctx.limit(name)
    t0 = time.perf_counter()
    with logfile.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(ctx), start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the check and whatever it started
            proc.wait()
            rc = None
    seconds = time.perf_counter() - t0
    entry: dict[str, Any] = {
        "name": name,
        "status": "failed",
        "seconds": seconds,
        "figures": {},
        "error": None,
        "reason": None,
    }
    if result.exists():
        entry |= json.loads(result.read_text())
    tail = logfile.read_text(errors="replace")[-4000:]
    if rc is None:
        entry["status"] = "failed"
        entry["error"] = f"ran past its time limit of {timeout} s (killed); its output ended:\n{tail}"
    elif not result.exists():
        entry["error"] = f"its process exited {rc} without a result; its output ended:\n{tail}"
    log(
        f"[{entry['status']}] {name} ({seconds:.1f} s)"
        + (f": {entry['reason']}" if entry["reason"] else "")
        + (f": {entry['error'].strip().splitlines()[-1]}" if entry["error"] else "")
    )
    return entry


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON report (default %(default)s)")
    p.add_argument("--cpu-dry-run", action="store_true", help="the same steps on the CPU, shrunk (no GPU needed)")
    p.add_argument("--only", nargs="+", choices=CHECKS, help="run only these checks")
    p.add_argument(
        "--workdir",
        type=Path,
        help="keep models, run folders and each check's log here (default: a temporary folder, removed at the end)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        help="seconds each check may run (default: its own, 600 to 1800 s "
        "on a GPU): for a machine lent for a few minutes",
    )
    p.add_argument(
        "--budget",
        type=float,
        help="seconds the whole command may run: each check gets at most what is left, and one left under "
        f"{MIN_CHECK_S} s is skipped, so that the report is written before a lent machine's call ends",
    )
    p.add_argument("--child", choices=CHECKS, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        run_check(args.child, Ctx(args.cpu_dry_run, args.workdir, args.time_limit), args.result)
        return 0

    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="agentrl-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args.cpu_dry_run, workdir.resolve(), args.time_limit)
    t0 = time.perf_counter()
    mode = "cpu-dry-run" if args.cpu_dry_run else "gpu"
    machine = harness.machine("torch", "transformers")
    checks: list[dict[str, Any]] = []

    def report(complete: bool) -> dict[str, Any]:
        """The report so far, written out: after each check too, so that a call killed past its limit keeps what ran."""
        counts = {s: sum(c["status"] == s for c in checks) for s in ("ok", "failed", "skipped")}
        out = {
            "mode": mode,
            "ok": counts["failed"] == 0,
            "complete": complete,
            "counts": counts,
            "seconds": time.perf_counter() - t0,
            "started": started,
            "machine": machine,
            "checks": checks,
        }
        from agentrl.runs import write_whole

        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_whole(args.out, json.dumps(finite(out), indent=2) + "\n")  # a reader, or a killed call, sees no half
        return out

    try:
        for name in CHECKS:
            if args.only and name not in args.only:
                continue
            left = None if args.budget is None else args.budget - (time.perf_counter() - t0)
            if left is not None and left < MIN_CHECK_S:
                checks.append(skipped(name, f"{left:.0f} s left of --budget {args.budget:g}: not started"))
            else:
                limit = ctx.limit(name) if left is None else min(ctx.limit(name), left)
                checks.append(drive(name, dataclasses.replace(ctx, time_limit=limit)))
            report(complete=False)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    final = report(complete=True)
    print(json.dumps(finite(final), indent=2))
    return 0 if final["ok"] else 1


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def skipped(name: str, reason: str) -> dict[str, Any]:
    log(f"[skipped] {name}: {reason}")
    return {"name": name, "status": "skipped", "seconds": 0.0, "figures": {}, "error": None, "reason": reason}


if __name__ == "__main__":
    sys.exit(main())
