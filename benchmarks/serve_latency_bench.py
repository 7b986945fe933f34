"""Per-request latency of `agentrl serve` over the same engine in process: what the HTTP path adds.

Starts `agentrl serve --model default` (a subprocess; `--server-pythonpath DIR` runs another checkout's, for a
before/after), then times `--requests` sequential requests of `--max-tokens` greedy tokens each on a fixed prompt,
three ways: the engine in this process (`engine.generate`, the baseline), the `openai` engine (completions, token
ids) against the server, and the `openai` SDK's chat completions against it. Prints one JSON object: the p50 and
p90 of each, in ms, and each HTTP path's p50 minus the baseline's.
Run: `python benchmarks/serve_latency_bench.py` (about half a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import openai

from agentrl.engine import EngineConfig, EngineModel, SamplingParams, build_engine
from agentrl.models.default import resolve_path

PROMPT = list(range(100, 300))
MESSAGES = [{"role": "user", "content": "Write compute(n: int) -> int that returns n doubled."}]


def quantiles(xs: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(1000 * statistics.median(xs), 2),
        "p90_ms": round(1000 * statistics.quantiles(xs, n=10)[8], 2),
    }


async def timed(n: int, call) -> list[float]:
    await call()  # warm
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--server-pythonpath", default=None, help="run the server from this checkout (before/after)")
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    env = os.environ | ({"PYTHONPATH": args.server_pythonpath} if args.server_pythonpath else {})
    server = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "serve", "--model", "default", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        url = next(line.split()[-1] for line in server.stdout if "http://" in line)
        result: dict = {"requests": args.requests, "max_tokens": args.max_tokens}
        async with build_engine(EngineConfig(), EngineModel(resolve_path("default"))) as local:
            result["in_process"] = quantiles(await timed(args.requests, lambda: local.generate(PROMPT, params)))
        async with build_engine(EngineConfig(kind="openai", base_url=url), EngineModel()) as remote:
            result["completions"] = quantiles(await timed(args.requests, lambda: remote.generate(PROMPT, params)))
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none") as client:
            chat = lambda: client.chat.completions.create(  # noqa: E731
                model="default", messages=MESSAGES, temperature=0, max_tokens=args.max_tokens
            )
            result["chat"] = quantiles(await timed(args.requests, chat))
        base = result["in_process"]["p50_ms"]
        result["added_p50_ms"] = {k: round(result[k]["p50_ms"] - base, 2) for k in ("completions", "chat")}
    finally:
        server.terminate()
        server.wait(60)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
