"""Asynchronous training against the fastest synchronous setup, on the default recipe's model and env.

1. `throughput`: episodes trained per minute over the steady iterations (the first, which fills the
   pipeline, and evaluations are left out), for
   - the baseline: the default run (one process; the hf engine samples with the learner's own module,
     each phase on every core), with its per-phase times and the ideal overlap bound
     (rollout + update) / max(rollout, update);
   - each `--setup k/R/L/T`: `algo.async_level` k, the engine as R replica actors of T torch threads
     each, the learner with L threads, with the learner-idle share (waiting for a batch) and the
     fleet-idle share (a rollout waiting for the learner).
2. `generation`: generated tokens per second on generation alone, through 1 and 2 replicas (each
   replica its share of the cores), against the in-process engine on every core.
3. `learning` (`--learning`, long): held-out success of k = 0 against k = 1 on paired seeds after the
   same number of updates (the default recipe's 10 iterations).

    python benchmarks/async_bench.py                          # throughput and generation: one JSON object
    python benchmarks/async_bench.py --learning --seeds 0 1 2  # and the learning comparison (~1 h on 2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import harness
import torch

from agentrl.runs import read_jsonl

EVAL = ["eval.tasks=8", "eval.every=0"]  # evaluations are left out of the timing; keep them short


def train(out: Path, sets: list[str], *, again: bool = True) -> list[dict]:
    """One `agentrl train` of the default recipe with `sets` (again=False: read the run made earlier); its
    metrics rows."""
    if again:
        harness.train(out, sets)
    return read_jsonl(out / "metrics.jsonl")


def steady(rows: list[dict]) -> dict:
    """Throughput and idle shares over the iterations after the first: the wall from the first iteration's log
    line to the last one's (updates, syncs, waits, logging and checkpoints; no evaluation runs in between)."""
    wall = rows[-1]["time/elapsed_s"] - rows[0]["time/elapsed_s"]
    idle = rows[-1]["time/rollout_idle_s"] - rows[0]["time/rollout_idle_s"]  # cumulative; the first row's is startup
    rows = rows[1:]
    episodes = sum(r.get("batch/trajectories", 0) for r in rows)
    mean = lambda k: statistics.mean(r[k] for r in rows)  # noqa: E731
    return {
        "episodes_per_min": round(60 * episodes / wall, 2),
        "iteration_s": round(wall / len(rows), 2),
        "rollout_s": round(mean("time/rollout_s"), 2),
        "update_s": round(mean("time/update_s"), 2),
        "sync_s": round(mean("time/sync_s"), 3),
        "learner_idle": round(sum(r["time/wait_s"] for r in rows) / wall, 3),
        "fleet_idle": round(idle / wall, 3),
        "staleness_max": max(r.get("train/staleness_max", 0) for r in rows),
    }


def throughput(out: Path, iterations: int, setups: list[str], extra: list[str], again: bool) -> dict:
    base = steady(train(out / "sync", [f"iterations={iterations}", *EVAL, *extra], again=again))
    base["overlap_bound"] = round((base["rollout_s"] + base["update_s"]) / max(base["rollout_s"], base["update_s"]), 2)
    result = {"baseline": base}
    for setup in setups:
        k, replicas, learner, threads = setup.split("/")
        name = f"k{k}_replicas{replicas}x{threads}_learner{learner}"
        rows = train(out / name, [f"iterations={iterations}", *EVAL, *extra, *setup_sets(setup)], again=again)
        r = steady(rows)
        r["speedup"] = round(r["episodes_per_min"] / base["episodes_per_min"], 2)
        result[name] = r
    return result


async def generate(replicas: int | None, threads: int, requests: int, max_tokens: int) -> dict:
    """Tokens/s of `requests` chat prompts sampled at once (replicas None: the in-process engine)."""
    from transformers import AutoTokenizer

    from agentrl.engine import EngineConfig, EngineModel, SamplingParams, build_engine
    from agentrl.models.default import resolve_path
    from agentrl.rollout import ChatFormat

    path = resolve_path("default")
    chat = ChatFormat(AutoTokenizer.from_pretrained(path))
    extra = {} if replicas is None else {"replicas": replicas, "threads_per_replica": threads}
    torch.set_num_threads(threads)
    prompt = chat.prompt_ids([{"role": "user", "content": "Write a Python function that reverses a list."}])
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=tuple(chat.stop_token_ids))
    async with build_engine(EngineConfig(**extra), EngineModel(path=path)) as engine:
        await engine.generate(prompt, params.model_copy(update={"max_tokens": 4}))  # warm up
        t0 = time.perf_counter()
        gens = await asyncio.gather(
            *(
                engine.generate(prompt, params.model_copy(update={"seed": i}), request_id=f"r{i}")
                for i in range(requests)
            )
        )
        wall = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for g in gens)
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1)}


def generation(requests: int, max_tokens: int) -> dict:
    cores = os.cpu_count()
    base = asyncio.run(generate(None, cores, requests, max_tokens))
    result = {"in_process": base}
    for replicas in (1, 2):
        r = asyncio.run(generate(replicas, max(1, cores // replicas), requests, max_tokens))
        r["vs_in_process"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2)
        result[f"replicas_{replicas}"] = r
    return result


def setup_sets(setup: str) -> list[str]:
    """k/R/L/T as run settings."""
    k, replicas, learner, threads = setup.split("/")
    return [
        f"algo.async_level={k}",
        f"engine.replicas={replicas}",
        f"engine.threads_per_replica={threads}",
        f"threads={learner}",
    ]


def learning(out: Path, seeds: list[int], setup: str, extra: list[str]) -> dict:
    """The default run as it is (k = 0) against `setup` with the behaviour weight correcting stale tokens."""
    runs = {}
    for k in (0, 1):
        for seed in seeds:
            async_sets = [] if k == 0 else [*setup_sets(setup), "algo.behaviour_weight=truncate"]
            d = out / f"learn_k{k}_s{seed}"
            harness.train(d, [f"seed={seed}", *async_sets, *extra])
            runs[f"k{k}_s{seed}"] = harness.held_out(read_jsonl(d / "eval.jsonl"))["gain_pp"]
    gain = {k: statistics.mean(runs[f"k{k}_s{s}"] for s in seeds) for k in (0, 1)}
    return {"gain_pp": runs, "mean_gain_pp": gain, "k1_minus_k0_pp": round(gain[1] - gain[0], 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/async_bench"))
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument(
        "--setup",
        dest="setups",
        nargs="+",
        default=["1/1/1/1", "2/1/1/1", "0/2/2/1", "1/2/2/1"],
        help="k/R/L/T: async_level, engine replicas, learner threads, threads per replica",
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--learning", action="store_true")
    p.add_argument("--learning-setup", default="1/1/1/1", help="the k = 1 side of the learning comparison, k/R/L/T")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--summarize-only", action="store_true", help="read the throughput runs under --out, start none")
    p.add_argument("--set", dest="sets", action="append", default=[], help="a further setting of every run")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": harness.machine("torch")}
    if not args.skip_throughput:
        result["throughput"] = throughput(args.out, args.iterations, args.setups, args.sets, not args.summarize_only)
        if not args.summarize_only:
            result["generation"] = generation(args.requests, args.max_tokens)
    if args.learning:
        result["learning"] = learning(args.out, args.seeds, args.learning_setup, args.sets)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
