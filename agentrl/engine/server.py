"""An OpenAI-compatible HTTP server around any `InferenceEngine` (what `agentrl serve` runs).

Token ids in, token ids out, as vLLM serves them (the wire format is `agentrl.engine.protocol`):

- `GET /health`; `GET /v1/models` (with `max_model_len`, as vLLM reports it);
- `POST /v1/completions`: `prompt` is token ids; `choices[0].token_ids` (with `return_token_ids`),
  `.logprobs.token_logprobs` (with `logprobs: 0`), `.policy_versions` and `.policy_kv_versions`
  (always), `finish_reason` "stop" | "length" | "abort". With `stream: true`, server-sent events: a first chunk once the
  engine holds the request, one chunk per generated token, a last chunk with the finish
  reason, then `data: [DONE]`;
- `POST /agentrl/abort` {"request_id"}: the request ends early and its reply (or stream) carries
  the tokens made so far; a client that disconnects aborts its request too, discarding them;
- `POST /agentrl/weights` (body: a safetensors state dict; `?lora=1`: a LoRA adapter) installs new
  weights and returns the new policy version; `GET /agentrl/version`.

`agentrl.rollout.chat_api` adds `POST /v1/chat/completions` to this app (it renders chat templates, a job above
the engine layer). With an API key every endpoint but `GET /health` needs `Authorization: Bearer KEY`.

The engine contract hands over a request's tokens when it ends, so the token chunks of a
stream are sent together then. Logprobs keep the engine's `logprob_semantics`. Every error is
OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`; a request the server
refuses gets 400 with a message naming the field, as vLLM does.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from urllib.parse import urlsplit

import anyio
import safetensors.torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from agentrl.engine.base import ContextTooLong, Generation, InferenceEngine, SamplingParams
from agentrl.engine.config import is_loopback
from agentrl.engine.protocol import (
    AbortRequest,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PolicyVersion,
    Usage,
)

# The engine contract's finish reasons, as OpenAI / vLLM spell them.
FINISH = {"stop": "stop", "length": "length", "aborted": "abort"}


def create_app(
    engine: InferenceEngine,
    *,
    model_name: str,
    tokenizer: PreTrainedTokenizerBase | None = None,
    vocab_size: int | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The app; the caller owns `engine` and closes it after the server stops.

    tokenizer: only for the `text` fields of replies (generation never decodes).
    vocab_size: refuse prompt ids outside the vocabulary with a 400 (before the model sees them).
    api_key: every endpoint but GET /health needs `Authorization: Bearer KEY` (401 otherwise); without one, only
    requests to a loopback name and from no web page but a loopback one are answered (`_LoopbackOnly`).

    `await app.state.stop()` before shutting the server down: new requests get 503 and running
    ones are aborted, so their replies go out at once with the tokens made so far. Other routes
    (`agentrl.rollout.chat_api`'s) start their requests with `submit` so that this holds for them too.
    """
    app = FastAPI(title="agentrl serve")
    created = int(time.time())
    app.state.running = set()  # request ids the engine holds
    app.state.created = created

    async def stop() -> None:
        app.state.stopping = True
        for rid in list(app.state.running):
            await engine.abort(rid)

    app.state.stopping = False
    app.state.stop = stop
    if api_key is not None:
        require_key(app, lambda _: api_key, open_paths={"/health"})
    else:
        app.add_middleware(_LoopbackOnly)

    refuse_invalid(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created, max_model_len=engine.max_context)])

    @app.get("/agentrl/version")
    async def version() -> PolicyVersion:
        return PolicyVersion(version=engine.version, weight_updates=sorted(engine.capabilities.weight_updates))

    @app.post("/agentrl/abort")
    async def abort(body: AbortRequest) -> dict[str, str]:
        await engine.abort(body.request_id)
        return {}

    @app.post("/agentrl/weights", response_model=None)
    async def weights(request: Request, lora: bool = False) -> PolicyVersion | JSONResponse:
        data = await request.body()
        if not data:
            return error(400, "send the weights as the request body: safetensors bytes of a state dict")
        try:
            tensors = safetensors.torch.load(data)
        except Exception as e:  # safetensors raises its own error types for malformed bytes
            return error(400, f"the body is not a safetensors state dict: {e}")
        try:
            v = await (engine.update_weights(lora=tensors) if lora else engine.update_weights(tensors))
        except (ValueError, RuntimeError) as e:  # wrong keys or shapes (torch raises RuntimeError), no LoRA model
            return error(400, f"{type(e).__name__}: {e}")
        return PolicyVersion(version=v)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        if app.state.stopping:
            return error(503, "the server is shutting down")
        if req.model is not None and req.model != model_name:
            return error(404, f"model {req.model!r} is not served here; this server serves {model_name!r}", "model")
        if vocab_size is not None and (bad := [t for t in req.prompt if t >= vocab_size]):
            return error(400, f"prompt token ids {bad[:5]} are outside the vocabulary of {vocab_size}", "prompt")
        try:
            params = req.sampling_params()
            engine.check_fits(len(req.prompt), params)
        except ValidationError as e:
            return error(400, _describe(e.errors()))
        except ContextTooLong as e:
            return error(400, str(e), "max_tokens", code="context_length_exceeded")
        rid = req.request_id or uuid.uuid4().hex
        task = await submit(app, engine, req.prompt, params, rid)
        if isinstance(task, JSONResponse):
            return task
        reply = _Reply(req, rid, model_name, created, tokenizer)
        if req.stream:
            return StreamingResponse(reply.events(engine, task, request), media_type="text/event-stream")
        try:
            gen = await until_done(engine, task, rid, request)
        except Exception as e:
            return failed(e)
        if gen is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(reply.completion(gen).model_dump(mode="json"))

    return app


