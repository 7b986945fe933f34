"""OpenAI chat completions over a token engine: messages in, the model's own tokens out.

`agentrl serve` answers `POST /v1/chat/completions` with `ChatCompletions`, and a training run's session
gateway (`agentrl.rollout.gateway`) with the same pieces. A request is laid out in token ids as a rollout lays
a conversation out (`ChatFormat`):

- the opening messages, up to the first assistant message this server wrote, rendered with the model's chat
  template and the request's `tools`;
- each assistant message this server wrote: the very token ids it generated, found by its tool calls' ids or
  by its content (`ReplyBook`), never re-rendered or re-encoded;
- the messages after each: the template's delta (`ChatFormat.observation_ids`), the last one ending with the
  generation prompt.

So a conversation held through this endpoint gives the model exactly the tokens an agentrl rollout of it
would. A history with an assistant message the server did not write (or no longer remembers) is rendered
whole by the template instead, each assistant message's tool calls written into its content in the model's
own format (the parser's `format`), as the model writes them.

A reply's text (special tokens kept, the final stop token dropped) is parsed with the model's tool-call
parser (Hermes): its calls become `tool_calls` (ids `call_…`, arguments as JSON text), the rest `content`,
and the finish reason is `tool_calls`. A reply whose calls cannot be read comes back whole as `content`,
without `tool_calls`: the agent reads what its model wrote, and it is the agent's error, never the server's.
A `<think>` part stays in `content` (there is no reasoning parser).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentrl.engine.base import ContextTooLong, Generation, InferenceEngine, SamplingParams
from agentrl.engine.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatDeltaToolCall,
    ChatFunction,
    ChatLogprobs,
    ChatMessage,
    ChatReplyMessage,
    ChatTokenLogprob,
    ChatToolCall,
    ErrorInfo,
    ErrorResponse,
    Usage,
)
from agentrl.engine.server import error, failed, submit, until_done
from agentrl.env.base import Message
from agentrl.env.parsers import ToolCallParser, get_parser, not_text
from agentrl.env.tools import ToolCall
from agentrl.models.tokenizer import token_bytes
from agentrl.rollout.chat import ChatFormat

ROLES = ("system", "developer", "user", "assistant", "tool")
FINISH = {"stop": "stop", "length": "length", "aborted": "abort"}
BOOK_REPLIES = 65536
"""replies `agentrl serve` remembers for laying out later requests token-exactly; the least recently used go"""


class ChatRequestError(ValueError):
    """A request refused before the model: 400 (404 for a model not served), OpenAI-shaped, `param` naming the
    field."""

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def check_messages(messages: list[ChatMessage]) -> None:
    """Roles known, in an order a chat can have; every `tool` message answers a call of the assistant message
    before it; the last message is not the assistant's (continuing one is not supported)."""
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ChatRequestError(f"messages[{i}].role {m.role!r} is not one of {list(ROLES)}", f"messages.{i}.role")
        if m.tool_calls and m.role != "assistant":
            raise ChatRequestError(f"messages[{i}]: only assistant messages make tool calls", f"messages.{i}")
    if messages[0].role not in ("system", "developer", "user"):
        raise ChatRequestError(
            f"messages[0] is a {messages[0].role} message: a chat opens with a system, developer or user message",
            "messages.0.role",
        )
    calls: set[str] = set()  # the ids of the calls the last assistant message made
    for i, m in enumerate(messages):
        if m.role == "assistant":
            calls = {c.id for c in m.tool_calls or []}
            for j, c in enumerate(m.tool_calls or []):
                _arguments(c, f"messages.{i}.tool_calls.{j}")
        elif m.role == "tool":
            if m.tool_call_id is None:
                raise ChatRequestError(
                    f"messages[{i}] is a tool message without tool_call_id: name the call it answers",
                    f"messages.{i}.tool_call_id",
                )
            if m.tool_call_id not in calls:
                raise ChatRequestError(
                    f"messages[{i}] answers tool call {m.tool_call_id!r}, which the assistant message before it did "
                    "not make",
                    f"messages.{i}.tool_call_id",
                )
        else:
            calls = set()
    if messages[-1].role == "assistant":
        raise ChatRequestError(
            "the last message is the assistant's: send the next user or tool message (continuing an assistant "
            "message is not supported)",
            f"messages.{len(messages) - 1}",
        )


def _arguments(call: ChatToolCall, param: str) -> dict[str, Any]:
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as e:
        raise ChatRequestError(
            f"{param}: the arguments are not JSON ({e.msg})", f"{param}.function.arguments"
        ) from None
    if not isinstance(args, dict):
        raise ChatRequestError(f"{param}: the arguments are not a JSON object", f"{param}.function.arguments")
    return args


