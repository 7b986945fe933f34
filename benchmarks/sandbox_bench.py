"""Sandbox latency and throughput against plain `docker exec` / `docker run`, and bubblewrap sandboxes beside Docker's.

Measures, in one run and on one image (`image_tag()` at start-up):

- fast path: `DockerSandbox.run_python("print(1)")` on a warm sandbox, p50 / p99 (the
  executor forks its started interpreter); for comparison also the exec path,
  `DockerSandbox.run(["python3", "-c", "print(1)"])`, which starts a new python3;
- `docker exec CONTAINER python3 -c 'print(1)'` (the docker CLI) into a running sandbox, p50;
- `docker run --rm --network none --entrypoint python3 IMAGE -c 'print(1)'`, p50;
- throughput (calls/s) with 1, 2, 4 and 8 concurrent callers, each on its own warm sandbox;
- `SandboxPool.acquire()` from a settled warm pool, p50 / p99;

and, for each backend of `--backends` (docker, bwrap), under `backends`:

- cold create: from the `create()` call to the executor's first answer (a health probe), p50 / p99
  over `--create-reps` creates, one at a time; and from `create()` to a first call's answer;
- pooled acquire from a settled warm pool, p50 / p99;
- the warm call (`run_python("print(1)")`), p50 / p99, and both backends' warm calls interleaved (one
  call of each in turn) for their ratio;

and prints one JSON object with every figure, the ratios exec/fast-path and
run/acquire, and whether each meets its goal (>= 10x and >= 20x); for bwrap, whether its
cold create p50 is at most 50 ms and its warm call p50 no slower than Docker's.

p99 is nearest-rank: the ceil(0.99 * n)-th smallest sample.

Run: `python benchmarks/sandbox_bench.py` (a minute or two), or `--quick` for a smoke run.
Needs a Docker engine and the sandbox image (`agentrl sandbox build`); `--backends bwrap` needs
neither (bubblewrap only), and measures only the bwrap figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
import uuid

import harness

from agentrl.sandbox import SandboxConfig, reaper
from agentrl.sandbox.base import ExecResult, Sandbox
from agentrl.sandbox.docker_sandbox import DockerSandbox, DockerSandboxConfig, docker_client
from agentrl.sandbox.image import image_exists, image_tag
from agentrl.sandbox.pool import SandboxPool

SNIPPET = "print(1)"
ARGV = ["python3", "-c", SNIPPET]  # the same snippet on every path
BENCH_LABEL = f"agentrl.bench={uuid.uuid4().hex[:12]}"  # marks our `docker run` containers
EXEC_GOAL = 10.0  # fast path p50 at least this many times below docker exec p50
RUN_GOAL = 20.0  # acquire p50 at least this many times below docker run p50
BWRAP_CREATE_GOAL_MS = 50.0  # bwrap cold create p50 at most this (E2B's vendor figure, create to exec: 442 ms)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few repetitions: a smoke run for CI")
    p.add_argument("--warmup", type=int, default=10, help="untimed fast-path calls first")
    p.add_argument("--fast-reps", type=int, default=200, help="timed fast-path calls")
    p.add_argument("--exec-reps", type=int, default=20, help="timed docker exec calls")
    p.add_argument("--run-reps", type=int, default=20, help="timed docker run --rm calls")
    p.add_argument("--acquire-reps", type=int, default=50, help="timed pool acquires")
    p.add_argument("--pool-size", type=int, default=4)
    p.add_argument("--duration", type=float, default=3.0, help="seconds per throughput level")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--backends", nargs="+", choices=["docker", "bwrap"], default=["docker", "bwrap"])
    p.add_argument("--create-reps", type=int, default=50, help="timed cold creates per backend")
    args = p.parse_args()
    if args.quick:
        args.warmup, args.fast_reps, args.exec_reps, args.run_reps = 3, 30, 5, 5
        args.acquire_reps, args.pool_size, args.duration, args.concurrency = 5, 2, 0.5, [1, 2]
        args.create_reps = 5
    return args


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


def p99(samples: list[float]) -> float:
    """Nearest-rank 99th percentile."""
    ordered = sorted(samples)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


async def timed(coro_fn, reps: int) -> tuple[list[float], list]:
    """Seconds each of `reps` sequential awaits of `coro_fn()` took, and what each returned."""
    samples, results = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        results.append(await coro_fn())
        samples.append(time.perf_counter() - t0)
    return samples, results


async def docker_cli(*args: str) -> None:
    """One docker CLI command; raises unless it exits 0 and prints "1"."""
    proc = await asyncio.create_subprocess_exec(
        "docker", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if proc.returncode != 0 or out.strip() != b"1":
        raise RuntimeError(f"docker {' '.join(args)}: rc={proc.returncode} out={out!r} err={err.decode()[-500:]}")


async def fast_call(sb: DockerSandbox) -> ExecResult:
    return check(await sb.run_python(SNIPPET))


async def exec_path_call(sb: DockerSandbox) -> ExecResult:
    return check(await sb.run(ARGV))


def check(result: ExecResult) -> ExecResult:
    if not result.ok or result.stdout.strip() != "1":
        raise RuntimeError(f"sandbox call failed: {result}")
    return result


async def bench_latency(sb: DockerSandbox, image: str, args) -> dict:
    await timed(lambda: fast_call(sb), args.warmup)
    fast, results = await timed(lambda: fast_call(sb), args.fast_reps)
    program = [r.wall_s for r in results]  # the program itself, timed by the executor
    await timed(lambda: exec_path_call(sb), args.warmup)
    exec_path, _ = await timed(lambda: exec_path_call(sb), args.fast_reps)
    # The docker CLI, not the SDK's exec_run: the CLI is what users compare against.
    await docker_cli("exec", sb.container.name, *ARGV)  # warm-up
    exec_, _ = await timed(lambda: docker_cli("exec", sb.container.name, *ARGV), args.exec_reps)
    run_argv = ["run", "--rm", "--network", "none", "--label", BENCH_LABEL, "--entrypoint", "python3", image]
    await docker_cli(*run_argv, *ARGV[1:])  # warm-up
    run, _ = await timed(lambda: docker_cli(*run_argv, *ARGV[1:]), args.run_reps)
    return {
        "fast_path_p50_ms": ms(p50(fast)),
        "fast_path_p99_ms": ms(p99(fast)),
        "fast_path_mean_ms": ms(statistics.fmean(fast)),
        # Of the fast path: the program's own run and everything else (HTTP, executor).
        "fast_path_program_p50_ms": ms(p50(program)),
        "fast_path_overhead_p50_ms": ms(p50([f - w for f, w in zip(fast, program, strict=True)])),
        "exec_path_p50_ms": ms(p50(exec_path)),
        "exec_path_p99_ms": ms(p99(exec_path)),
        "docker_exec_p50_ms": ms(p50(exec_)),
        "docker_exec_p99_ms": ms(p99(exec_)),
        "docker_run_p50_ms": ms(p50(run)),
        "docker_run_p99_ms": ms(p99(run)),
    }


async def throughput(sandboxes: list[DockerSandbox], duration_s: float) -> float:
    """Calls/s with one caller per sandbox, each looping calls for `duration_s`."""
    deadline = time.perf_counter() + duration_s

    async def caller(sb: DockerSandbox) -> int:
        n = 0
        while time.perf_counter() < deadline:
            await fast_call(sb)
            n += 1
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(caller(sb) for sb in sandboxes))
    return round(sum(counts) / (time.perf_counter() - t0), 1)


async def wait_settled(pool: SandboxPool, started: int) -> None:
    """Until `started` sandboxes have started and no start or removal is in flight (only the pool's `size` exist)."""
    async with asyncio.timeout(120):
        while pool.stats["started"] < started or pool._tasks or len(pool._idle) < pool.size:
            await asyncio.sleep(0.02)


async def bench_acquire(factory, args) -> dict:
    pool = SandboxPool(factory, size=args.pool_size)
    samples = []
    try:
        await pool.start()
        for i in range(args.acquire_reps):
            await wait_settled(pool, args.pool_size + i)
            t0 = time.perf_counter()
            sb = await pool.acquire()
            samples.append(time.perf_counter() - t0)
            await pool.release(sb)
    finally:
        await pool.close()
    return {"acquire_p50_ms": ms(p50(samples)), "acquire_p99_ms": ms(p99(samples))}


async def create_sandboxes(cfg: DockerSandboxConfig, n: int) -> list[DockerSandbox]:
    results = await asyncio.gather(*(DockerSandbox.create(cfg) for _ in range(n)), return_exceptions=True)
    sandboxes = [r for r in results if isinstance(r, DockerSandbox)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await asyncio.gather(*(sb.close() for sb in sandboxes))
        raise errors[0]
    return sandboxes


def remove_run_containers() -> None:
    """Belt and braces: `docker run --rm` leaves its container behind if the CLI is killed."""
    for c in docker_client().containers.list(all=True, filters={"label": BENCH_LABEL}):
        c.remove(force=True)


def machine_info(image: str) -> dict:
    client = docker_client()
    # Containers not ours (e.g. a concurrent test run) compete for the same cores.
    others = [c for c in client.containers.list() if c.labels.get(reaper.SESSION_LABEL) != reaper.SESSION_ID]
    return harness.machine() | {
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "other_containers_running": len(others),
        "docker_server_version": client.version()["Version"],
        "image": image,
    }


async def bench_cold_create(factory, reps: int) -> dict:
    """From create() to the executor's first answer, one sandbox at a time (each closed, untimed, before the next);
    and, on other sandboxes, from create() to the answer of a first call (`run_python("print(1)")` at once, with no
    health probe): what an episode that starts on a sandbox of its own waits. The executor makes its first spare
    after its first answer, so the second figure is not the first plus a warm call."""
    samples, first_call = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        sb: Sandbox = await factory()
        try:
            if not await sb.healthy():
                raise RuntimeError("a new sandbox failed its first health probe")
            samples.append(time.perf_counter() - t0)
        finally:
            await sb.close()
        t0 = time.perf_counter()
        sb = await factory()
        try:
            await fast_call(sb)  # checked
            first_call.append(time.perf_counter() - t0)
        finally:
            await sb.close()
    return {
        "cold_create_p50_ms": ms(p50(samples)),
        "cold_create_p99_ms": ms(p99(samples)),
        "create_to_first_call_p50_ms": ms(p50(first_call)),
        "create_to_first_call_p99_ms": ms(p99(first_call)),
    }


async def bench_backend(backend: str, args) -> dict:
    """Cold create, pooled acquire and the warm call of one backend's sandboxes, with its defaults."""
    factory = SandboxConfig(backend=backend).factory()
    out = await bench_cold_create(factory, args.create_reps)
    sb = await factory()
    try:
        await timed(lambda: fast_call(sb), args.warmup)
        warm, _ = await timed(lambda: fast_call(sb), args.fast_reps)
    finally:
        await sb.close()
    out |= {"warm_call_p50_ms": ms(p50(warm)), "warm_call_p99_ms": ms(p99(warm))}
    acquire = await bench_acquire(factory, args)
    return out | {
        "pooled_acquire_p50_ms": acquire["acquire_p50_ms"],
        "pooled_acquire_p99_ms": acquire["acquire_p99_ms"],
    }


async def bench_interleaved(args) -> dict:
    """The warm call of a Docker and a bwrap sandbox, one call of each in turn (so both see the same machine, whose
    load drifts over a run), p50 / p99."""
    sandboxes = {b: await SandboxConfig(backend=b).factory()() for b in ("docker", "bwrap")}
    samples: dict[str, list[float]] = {b: [] for b in sandboxes}
    try:
        for sb in sandboxes.values():
            await timed(lambda sb=sb: fast_call(sb), args.warmup)
        for _ in range(args.fast_reps):
            for b, sb in sandboxes.items():
                samples[b] += (await timed(lambda sb=sb: fast_call(sb), 1))[0]
    finally:
        await asyncio.gather(*(sb.close() for sb in sandboxes.values()))
    return {f"{b}_{q.__name__}_ms": ms(q(v)) for b, v in samples.items() for q in (p50, p99)}


async def main(args) -> dict:
    if "docker" not in args.backends:  # bubblewrap alone: no Docker engine needed
        report = {"machine": harness.machine() | {"loadavg_1m": round(os.getloadavg()[0], 2)}}
        report["bwrap_host"] = SandboxConfig(backend="bwrap").describe()
        report["backends"] = {"bwrap": await bench_backend("bwrap", args)}
        bw = report["backends"]["bwrap"]
        report["goal_bwrap_cold_create_p50_at_most_50_ms"] = bw["cold_create_p50_ms"] <= BWRAP_CREATE_GOAL_MS
        return report | {"settings": vars(args)}
    image = image_tag()  # fixed once: every path below uses this image
    if not image_exists(docker_client(), image):
        sys.exit(f"sandbox image {image} not found: run `agentrl sandbox build`")
    cfg = DockerSandboxConfig(image=image)
    report = {"machine": machine_info(image), "snippet": SNIPPET}
    t0 = time.perf_counter()
    sandboxes = await create_sandboxes(cfg, max(args.concurrency))
    try:
        report |= await bench_latency(sandboxes[0], image, args)
        report["throughput_calls_per_s"] = {
            str(n): await throughput(sandboxes[:n], args.duration) for n in args.concurrency
        }
    finally:
        await asyncio.gather(*(sb.close() for sb in sandboxes))
        await asyncio.to_thread(remove_run_containers)
    report |= await bench_acquire(lambda: DockerSandbox.create(cfg), args)
    report["backends"] = {b: await bench_backend(b, args) for b in args.backends}
    if "bwrap" in args.backends:
        bw = report["backends"]["bwrap"]
        report["bwrap_host"] = SandboxConfig(backend="bwrap").describe()
        report["warm_call_interleaved"] = pair = await bench_interleaved(args)
        report["bwrap_warm_call_p50_over_docker"] = round(pair["bwrap_p50_ms"] / pair["docker_p50_ms"], 3)
        report["goal_bwrap_cold_create_p50_at_most_50_ms"] = bw["cold_create_p50_ms"] <= BWRAP_CREATE_GOAL_MS
        report["goal_bwrap_warm_call_no_slower_than_docker"] = pair["bwrap_p50_ms"] <= pair["docker_p50_ms"]
    exec_ratio = report["docker_exec_p50_ms"] / report["fast_path_p50_ms"]
    run_ratio = report["docker_run_p50_ms"] / report["acquire_p50_ms"]
    report |= {
        "docker_exec_p50_over_fast_path_p50": round(exec_ratio, 2),
        "docker_run_p50_over_acquire_p50": round(run_ratio, 2),
        "goal_fast_path_10x_below_docker_exec": exec_ratio >= EXEC_GOAL,
        "goal_acquire_20x_below_docker_run": run_ratio >= RUN_GOAL,
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "bench_wall_s": round(time.perf_counter() - t0, 1),
        "settings": vars(args),
    }
    return report


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args())), indent=2))
