"""What the session gateway costs over driving the engine directly, for the same episodes token for token.

An SDK-written agent (`openai.AsyncOpenAI`, tool calls answered with a fixed tool message) plays `--sessions`
episodes of `--turns` calls each through a `Gateway` on the hf engine (the default policy, in process); the
baseline, in the same run, plays the same episodes as the rollout controller does: the prompt rendered once,
then each turn's generation and the template's delta appended, through `engine.generate` with the same seeds.
Both make the same tokens (checked), so the difference is the gateway: HTTP, the SDK, rendering and matching the
history, parsing tool calls, recording.

Prints one JSON object: walls of both, their ratio (gateway / direct), and, one call at a time, the p50 and p90
per call of each path and of their difference (8 sessions one after another).
Run: `python benchmarks/gateway_bench.py` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import zlib

import openai
from transformers import AutoTokenizer

from agentrl.engine import EngineConfig, EngineModel, SamplingParams, build_engine
from agentrl.models.default import resolve_path
from agentrl.rollout import ChatFormat, Trajectory
from agentrl.rollout.gateway import Gateway

OPENING = [
    {"role": "system", "content": "Solve the task with Python. Test with run_python, then submit."},
    {"role": "user", "content": "Write compute(n: int) -> int that returns n doubled."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} the code.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
    for name in ("run_python", "submit")
]
RESULT = "exit status 0\nstdout:\n6\n"


async def via_gateway(gateway: Gateway, http, seed: int, turns: int, times: list[float]) -> Trajectory:
    """One SDK agent's episode; `http`: the connection pool every agent's client shares, as the rollout controller's
    episodes do (a client of its own costs ~50 ms of CPU for its TLS context)."""
    traj = Trajectory(episode_id=f"g{seed}", group_id="g", task_id="t", sampling=gateway.sampling)
    access = gateway.open(traj, seed=seed)
    messages = list(OPENING)
    client = openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key, max_retries=0, http_client=http)
    for _ in range(turns):
        t0 = time.perf_counter()
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        times.append(time.perf_counter() - t0)
        message = r.choices[0].message
        messages.append(message)
        if message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": RESULT} for c in message.tool_calls]
        else:
            messages.append({"role": "user", "content": RESULT})
    await gateway.close_session(access.session_id)
    return traj


async def direct(engine, chat: ChatFormat, sampling: SamplingParams, seed: int, turns: int, times: list[float], layout):
    """The controller's way: ids appended, never re-rendered; `layout` says which message follows each reply."""
    ids = chat.prompt_ids(OPENING, tools=TOOLS)
    out = []
    for k in range(turns):
        params = sampling.model_copy(
            update={"stop_token_ids": chat.stop_token_ids, "seed": zlib.crc32(f"{seed}/{len(ids)}".encode())}
        )
        t0 = time.perf_counter()
        gen = await engine.generate(list(ids), params, request_id=f"d{seed}")
        times.append(time.perf_counter() - t0)
        out.append(gen.token_ids)
        ids += gen.token_ids
        if k + 1 < turns:
            ids += chat.observation_ids(layout[k], last_token=ids[-1])
    return out


def follow_ups(traj: Trajectory, chat: ChatFormat) -> list[list[dict]]:
    """The messages the agent sent after each reply (tool messages, or a user message), as the env would."""
    from agentrl.env.parsers import HermesParser

    out = []
    for turn in traj.turns:
        calls = HermesParser().parse(chat.decode(traj.generated_ids(turn.index)))
        role = "tool" if calls.calls and not calls.errors else "user"
        out.append([{"role": role, "content": RESULT}] * (len(calls.calls) if role == "tool" else 1))
    return out


async def _each(together: bool, coros: list) -> list:
    if together:
        return await asyncio.gather(*coros)
    return [await c for c in coros]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    path = resolve_path("default")
    chat = ChatFormat(AutoTokenizer.from_pretrained(path))
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    result = {"sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens}
    # no prefix cache: the second path would reuse the KV of the first's identical prompts
    engine = build_engine(EngineConfig(prefix_cache_tokens=0), EngineModel(path))
    gateway = Gateway(engine, chat, sampling=sampling, max_episode_tokens=4096)
    async with engine, gateway, openai.DefaultAsyncHttpxClient() as http:
        await via_gateway(gateway, http, 999, 1, [])  # warm: the server, the SDK, the engine
        for name, n in (("concurrent", args.sessions), ("serial", 8)):
            together = name == "concurrent"  # serial: one session after another, one call at a time
            g_times, d_times = [], []
            t0 = time.perf_counter()
            trajs = await _each(together, [via_gateway(gateway, http, s, args.turns, g_times) for s in range(n)])
            g_wall = time.perf_counter() - t0
            layouts = [follow_ups(t, chat) for t in trajs]
            t0 = time.perf_counter()
            made = await _each(
                together, [direct(engine, chat, sampling, s, args.turns, d_times, layouts[s]) for s in range(n)]
            )
            d_wall = time.perf_counter() - t0
            same = all([t.generated_ids(turn.index) for turn in t.turns] == m for t, m in zip(trajs, made, strict=True))
            tokens = sum(t.num_generated for t in trajs)
            entry = {
                "calls": len(g_times),
                "generated_tokens": tokens,
                "same_tokens": same,
                "gateway_wall_s": round(g_wall, 3),
                "direct_wall_s": round(d_wall, 3),
                "ratio": round(g_wall / d_wall, 3),
            }
            if name == "serial":
                q = lambda xs, p: round(1000 * statistics.quantiles(xs, n=10)[p], 2)  # noqa: E731
                diff = [g - d for g, d in zip(g_times, d_times, strict=True)]
                entry |= {
                    "gateway_call_ms_p50": round(1000 * statistics.median(g_times), 2),
                    "direct_call_ms_p50": round(1000 * statistics.median(d_times), 2),
                    "overhead_ms_p50": round(1000 * statistics.median(diff), 2),
                    "overhead_ms_p90": q(diff, 8),
                }
            result[name] = entry
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