def _encodable(value: Any, param: str) -> None:
    """Refuse a value that is no text (`not_text`: a lone UTF-16 surrogate, as an unpaired `\\ud800` escape
    makes), which the tokenizer would fail on with a 500."""
    if (why := not_text(value)) is not None:
        raise ChatRequestError(
            f"{param} is not text: {why}; send valid Unicode (decode bytes with errors='replace')", param
        )


def reply_key(content: str, calls: list[ToolCall]) -> str:
    """What an assistant message says, in one string: its content and its calls (arguments compared as JSON)."""
    return json.dumps([content.strip(), [[c.name, c.arguments] for c in calls]], sort_keys=True)


def message_key(m: ChatMessage) -> str:
    calls = [ToolCall(name=c.function.name, arguments=_arguments(c, "tool_call")) for c in m.tool_calls or []]
    return reply_key(m.text, calls)


@dataclass(frozen=True)
class Reply:
    """One assistant message a server wrote: the token ids it generated, and what it said (`key`: the `message_key` of
    a message that is this reply unchanged, the same content and calls, ids aside: a client may drop them)."""

    ids: list[int]
    key: str
    call_ids: tuple[str, ...]


class ReplyBook:
    """The replies a server returned, by their tool calls' ids and by content, the least recently used forgotten
    past `capacity`: what lets a later request's history be laid out with the tokens the model generated."""

    def __init__(self, capacity: int = BOOK_REPLIES) -> None:
        self.capacity = capacity
        self._by_key: OrderedDict[str, Reply] = OrderedDict()
        self._by_call: dict[str, Reply] = {}

    def add(self, reply: Reply) -> None:
        if (same := self._by_key.pop(reply.key, None)) is not None:
            self._forget(same)  # the same words again (greedy replies): the newest stands for both, the old goes
        self._by_key[reply.key] = reply
        self._by_call.update(dict.fromkeys(reply.call_ids, reply))
        while len(self._by_key) > self.capacity:
            self._forget(self._by_key.popitem(last=False)[1])

    def _forget(self, reply: Reply) -> None:
        for cid in reply.call_ids:
            self._by_call.pop(cid, None)

    def find(self, m: ChatMessage) -> Reply | None:
        """The reply `m` is, unchanged: looked up by its first call's id, else by its content."""
        key = message_key(m)
        reply = next((self._by_call[c.id] for c in m.tool_calls or [] if c.id in self._by_call), None)
        reply = reply or self._by_key.get(key)
        if reply is not None and reply.key == key:
            self._by_key.move_to_end(reply.key)
            return reply
        return None


class ChatLayout:
    """Requests as token ids, replies as messages, for one model's chat template and tool-call parser."""

    def __init__(self, chat: ChatFormat, parser: ToolCallParser) -> None:
        self.chat, self.parser = chat, parser

    def prompt_ids(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        find: Callable[[int, ChatMessage], Reply | None],
    ) -> list[int]:
        """The request's prompt (see the module doc). `find(k, m)`: the reply `m` is, as the k-th assistant message
        of the conversation after its opening (a session finds in the order it replied, `agentrl serve` by its book)."""
        plain = [self._plain(m) for m in messages]
        found = ((i, find(0, m)) for i, m in enumerate(messages) if m.role == "assistant")
        first, reply = next(((i, r) for i, r in found if r is not None), (None, None))
        if first is None:
            return self.chat.prompt_ids(plain, tools=tools)
        ids = self.chat.prompt_ids(plain[:first], tools=tools)
        k, i = 0, first
        while i < len(messages):
            reply = reply if k == 0 else find(k, messages[i])
            if reply is None:  # a message it did not write, after one it did: the template renders it all
                return self.chat.prompt_ids(plain, tools=tools)
            ids = ids + reply.ids
            j = next((j for j in range(i + 1, len(messages)) if messages[j].role == "assistant"), len(messages))
            ids += self.chat.observation_ids(plain[i + 1 : j], last_token=ids[-1])
            k, i = k + 1, j
        return ids

    def _plain(self, m: ChatMessage) -> Message:
        """`m` as the template takes it: system for developer, tool calls written into an assistant's content."""
        text = m.text
        if m.tool_calls:
            calls = [
                self.parser.format(ToolCall(name=c.function.name, arguments=_arguments(c, "tool_call")))
                for c in m.tool_calls
            ]
            text = "\n".join([text, *calls]) if text else "\n".join(calls)
        out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
        return out

    def read(self, ids: list[int]) -> tuple[ChatReplyMessage, Reply]:
        """What the model wrote, as a reply message, and the record of it."""
        text = self.chat.decode(ids)
        parsed = self.parser.parse(text)
        if parsed.errors or not parsed.calls:
            return ChatReplyMessage(content=text), Reply(list(ids), reply_key(text, []), ())
        calls = [
            ChatToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=ChatFunction(name=c.name, arguments=json.dumps(c.arguments)),
            )
            for c in parsed.calls
        ]
        message = ChatReplyMessage(content=parsed.content or None, tool_calls=calls)
        return message, Reply(list(ids), reply_key(parsed.content, parsed.calls), tuple(c.id for c in calls))