class _Reply:
    """Builds the reply objects of one request."""

    def __init__(
        self, req: CompletionRequest, rid: str, model: str, created: int, tokenizer: PreTrainedTokenizerBase | None
    ) -> None:
        self.req, self.rid, self.model, self.created, self.tokenizer = req, rid, model, created, tokenizer

    def completion(self, gen: Generation) -> Completion:
        choice = self._choice(gen, slice(None), self._decode(gen.token_ids), FINISH[gen.finish_reason], prompt=True)
        return self._wrap([choice], self._usage(gen))

    async def events(
        self, engine: InferenceEngine, task: asyncio.Future[Generation], request: Request
    ) -> AsyncIterator[str]:
        yield _sse(self._wrap([self._choice(None, prompt=True)]))
        try:
            gen = await until_done(engine, task, self.rid, request)
        except Exception as e:  # the status line has gone out: report the failure in the stream, as vLLM does
            yield _sse(_error_body(e))
            return
        if gen is None:
            return
        for i, text in enumerate(self._text_deltas(gen.token_ids)):
            yield _sse(self._wrap([self._choice(gen, slice(i, i + 1), text)]))
        yield _sse(self._wrap([self._choice(None, finish=FINISH[gen.finish_reason])]))
        if self.req.stream_options and self.req.stream_options.include_usage:  # a last chunk of its own, as OpenAI's
            yield _sse(self._wrap([], self._usage(gen)))
        yield "data: [DONE]\n\n"

    def _choice(
        self,
        gen: Generation | None,
        tokens: slice = slice(0),
        text: str = "",
        finish: str | None = None,
        *,
        prompt: bool = False,
    ) -> CompletionChoice:
        """The `tokens` of `gen` (None: no tokens); prompt: carry `prompt_token_ids` (vLLM sends them in a
        reply, or a stream's first chunk)."""
        ids = gen.token_ids[tokens] if gen else []
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = CompletionLogprobs(
                tokens=[self._token(t) for t in ids], token_logprobs=gen.logprobs[tokens] if gen else []
            )
        ids_out = self.req.return_token_ids
        return CompletionChoice(
            text=text,
            logprobs=logprobs,
            finish_reason=finish,
            policy_versions=gen.versions[tokens] if gen else [],
            policy_kv_versions=gen.kv_versions[tokens] if gen else [],
            token_ids=ids if ids_out else None,
            prompt_token_ids=self.req.prompt if ids_out and prompt else None,
        )

    def _token(self, t: int) -> str:
        if self.req.return_tokens_as_token_ids or self.tokenizer is None:
            return f"token_id:{t}"
        return self._decode([t])

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.req.skip_special_tokens)

    def _text_deltas(self, ids: list[int]) -> list[str]:
        """The text each token adds; a token ending inside a multi-byte character adds "" until it completes."""
        deltas, prefix, read = [], 0, 0
        for i in range(1, len(ids) + 1):
            before, now = self._decode(ids[prefix:read]), self._decode(ids[prefix:i])
            if len(now) > len(before) and not now.endswith("\ufffd"):
                deltas.append(now[len(before) :])
                prefix, read = read, i
            else:
                deltas.append("")
        return deltas

    def _usage(self, gen: Generation) -> Usage:
        n_prompt, n_out = len(self.req.prompt), len(gen.token_ids)
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)

    def _wrap(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=f"cmpl-{self.rid}", created=self.created, model=self.model, choices=choices, usage=usage)


