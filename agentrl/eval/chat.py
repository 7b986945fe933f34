"""`agentrl eval --engine chat`: any OpenAI-compatible chat endpoint on a built-in env, with native tool calling.

A vendor API, `vllm serve` or `agentrl serve` plays the env's episodes as a chat model would: each turn sends the
conversation so far with the env's tools (`tools`, OpenAI's format) and takes the reply's `content` and
`tool_calls`. The env reads the reply as its own loop reads a model's message: the calls written in the env's
tool-call format (Hermes) after the content, so it runs, grades and penalises them exactly as it does its own
policy's. Its observations go back as `tool` messages answering the calls in order; where they do not pair with
the reply's calls (a reply without calls, or calls the env could not read), as `user` messages.

- A reply whose calls are garbled (arguments that are not JSON) is the agent's error: the env reads the broken
  call and answers with the error, as it would its own policy's; never a crash.
- A 429 (after its `Retry-After`), a 408, a 409, a timeout, a connection error or a 5xx (the SDK's own retries) is
  retried with exponential backoff, up to `max_retries` times, and counted (`usage.retried_calls`); an episode
  whose call still fails is left out of its problem's n, as a sandbox failure is, and counted (`infra_failed`).
- Any other answer is the endpoint refusing the call, and is never retried. Who caused it decides what it costs:
  - 400, 413 or 422: the request (a conversation past the model's context, a content filter, a message the
    endpoint cannot take). That episode ends as the agent's failure: a wrong answer, in n, as an agent program
    that raised is (`agentrl.eval.bench.scored`), its reason in its `error` (status `refused`), counted
    (`usage.refused_calls`); the rest of the benchmark goes on.
  - Any other status (401 or 403: the key; 404: the model or the URL; 402, 405, 410, ...): the run's settings,
    the same for every call. The evaluation stops at once with `EndpointRefused`, one line, never a 0% score.
  - The first kind on every call is the run's settings too (a sampling parameter the model does not take): the
    evaluation stops, the same way, once the endpoint has refused `_Caller.REFUSALS_TO_STOP` (3) calls, or every
    episode's where there are fewer, before answering any. Its price: a benchmark whose first 3 refusals all come
    before any reply (3 prompts past the context) stops too, rather than scoring a run that may be all refusals.
- `max_concurrency` bounds the calls in flight; token usage (the endpoint's `usage`) goes into the summary.
- `token_ids`: ask for the generated token ids (vLLM's and `agentrl serve`'s `return_token_ids`), kept per turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
import zlib
from typing import Any

import openai
from pydantic import BaseModel, ConfigDict, Field

from agentrl.env.base import FailureClass, Message
from agentrl.env.parsers import get_parser
from agentrl.env.tool_env import ToolEnvConfig
from agentrl.env.tools import ToolCall
from agentrl.eval.bench import BenchResult, bench_result, bench_tasks, problem_result
from agentrl.eval.config import BenchConfig
from agentrl.rollout import RolloutConfig, WorkerError
from agentrl.rollout.config import EnvWorkersAt
from agentrl.rollout.pool import EnvWorkerPool, env_worker_pool
from agentrl.rollout.workers import make_env
from agentrl.sandbox import SandboxConfig

log = logging.getLogger(__name__)


class ChatEndpoint(BaseModel):
    """Where `agentrl eval --engine chat` sends its calls."""

    model_config = ConfigDict(extra="forbid")

    base_url: str
    """the endpoint, with its /v1 (https://api.openai.com/v1, http://127.0.0.1:8000/v1)"""
    model: str
    """the model to ask for"""
    api_key_env: str | None = None
    """the environment variable holding the key; None: no key (a local server)"""
    max_concurrency: int = Field(8, ge=1)
    """calls in flight at once"""
    max_retries: int = Field(5, ge=0)
    """further attempts of a call after a 429, a 408, a 409, a timeout, a connection error or a 5xx"""
    backoff_s: float = Field(1.0, gt=0)
    """the first retry's wait (doubling after each), when the endpoint sends no Retry-After"""
    timeout_s: float = Field(600.0, gt=0)
    token_ids: bool = False
    """ask for the generated token ids (return_token_ids: vLLM, agentrl serve)"""

    def api_key(self) -> str:
        if self.api_key_env is None:
            return "none"  # the SDK needs a value; a local server takes any
        key = os.environ.get(self.api_key_env, "").strip()
        if not key:
            raise ValueError(f"--api-key-env names {self.api_key_env}, which is not set: export the endpoint's key")
        return key


class EndpointError(RuntimeError):
    """A call that still failed after its retries: its episode is an infrastructure failure."""


class CallRefused(RuntimeError):
    """A call the endpoint refused for what it held (400, 413, 422): its episode is a wrong answer."""


class EndpointRefused(RuntimeError):
    """The endpoint refuses the run (a key, a model, a URL, or every call): the evaluation stops."""


class _Usage:
    def __init__(self) -> None:
        self.calls = self.retried = self.refused = self.prompt_tokens = self.completion_tokens = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "calls": self.calls,
            "retried_calls": self.retried,
            "refused_calls": self.refused,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


class _Caller:
    """The endpoint's client: calls bounded by a semaphore, retried or refused as the module doc says, usage
    counted. `episodes`: how many the run plays (a run of fewer than `REFUSALS_TO_STOP` stops once each is refused)."""

    REQUEST_STATUS = (400, 413, 422)
    """the refusals of one request (what it held), not of the run"""
    REFUSALS_TO_STOP = 3

    def __init__(self, endpoint: ChatEndpoint, cfg: BenchConfig, episodes: int) -> None:
        self.endpoint, self.cfg = endpoint, cfg
        self.client = openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key(), max_retries=0, timeout=endpoint.timeout_s
        )
        self.gate = asyncio.Semaphore(endpoint.max_concurrency)
        self.usage = _Usage()
        self.answered = 0
        self.refusals_to_stop = min(self.REFUSALS_TO_STOP, episodes)
        self.run_refused: EndpointRefused | None = None

    async def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Any:
        s = self.cfg.sampling
        kw: dict[str, Any] = {"temperature": s.temperature, "max_tokens": s.max_tokens}
        if s.top_p < 1:
            kw["top_p"] = s.top_p
        if tools:
            kw["tools"] = tools
        if self.endpoint.token_ids:
            kw["extra_body"] = {"return_token_ids": True}
        for attempt in range(self.endpoint.max_retries + 1):
            try:
                async with self.gate:
                    if self.run_refused is not None:  # a call that waited on the gate: sent to no avail
                        raise EndpointRefused(str(self.run_refused))
                    self.usage.calls += 1
                    r = await self.client.chat.completions.create(model=self.endpoint.model, messages=messages, **kw)
            except openai.APIStatusError as e:
                if not (e.status_code in (408, 409, 429) or e.status_code >= 500):
                    raise self._refusal(e) from e
                error: Exception = e
            except openai.APIConnectionError as e:  # a timeout too
                error = e
            else:
                self.answered += 1
                if r.usage is not None:
                    self.usage.prompt_tokens += r.usage.prompt_tokens
                    self.usage.completion_tokens += r.usage.completion_tokens
                return r
            if attempt == self.endpoint.max_retries:
                raise EndpointError(f"{type(error).__name__} after {attempt + 1} attempts: {error}") from error
            self.usage.retried += 1
            await asyncio.sleep(self._wait(error, attempt))
        raise AssertionError("unreachable")

    def _refusal(self, e: openai.APIStatusError) -> CallRefused | EndpointRefused:
        """A status that is not retried: the request's refusal, or the run's (the module doc's split), which no later
        call is sent past."""
        reason = " ".join(e.message.split())  # the endpoint's message, on one line
        where = f"{self.endpoint.base_url} (model {self.endpoint.model!r})"
        if e.status_code not in self.REQUEST_STATUS:
            fix = {
                401: "check the key (--api-key-env)",
                403: "check that the key may use this model (--model)",
                404: "check --base-url (with its /v1) and --model",
            }.get(e.status_code, "check --base-url, --model and --api-key-env")
            self.run_refused = EndpointRefused(f"{where} refuses the run: {reason}: {fix}")
            return self.run_refused
        self.usage.refused += 1
        if not self.answered and self.usage.refused >= self.refusals_to_stop:
            self.run_refused = EndpointRefused(
                f"{where} refused the first {self.usage.refused} calls and answered none (the last: {reason}): "
                "a refusal of every call is the run's settings, not its tasks: check --model and the sampling "
                "settings it sends (--set temperature=, top_p=, max_tokens=)"
            )
            return self.run_refused
        return CallRefused(reason)

    def _wait(self, e: Exception, attempt: int) -> float:
        """The endpoint's Retry-After (seconds), else exponential backoff."""
        response = getattr(e, "response", None)
        after = response.headers.get("retry-after") if response is not None else None
        try:
            return max(float(after), 0.0)
        except (TypeError, ValueError):
            return self.endpoint.backoff_s * 2**attempt

    async def close(self) -> None:
        await self.client.close()