class ChatCompletions:
    """`POST /v1/chat/completions` for one engine and model (see the module doc); `add_routes` mounts it.

    `prompt(req)` lays a request out with this server's `ReplyBook`; a session gateway lays it out its own way
    and calls `respond` with the ids."""

    def __init__(self, engine: InferenceEngine, chat: ChatFormat, *, model_name: str, parser: str = "hermes") -> None:
        self.engine, self.chat, self.model_name = engine, chat, model_name
        self.layout = ChatLayout(chat, get_parser(parser))
        self.book = ReplyBook()
        # No token holds more characters than the longest in the vocabulary: a request with more characters than
        # that many times the context cannot fit, and is refused before the template or the tokenizer reads it.
        self._chars_per_token = max(len(t) for t in chat.tokenizer.get_vocab())

    def check(self, req: ChatCompletionRequest, model_name: str | None = None) -> None:
        """Refuse what cannot be served (raises ChatRequestError): another model, messages out of order, a
        request longer than any context."""
        name = model_name or self.model_name
        if req.model is not None and req.model != name:
            raise ChatRequestError(
                f"model {req.model!r} is not served here; this server serves {name!r}",
                "model",
                code="model_not_found",
                status=404,
            )
        check_messages(req.messages)
        for i, m in enumerate(req.messages):
            _encodable(m.model_dump(exclude_none=True), f"messages.{i}")
        _encodable([t.model_dump() for t in req.tools or []], "tools")
        chars = sum(len(m.text) for m in req.messages) + len(json.dumps([t.function for t in req.tools or []]))
        if chars > self.engine.max_context * self._chars_per_token:
            raise ChatRequestError(
                f"the messages hold {chars} characters, more than a context of {self.engine.max_context} tokens can",
                "messages",
                code="context_length_exceeded",
            )

    def tools(self, req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
        if not req.tools or req.tool_choice == "none":
            return None
        return [t.model_dump() for t in req.tools]

    def prompt(self, req: ChatCompletionRequest) -> list[int]:
        return self.layout.prompt_ids(req.messages, self.tools(req), lambda _k, m: self.book.find(m))

    def params(self, req: ChatCompletionRequest, prompt_len: int, *, limit: int | None = None) -> SamplingParams:
        """The request's sampling; `max_tokens` defaults to what the context (or `limit`) leaves."""
        room = min(self.engine.max_context, limit or self.engine.max_context) - prompt_len
        if room < 1:
            raise ContextTooLong(
                f"the prompt of {prompt_len} tokens leaves no room in a context of {room + prompt_len}"
            )
        return SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            max_tokens=min(req.token_limit or room, room),
            stop_token_ids=self.chat.stop_token_ids,
            seed=req.seed,
        )

    async def respond(
        self,
        app: FastAPI,
        req: ChatCompletionRequest,
        request: Request,
        prompt: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        on_reply: Callable[[Generation, ChatCompletion, Reply], None] = lambda *_: None,
        live_stream: bool = True,
    ) -> Response:
        """Generate and answer (JSON, or a stream); `on_reply` sees what was generated before the answer goes.
        live_stream: a stream's first chunk goes once the engine holds the request; False: once it is done (so the
        caller's work around `respond` spans the generation)."""
        cid = uuid.uuid4().hex  # the completion's own id: a session's requests share one engine request id
        rid = request_id or cid
        created = int(time.time())
        task = await submit(app, self.engine, prompt, params, rid)
        if isinstance(task, JSONResponse):
            return task

        def finish(gen: Generation) -> ChatCompletion:
            completion, reply = self.completion(gen, req, prompt, cid, created)
            on_reply(gen, completion, reply)
            return completion

        if req.stream and live_stream:

            async def events() -> AsyncIterator[str]:
                yield _sse(
                    ChatCompletionChunk(
                        id=f"chatcmpl-{cid}",
                        created=created,
                        model=self.model_name,
                        choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))],
                    )
                )
                try:
                    gen = await until_done(self.engine, task, rid, request)
                except Exception as e:  # the status line has gone: report in the stream, as vLLM does
                    yield _sse(
                        ErrorResponse(error=ErrorInfo(message=f"{type(e).__name__}: {e}", type="internal_error"))
                    )
                    return
                if gen is not None:
                    for text in stream_events(finish(gen), req, first=False):
                        yield text

            return StreamingResponse(events(), media_type="text/event-stream")
        try:
            gen = await until_done(self.engine, task, rid, request)
        except Exception as e:
            return failed(e)
        if gen is None:
            return Response(status_code=499)  # the client is gone
        return answer(finish(gen), req)

    def completion(
        self, gen: Generation, req: ChatCompletionRequest, prompt: list[int], cid: str, created: int
    ) -> tuple[ChatCompletion, Reply]:
        message, reply = self.layout.read(gen.token_ids)
        finish = FINISH[gen.finish_reason]
        if finish == "stop" and message.tool_calls:
            finish = "tool_calls"
        logprobs = None
        if req.logprobs:
            # each token's own bytes, a piece of a character too (joined, they are the exact text, as OpenAI's are);
            # its text is theirs, a piece that is no UTF-8 escaped as OpenAI writes it (`\xe2\x9c`)
            raw = token_bytes(self.chat.tokenizer, gen.token_ids)
            logprobs = ChatLogprobs(
                content=[
                    ChatTokenLogprob(token=b.decode("utf-8", "backslashreplace"), logprob=lp, bytes=list(b))
                    for b, lp in zip(raw, gen.logprobs, strict=True)
                ]
            )
        choice = ChatChoice(
            message=message,
            finish_reason=finish,
            logprobs=logprobs,
            token_ids=gen.token_ids if req.return_token_ids else None,
            policy_versions=gen.versions,
            policy_kv_versions=gen.kv_versions,
        )
        n_prompt, n_out = len(prompt), len(gen.token_ids)
        completion = ChatCompletion(
            id=f"chatcmpl-{cid}",
            created=created,
            model=self.model_name,
            choices=[choice],
            usage=Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out),
            prompt_token_ids=prompt if req.return_token_ids else None,
        )
        return completion, reply

    def add_routes(self, app: FastAPI) -> None:
        """`POST /v1/chat/completions` on `app` (made by `agentrl.engine.server.create_app`)."""

        @app.post("/v1/chat/completions", response_model=None)
        async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
            if app.state.stopping:
                return error(503, "the server is shutting down")
            try:
                self.check(req)
                prompt = self.prompt(req)
                params = self.params(req, len(prompt))
                self.engine.check_fits(len(prompt), params)
            except ChatRequestError as e:
                return error(e.status, str(e), e.param, code=e.code)
            except ContextTooLong as e:
                return error(400, str(e), "messages", code="context_length_exceeded")
            # the book is this route's alone: a gateway finds replies in their session, and would only fill it
            return await self.respond(
                app, req, request, prompt, params, on_reply=lambda _gen, _completion, reply: self.book.add(reply)
            )


