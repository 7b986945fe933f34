"""`agentrl eval --engine chat`: a chat endpoint plays the env's episodes with native tool calling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

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
from agentrl.rollout.workers import make_env, task_ids
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
            function = expert_call(self.env, body)
        else:
            function = {"name": "submit", "arguments": '{"code": "def f(:'}
        usage = {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}
        return tool_call_reply(self.calls, body["model"], function, usage=usage)


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
    assert usage == {"calls": 6, "retried_calls": 2, "refused_calls": 0, "prompt_tokens": 400, "completion_tokens": 40}
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


def tool_call_reply(n: int, model: str, function: dict, usage: dict | None = None) -> JSONResponse:
    """A chat completion whose message is one call of `function` ({name, arguments}), as a vendor's API sends it."""
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": f"call_{n}", "type": "function", "function": function}],
    }
    reply = {
        "id": f"c{n}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
    }
    return JSONResponse(reply | ({"usage": usage} if usage else {}))


def expert_call(env, body: dict) -> dict:
    """The env's scripted expert's reply to the conversation in `body` (its task's last demonstration turn)."""
    task = next(t for t in env.task_set if t.prompt in body["messages"][1]["content"])
    (text,) = env.demonstration(task, random.Random(0))[-1:]
    (call,) = HermesParser().parse(text).calls
    return {"name": call.name, "arguments": json.dumps(call.arguments)}


class RefusingVendor:
    """An OpenAI-compatible endpoint whose model is the env's scripted expert, except where `refuse(body, call)`
    returns a status and a message: then it answers that, as a vendor's API answers an error."""

    def __init__(self, env, refuse: Callable[[dict, int], tuple[int, str] | None]) -> None:
        self.env, self.refuse, self.calls, self.app = env, refuse, 0, FastAPI()
        self.app.post("/v1/chat/completions")(self.complete)

    async def complete(self, request: Request) -> JSONResponse:
        self.calls += 1
        body = await request.json()
        if refused := self.refuse(body, self.calls):
            status, message = refused
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)
        return tool_call_reply(self.calls, body["model"], expert_call(self.env, body))


@contextlib.contextmanager
def served(app: FastAPI) -> Iterator[str]:
    """`app` on a real port, in a thread of its own (the command under test runs its own event loop): its /v1 URL."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join()


def chat_eval(url: str, *args: object):
    """`agentrl eval --engine chat` on code_sandbox's test split, one call in flight, in this process."""
    from typer.testing import CliRunner

    from agentrl.cli import app

    common = ["eval", "--env", "code_sandbox", "--engine", "chat", "--base-url", url, "--model", "vendor-model"]
    sets = ["sandbox.backend=bwrap", "env_workers=local", "chat.backoff_s=0.1"]
    return CliRunner().invoke(app, [*common, "--max-concurrency", "1", *map(str, args), *(f"--set={s}" for s in sets)])


def test_a_call_refused_for_its_conversation_fails_its_task_and_the_benchmark_goes_on(tmp_path, bwrap_runtime):
    """A 400 for one task's conversation (past the model's context) is that task's wrong answer, its reason in the
    per-task results; the other tasks are played and scored. A 408 is the endpoint's, retried as the SDK would."""
    env = make_env("code_sandbox", {"split": "test"})
    long_task = env.task_set.get(task_ids("code_sandbox", {"split": "test"}, 3)[1])
    too_long = "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens."

    def refuse(body: dict, call: int) -> tuple[int, str] | None:
        if call == 1:
            return 408, "request timed out"
        return (400, too_long) if long_task.prompt in body["messages"][1]["content"] else None

    vendor = RefusingVendor(env, refuse)
    with served(vendor.app) as url:
        r = chat_eval(url, "--tasks", 3, "--out", tmp_path)
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["pass_at_k"] == {"pass@1": pytest.approx(2 / 3)} and summary["infra_failed"] == 0
    # the 408 and its retry, then one call a task: the refused one is not retried
    assert summary["usage"] == {
        "calls": 4,
        "retried_calls": 1,
        "refused_calls": 1,
        "prompt_tokens": 0,
        "completion_tokens": 0,
    }
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(row["n"], row["correct"]) for row in rows] == [(1, 1), (1, 0), (1, 1)]
    (refused,) = rows[1]["episodes"]
    assert refused["task_id"] == long_task.id and refused["status"] == "refused" and not refused["success"]
    assert too_long in refused["error"] and "Error code: 400" in refused["error"]


def refuse_all(status: int, message: str) -> Callable[[dict, int], tuple[int, str]]:
    return lambda body, call: (status, message)


@pytest.mark.parametrize(
    ("status", "message", "said", "calls"),
    [
        (401, "Incorrect API key provided", "refuses the run: Error code: 401 - Incorrect API key provided", 1),
        # the same path as the key's, another line of advice: the slow tier (each case starts an env worker)
        pytest.param(
            403,
            "not allowed to sample from this model",
            "check that the key may use this model (--model)",
            1,
            marks=pytest.mark.slow,
        ),
        pytest.param(
            404,
            "The model `vendor-model` does not exist",
            "check --base-url (with its /v1) and --model",
            1,
            marks=pytest.mark.slow,
        ),
        # every call refused for what it holds: the settings (here a parameter the model does not take)
        (400, "Unsupported parameter: 'max_tokens'", "refused the first 3 calls and answered none", 3),
    ],
    ids=["key", "permission", "model", "every_call"],
)
def test_an_endpoint_that_refuses_the_run_stops_it_at_once_in_one_line(bwrap_runtime, status, message, said, calls):
    """A key, a model or a URL the endpoint refuses is the run's settings: the evaluation stops at its first
    refusal (a 400 refusing every call, at its third), in one line naming the fix, never a 0% score."""
    vendor = RefusingVendor(make_env("code_sandbox", {"split": "test"}), refuse_all(status, message))
    with served(vendor.app) as url:
        r = chat_eval(url, "--tasks", 4)
    assert r.exit_code == 2 and r.output.strip() == r.output.strip().splitlines()[0], r.output
    assert said in r.output and "vendor-model" in r.output and vendor.calls == calls, r.output