def action_text(message: Any, parser_name: str = "hermes") -> str:
    """A reply as the env reads a model's message: its content, then each call in the env's tool-call format (a
    call whose arguments are not a JSON object written as it came, for the env to report)."""
    parser = get_parser(parser_name)
    parts = [message.content] if message.content else []
    for call in message.tool_calls or []:
        try:
            args = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError:
            args = None
        if isinstance(args, dict):
            parts.append(parser.format(ToolCall(name=call.function.name, arguments=args)))
        else:
            raw = json.dumps(call.function.name)
            parts.append(f'<tool_call>\n{{"name": {raw}, "arguments": {call.function.arguments}}}\n</tool_call>')
    return "\n".join(parts)


def answer_messages(message: Any, observation: list[Message]) -> list[dict[str, Any]]:
    """The reply and the env's observation as the next messages of the conversation (see the module doc)."""
    calls = message.tool_calls or []
    sent: dict[str, Any] = {"role": "assistant", "content": message.content}
    if calls:
        sent["tool_calls"] = [c.model_dump(include={"id", "type", "function"}) for c in calls]
    tools = [m for m in observation if m["role"] == "tool"]
    paired = len(tools) == len(calls) and calls
    out, i = [sent], 0
    for m in observation:
        if m["role"] == "tool" and paired:
            out.append({"role": "tool", "tool_call_id": calls[i].id, "content": m["content"]})
            i += 1
        else:
            out.append({"role": "user" if m["role"] == "tool" else m["role"], "content": m["content"]})
    return out