def answer(completion: ChatCompletion, req: ChatCompletionRequest) -> Response:
    """A finished completion as the request asked for it: one JSON body, or a whole stream at once."""
    if req.stream:
        return StreamingResponse(iter(list(stream_events(completion, req, first=True))), media_type="text/event-stream")
    return JSONResponse(completion.model_dump(mode="json", exclude_none=True))


def stream_events(completion: ChatCompletion, req: ChatCompletionRequest, *, first: bool) -> list[str]:
    """A completion as server-sent events: (with `first`, the role chunk), the content, the tool calls, the finish
    reason, (when `stream_options.include_usage`, `usage` in a chunk without choices, as OpenAI sends it), then
    [DONE]. Token-level fields ride on the content chunk."""
    choice = completion.choices[0]

    def chunk(c: ChatChunkChoice | None, **kw: Any) -> str:
        choices = [] if c is None else [c]
        return _sse(
            ChatCompletionChunk(
                id=completion.id, created=completion.created, model=completion.model, choices=choices, **kw
            )
        )

    events = [chunk(ChatChunkChoice(delta=ChatDelta(role="assistant", content="")))] if first else []
    events.append(
        chunk(
            ChatChunkChoice(
                delta=ChatDelta(content=choice.message.content or ""),
                logprobs=choice.logprobs,
                token_ids=choice.token_ids,
                policy_versions=choice.policy_versions,
                policy_kv_versions=choice.policy_kv_versions,
            ),
            prompt_token_ids=completion.prompt_token_ids,
        )
    )
    for i, call in enumerate(choice.message.tool_calls or []):
        delta = ChatDelta(tool_calls=[ChatDeltaToolCall(index=i, id=call.id, type="function", function=call.function)])
        events.append(chunk(ChatChunkChoice(delta=delta)))
    events.append(chunk(ChatChunkChoice(delta=ChatDelta(), finish_reason=choice.finish_reason)))
    if req.stream_options and req.stream_options.include_usage:
        events.append(chunk(None, usage=completion.usage))
    events.append("data: [DONE]\n\n")
    return events


def _sse(obj: ChatCompletionChunk | ErrorResponse) -> str:
    return f"data: {obj.model_dump_json(exclude_none=True)}\n\n"
