"""`agentrl eval --engine chat`: a chat endpoint plays the env's episodes with native tool calling."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import pytest
import uvicorn
from cli import serving
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from transformers import AutoTokenizer

from agentrl.engine import EngineConfig, EngineModel, build_engine
from agentrl.env.parsers import HermesParser
from agentrl.eval.bench import run_bench
from agentrl.eval.chat import ChatEndpoint, run_chat_bench
from agentrl.eval.config import BenchConfig
from agentrl.models.default import resolve_path
from agentrl.rollout import ChatFormat
from agentrl.rollout.workers import make_env
from agentrl.sandbox import SandboxConfig

BWRAP = SandboxConfig(backend="bwrap")


@pytest.mark.slow  # the vendor case below runs the same code; this one checks agreement token for token
async def test_greedy_chat_against_agentrl_serve_generates_what_the_hf_engine_does(bwrap_runtime):
    cfg = BenchConfig(env="code_sandbox", tasks=3)
    with serving("--model", "default") as url:
        endpoint = ChatEndpoint(base_url=f"{url}/v1", model="default", token_ids=True)
        chat_result, usage, episodes = await run_chat_bench(cfg, endpoint, sandbox=BWRAP, env_workers="local")
    path = resolve_path("default")
    async with build_engine(EngineConfig(), EngineModel(path)) as engine:
        hf = await run_bench(
            cfg, engine, ChatFormat(AutoTokenizer.from_pretrained(path)), sandbox=BWRAP, env_workers="local"
        )
    by_task = {t.task_id: t for t in hf.trajectories}
    for problem, (episode,) in zip(chat_result.per_problem, episodes, strict=True):
        traj = by_task[problem.task_id]
        assert [turn["token_ids"] for turn in episode.turns] == [traj.token_ids[t.start : t.end] for t in traj.turns]
        assert episode.outcome == traj.outcome_reward
    assert chat_result.pass_at_k == hf.pass_at_k and usage["calls"] == sum(len(e[0].turns) for e in episodes)
    assert usage["completion_tokens"] == sum(len(t["token_ids"]) for e in episodes for t in e[0].turns)


class ScriptedVendor:
    """An OpenAI-compatible endpoint standing in for a vendor's API (which cannot run here). Its "model" is the env's
    scripted expert; it answers its first call 429 (Retry-After), its second 503, and the first reply of every
    conversation calls a tool with arguments that are not JSON."""

    def __init__(self, env) -> None:
        self.env, self.calls, self.app = env, 0, FastAPI()
        self.in_flight = self.most_in_flight = 0
        self.app.post("/v1/chat/completions")(self.complete)

    async def complete(self, request: Request) -> JSONResponse:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.05)  # a call takes a while: concurrent ones would overlap
            return await self._complete(request)
        finally:
            self.in_flight -= 1

    async def _complete(self, request: Request) -> JSONResponse:
        self.calls += 1
        if self.calls == 1:
            return JSONResponse({"error": {"message": "slow down"}}, status_code=429, headers={"Retry-After": "0.5"})
        if self.calls == 2:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        body = await request.json()
        if any(m["role"] == "assistant" for m in body["messages"]):
            task = next(t for t in self.env.task_set if t.prompt in body["messages"][1]["content"])
            (text,) = self.env.demonstration(task, random.Random(0))[-1:]
            (call,) = HermesParser().parse(text).calls
            name, arguments = call.name, json.dumps(call.arguments)
        else:
            name, arguments = "submit", '{"code": "def f(:'
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"call_{self.calls}", "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        }
        return JSONResponse(
            {
                "id": f"c{self.calls}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
            }
        )


async def test_a_vendor_that_rate_limits_fails_and_garbles_calls_costs_retries_never_the_run(bwrap_runtime):
    cfg = BenchConfig(env="code_sandbox", tasks=2)
    vendor = ScriptedVendor(make_env("code_sandbox", {"split": "test"}))
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(vendor.app, log_level="warning"))
    serving_task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        endpoint = ChatEndpoint(
            base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1",
            model="vendor-model",
            max_concurrency=1,
            backoff_s=0.1,
        )
        t0 = time.perf_counter()
        result, usage, episodes = await run_chat_bench(cfg, endpoint, sandbox=BWRAP, env_workers="local")
    finally:
        server.should_exit = True
        await serving_task
    assert time.perf_counter() - t0 >= 0.5  # the 429's Retry-After was honoured
    assert usage == {"calls": 6, "retried_calls": 2, "prompt_tokens": 400, "completion_tokens": 40}
    assert result.pass_at_k == {"pass@1": 1.0} and result.infra_failed == 0 and vendor.most_in_flight == 1
    for (episode,) in episodes:  # the garbled call: the agent's error, read by the env; then the expert's submit
        assert [t["tool_calls"] for t in episode.turns] == [1, 1] and episode.turns[0]["reward"] < 0
        assert episode.success and episode.outcome == pytest.approx(1.0 + episode.turns[0]["reward"])


def test_the_chat_engine_needs_an_endpoint_and_a_model():
    from typer.testing import CliRunner

    from agentrl.cli import app

    r = CliRunner().invoke(app, ["eval", "--env", "code_sandbox", "--engine", "chat", "--model", "gpt-4o"])
    assert r.exit_code != 0 and "--engine chat needs --base-url" in r.output
    r = CliRunner().invoke(
        app,
        [
            "eval",
            "--env",
            "code_sandbox",
            "--engine",
            "chat",
            "--base-url",
            "http://x/v1",
            "--model",
            "m",
            "--api-key-env",
            "NO_SUCH_KEY_VAR",
        ],
    )
    assert r.exit_code != 0 and "NO_SUCH_KEY_VAR, which is not set" in r.output