class _Episode(BaseModel):
    task_id: str
    status: str
    """finished; refused (the endpoint refused a call of it: a wrong answer, `error` says why); or failed (an
    infrastructure failure, left out of n)"""
    outcome: float = 0.0
    """the episode's return: the sum of its turns' rewards"""
    success: bool = False
    error: str | None = None
    turns: list[dict[str, Any]] = []
    retried: int = 0


async def run_chat_bench(
    cfg: BenchConfig,
    endpoint: ChatEndpoint,
    *,
    sandbox: SandboxConfig | None = None,
    env_workers: EnvWorkersAt = "ray",
) -> tuple[BenchResult, dict[str, int], list[list[_Episode]]]:
    """The benchmark on `endpoint`; also the token usage and every episode's record, per problem."""
    t0 = time.perf_counter()
    split, env_kwargs, ids = bench_tasks(cfg)
    env_cfg = make_env(cfg.env, env_kwargs).cfg
    parser = env_cfg.parser if isinstance(env_cfg, ToolEnvConfig) else "hermes"
    rollout = RolloutConfig(env=cfg.env, env_kwargs=env_kwargs, env_workers=env_workers, **cfg.worker_settings())
    pool = env_worker_pool(rollout, None, sandbox)
    caller = _Caller(endpoint, cfg, len(ids) * cfg.samples)
    await pool.start()
    plays = [
        [asyncio.ensure_future(_play(pool, caller, cfg, parser, task, k, i)) for i in range(cfg.samples)]
        for k, task in enumerate(ids)
    ]
    every = [p for group in plays for p in group]
    try:
        await asyncio.gather(*every)
    finally:
        # a refused run: the episodes still in flight end (and close their env episodes) before the pool does
        for p in every:
            p.cancel()
        await asyncio.gather(*every, return_exceptions=True)
        await caller.close()
        await pool.close()
    groups = [[p.result() for p in group] for group in plays]
    per_problem = []
    for task, episodes in zip(ids, groups, strict=True):
        scored = [(e.outcome, e.success) for e in episodes if e.status != "failed"]
        per_problem.append(problem_result(cfg, task, scored, len(episodes) - len(scored)))
    result = bench_result(
        cfg,
        split,
        per_problem,
        infra_failed=sum(p.infra_failed for p in per_problem),
        retried=sum(e.retried for g in groups for e in g),
        wall_s=time.perf_counter() - t0,
    )
    return result, caller.usage.as_dict(), groups


async def _play(
    pool: EnvWorkerPool, caller: _Caller, cfg: BenchConfig, parser: str, task: str, k: int, i: int
) -> _Episode:
    """One episode, restarted after an infrastructure failure (a worker's, or the endpoint's after its retries) up
    to `cfg.max_retries` times; the seed is the rollout controller's for the same group and member."""
    seed = zlib.crc32(f"{cfg.seed}/00000-{k:03d}/{i}".encode())
    problem = ""
    for attempt in range(cfg.max_retries + 1):
        worker, eid = pool.pick(), uuid.uuid4().hex
        try:
            episode = await _turns(worker, eid, caller, parser, task, seed)
            episode.retried = attempt
            return episode
        except (WorkerError, EndpointError) as e:
            problem = f"{type(e).__name__}: {e}"
            log.warning("task %s: %s", task, problem)
        finally:
            await worker.close(eid)
    return _Episode(task_id=task, status="failed", error=problem, retried=cfg.max_retries)


async def _turns(worker: Any, eid: str, caller: _Caller, parser: str, task: str, seed: int) -> _Episode:
    obs, info = await worker.reset(eid, task, seed)
    messages: list[dict[str, Any]] = [dict(m) for m in obs]
    tools = info.get("tools") or None
    turns = []
    while True:
        try:
            r = await caller.reply(messages, tools)
        except CallRefused as e:
            total = sum(t["reward"] for t in turns)
            return _Episode(task_id=task, status="refused", outcome=total, error=f"refused: {e}", turns=turns)
        message = r.choices[0].message
        obs, reward, terminated, truncated, step = await worker.step(eid, action_text(message, parser))
        turn = {"content": message.content, "tool_calls": len(message.tool_calls or []), "reward": reward}
        if caller.endpoint.token_ids:
            turn["token_ids"] = (r.choices[0].model_extra or {}).get("token_ids")
        turns.append(turn)
        if step.get("failure") == FailureClass.INFRA:
            raise WorkerError(step.get("error", "the env reported an infrastructure failure"))
        if terminated or truncated:
            success = terminated and step.get("outcome") == 1.0  # as `agentrl.eval.bench.success` reads a trajectory
            total = sum(t["reward"] for t in turns)
            return _Episode(task_id=task, status="finished", outcome=total, success=success, turns=turns)
        messages += answer_messages(message, obs)