async def submit(
    app: FastAPI, engine: InferenceEngine, prompt: list[int], params: SamplingParams, rid: str
) -> asyncio.Future[Generation] | JSONResponse:
    """Hand a request to the engine: its task, tracked so that `app.state.stop()` aborts it, or the error reply
    when the engine refused it at once (e.g. its request id is in flight already)."""
    task = asyncio.ensure_future(engine.generate(prompt, params, request_id=rid))
    await asyncio.sleep(0)  # engines register the request before their first await: an abort now finds it
    if task.done() and task.exception() is not None:
        return failed(task.exception())
    app.state.running.add(rid)
    task.add_done_callback(lambda _: app.state.running.discard(rid))
    return task


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket for uvicorn (`port` 0: a free one), its connections without Nagle's algorithm.

    asyncio turns Nagle off only on sockets whose protocol is IPPROTO_TCP, and `socket.create_server` makes them
    with protocol 0: uvicorn's reply, written in pieces, then waited for the client's delayed ACK. With the client
    in the server's own event loop (the gateway's agents) that cost ~40 ms on every request (measured: a bare
    FastAPI route answered in 44 ms, 0.8 ms with this). Accepted sockets inherit it."""
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def refuse_invalid(app: FastAPI) -> None:
    """A body that does not parse or validate gets 400 naming the field, OpenAI-shaped (FastAPI's own is a 422)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        # a body that is no JSON names no field (its loc holds the byte offset of the fault)
        param = None if first["type"] == "json_invalid" else ".".join(str(x) for x in first["loc"][1:]) or None
        return error(400, _describe(exc.errors()), param=param)


def require_key(app: FastAPI, key_for: Callable[[str], str | None], *, open_paths: Collection[str] = ()) -> None:
    """Every request to `app` but those to `open_paths` needs `Authorization: Bearer K`, K = `key_for(path)`
    (None: the path has no key, 404), compared in constant time; 401 otherwise, OpenAI-shaped."""
    app.add_middleware(_KeyCheck, key_for=key_for, open_paths=frozenset(open_paths))


class _KeyCheck:
    """`require_key`'s check, as plain ASGI middleware: Starlette's `BaseHTTPMiddleware` (what `@app.middleware`
    makes) relays every response through a stream of its own, which cost each request ~40 ms here."""

    def __init__(self, app: ASGIApp, key_for: Callable[[str], str | None], open_paths: frozenset[str]) -> None:
        self.app, self.key_for, self.open_paths = app, key_for, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.open_paths:
            return await self.app(scope, receive, send)
        key = self.key_for(path)
        if key is None:
            return await error(404, f"nothing is served at {path}", code="not_found")(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            message = "a valid API key is required: send `Authorization: Bearer KEY`"
            return await error(401, message, code="invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)


class _LoopbackOnly:
    """A keyless server's guard against the web pages a browser of this machine opens, which can send requests to
    127.0.0.1 too: under a DNS name of their own rebound there (only the Host names it: refused, 400), or straight
    to it as cross-origin requests a page needs no CORS answer to send (a POST of bytes without a content type
    installs weights; only the Origin tells it apart: refused, 403). Clients that are no browser send no Origin."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        if not is_loopback(_hostname(f"//{host}")):
            reply = error(
                400, f"Host {host!r} is not this machine: a server without a key answers loopback names alone"
            )
        elif origin is not None and not is_loopback(_hostname(origin.decode("latin-1"))):
            reply = error(403, "requests from web pages are refused: give the server a key (--api-key) to serve them")
        else:
            return await self.app(scope, receive, send)
        await reply(scope, receive, send)


def _hostname(url: str) -> str | None:
    try:
        return urlsplit(url).hostname
    except ValueError:  # e.g. an unclosed "[" of an IPv6 literal
        return None


ABORT_WAIT_S = 30.0
"""how long an aborted request is waited for (an engine ends it at its next step)"""


async def until_done(
    engine: InferenceEngine, task: asyncio.Future[Generation], rid: str, request: Request
) -> Generation | None:
    """The request's Generation, or None when the client disconnected first.

    Whenever this returns or raises before the engine finished (client gone, handler cancelled),
    the engine request is aborted: no decode steps are spent on a reply nobody reads.
    """
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task in done else None
    finally:
        watcher.cancel()
        if not task.done():
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its partial result is not read
            with anyio.CancelScope(shield=True):
                await engine.abort(rid)
                # until the engine lets it go: the caller's next request may carry the same id (a gateway session's
                # next call), which the engine refuses while this one is in flight
                await asyncio.wait({task}, timeout=ABORT_WAIT_S)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read already, so the next ASGI message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: Completion | ErrorResponse) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


def error(status: int, message: str, param: str | None = None, *, code: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error reply."""
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    kind = kind if status < 500 else "internal_error"
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(mode="json"), status_code=status)


def _error_body(e: BaseException) -> ErrorResponse:
    kind = "invalid_request_error" if isinstance(e, ValueError) else "internal_error"
    return ErrorResponse(error=ErrorInfo(message=f"{type(e).__name__}: {e}", type=kind))


def failed(e: BaseException) -> JSONResponse:
    """A request the engine raised on: its ValueErrors (a request id already in flight, ...) are the client's."""
    return JSONResponse(_error_body(e).model_dump(mode="json"), status_code=400 if isinstance(e, ValueError) else 500)


def _describe(errors: list[dict]) -> str:
    """Pydantic's errors as one line, each led by the field it is about."""
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e["loc"] if x != "body")
        parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return "; ".join(parts)
