"""The session gateway: an OpenAI-compatible endpoint per agent episode, recording every call token-exactly.

A training run hands each episode of an agent written outside agentrl (the OpenAI SDK, LangChain, its own loop)
a base URL and a key of its own: `http://HOST:PORT/sessions/{id}/v1`. The agent talks to the policy only
through it (`POST …/chat/completions`, `GET …/models`), and every call records into the episode's `Trajectory`:
its prompt ids, the completion ids, the engine's logprobs and the policy version per token.

- **Token-exact turns.** The gateway knows what it returned. A request is laid out as `agentrl serve` lays one
  out (`agentrl.rollout.chat_api`), finding the assistant messages of its history among the session's own
  replies in the order they were returned (unchanged: same content and calls): the recorded completion ids are
  reused, never re-encoded, also in a history that was rewritten and then goes on. When that layout extends the
  trajectory (its prefix is the trajectory, and something follows), the new messages' tokens are appended as an
  observation and the reply as the next turn.
- **Rewritten histories.** When the agent dropped, edited or summarised its history, the call is served (laid
  out the same way, from what it holds) and starts a new token sequence of the episode
  (`Trajectory.start_sequence`, reason `rewritten`): its prompt is context, its reply a turn trained there, and
  the earlier sequences keep what they hold. Such episodes are counted (`rollout/rewritten`).
- **Retries.** A request with the same `Idempotency-Key`, or the same body, as one the session answered is
  answered from the record, not sampled again (the SDK retries a timed-out call with the same body): the
  trajectory holds the reply the agent was given. A reply cut short (finish reason `abort`: the engine aborted
  it) is not recorded, and a retry of its request is sampled anew, as is one of a call whose client left while it
  was generated.
  An agent that wants a second sample of the same history asks in another session.
- **One at a time.** A session's calls are served in the order they arrive, one after the other (a turn follows
  the one before it). A group is G sessions; `n > 1` is refused.
- **Sampling.** The run's `rollout.sampling` decides how tokens are sampled: the loss trains the distribution
  the engine sampled from. A request's temperature, top_p and seed are not used; its max_tokens only lowers the
  turn's budget (`sampling.max_tokens`), and the episode's tokens are bounded by `max_episode_tokens`.
- **Sticky routing.** A session's requests carry its id as the engine's request id: a fleet sends a session's
  turns to the replica that holds its prefix in cache.
- **Keys.** Each session has its own key; a call with another key, or to another session's id, gets 401, to a
  closed or unknown session 404. The keys live in this process only (never in a trajectory, a run folder or the
  viewer). The gateway listens on loopback by default; bound elsewhere, the keys are what guard it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import secrets
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from agentrl.engine.base import ContextTooLong, Generation, InferenceEngine, SamplingParams
from agentrl.engine.protocol import ChatCompletion, ChatCompletionRequest, ChatMessage, ModelCard, ModelList
from agentrl.engine.server import error, listen, refuse_invalid, require_key
from agentrl.env.agents import MODEL
from agentrl.rollout.chat import ChatFormat
from agentrl.rollout.chat_api import ChatCompletions, ChatRequestError, Reply, answer, message_key
from agentrl.rollout.trajectory import SequenceReason, Trajectory

_SESSION_PATH = re.compile(r"^/sessions/([^/]+)/v1/")


@dataclass(frozen=True)
class SessionAccess:
    """What an agent is given: where its episode's model is, and the key to it."""

    session_id: str
    base_url: str
    api_key: str = field(repr=False)


@dataclass(eq=False)
class Session:
    """One episode's calls: its trajectory, the replies in it, and the answers by request."""

    id: str
    key: str = field(repr=False)
    trajectory: Trajectory
    seed: int
    replies: list[Reply] = field(default_factory=list)
    answered: dict[str, ChatCompletion] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    calls: int = 0
    retries: int = 0
    """calls answered from the record (a retry of one answered before)"""
    rewrites: int = 0
    """calls whose history was not the trajectory's current sequence extended: each started a sequence"""

    def finder(self) -> Callable[[int, ChatMessage], Reply | None]:
        """`ChatLayout.prompt_ids`'s `find` for one request: the reply an assistant message is, unchanged, searched
        among this session's replies from the one after the message before it (the first: from the first reply). A
        history holds its replies in the order they were returned, though not always from the first or one after
        the other: one summarised or cut, or one going on from a re-asked turn, skips some (the k-th message looked
        for at the k-th reply alone would be re-encoded, and its episode start a sequence at every later call)."""
        after = 0

        def find(k: int, m: ChatMessage) -> Reply | None:
            nonlocal after
            if m.role != "assistant":
                return None
            key, start = message_key(m), 0 if k == 0 else after
            i = next((i for i in range(start, len(self.replies)) if self.replies[i].key == key), None)
            if i is None:
                return None
            after = i + 1
            return self.replies[i]

        return find


class Gateway:
    """Sessions over one engine. `async with` starts the server (on `host`:`port`, 0: a free port) and stops it.

    `sampling`: the run's sampling; `max_episode_tokens`: an episode's budget (prompt, generated and observation
    tokens); `model_name`: what `/models` lists and a request may name."""

    def __init__(
        self,
        engine: InferenceEngine,
        chat: ChatFormat,
        *,
        sampling: SamplingParams,
        max_episode_tokens: int,
        model_name: str = MODEL,
        host: str = "127.0.0.1",
        port: int = 0,
        parser: str = "hermes",
    ) -> None:
        self.engine, self.sampling, self.max_episode_tokens = engine, sampling, max_episode_tokens
        self.host, self.port = host, port
        self.chat = ChatCompletions(engine, chat, model_name=model_name, parser=parser)
        self.sessions: dict[str, Session] = {}
        self.app = self._make_app()
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self.base_url = ""

    # -- sessions ---------------------------------------------------------------------

    def open(self, trajectory: Trajectory, seed: int = 0) -> SessionAccess:
        """A session recording into `trajectory` (empty); `seed` seeds its requests' sampling."""
        if trajectory.token_ids:
            raise ValueError("a session records from the first call: give it an empty trajectory")
        sid = secrets.token_hex(12)
        session = Session(id=sid, key=secrets.token_urlsafe(24), trajectory=trajectory, seed=seed)
        self.sessions[sid] = session
        return SessionAccess(sid, f"{self.base_url}/sessions/{sid}/v1", session.key)

    async def close_session(self, session_id: str) -> Session | None:
        """End a session: later calls get 404, and a call in flight is aborted. Returns it (None if unknown)."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            await self.engine.abort(session_id)
        return session

    # -- the server -------------------------------------------------------------------

    async def start(self) -> Gateway:
        if self._task is not None:
            return self
        sock = listen(self.host, self.port)
        host, port = sock.getsockname()[:2]
        self.base_url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        self._server = _Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises why it could not start
        return self

    async def close(self) -> None:
        for sid in list(self.sessions):
            await self.close_session(sid)
        if self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> Gateway:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _key_for(self, path: str) -> str | None:
        match = _SESSION_PATH.match(path)
        session = self.sessions.get(match.group(1)) if match else None
        return session.key if session else None

    def _make_app(self) -> FastAPI:
        app = FastAPI(title="agentrl gateway")
        app.state.running, app.state.stopping = set(), False
        refuse_invalid(app)
        require_key(app, self._key_for)

        @app.get("/sessions/{sid}/v1/models")
        async def models(sid: str) -> ModelList:
            return ModelList(data=[ModelCard(id=self.chat.model_name, max_model_len=self.engine.max_context)])

        @app.post("/sessions/{sid}/v1/chat/completions", response_model=None)
        async def chat_completions(sid: str, req: ChatCompletionRequest, request: Request) -> Response:
            session = self.sessions.get(sid)
            if session is None:  # closed while the body was read
                return error(404, f"session {sid} is closed", code="not_found")
            token = request.headers.get("idempotency-key") or hashlib.sha256(await request.body()).hexdigest()
            async with session.lock:
                if sid not in self.sessions:  # closed while it waited for the call before it
                    return error(404, f"session {sid} is closed", code="not_found")
                return await self._call(app, session, req, request, token)

        return app

    async def _call(
        self, app: FastAPI, s: Session, req: ChatCompletionRequest, request: Request, token: str
    ) -> Response:
        if (done := s.answered.get(token)) is not None:
            s.retries += 1
            return answer(done, req)
        traj = s.trajectory
        try:
            self.chat.check(req)
            prompt = self.chat.layout.prompt_ids(req.messages, self.chat.tools(req), s.finder())
            context = traj.context_ids
            n = len(context)
            # what the prompt shares with the context is repeated, the rest is new to the episode
            shared = next((i for i, (a, b) in enumerate(zip(prompt, context, strict=False)) if a != b), n)
            shared = min(shared, len(prompt))
            extends = n == 0 or (shared == n and len(prompt) > n and not traj.turn_open)
            grown = traj.episode_tokens + len(prompt) - shared
            room = min(self.max_episode_tokens - grown, self.engine.max_context - len(prompt))
            budget = min(self.sampling.max_tokens, req.token_limit or room, room)
            if budget < 1:
                raise ContextTooLong(
                    f"the prompt of {len(prompt)} tokens leaves no room in the episode's {self.max_episode_tokens}"
                )
            params = self.sampling.model_copy(
                update={
                    "max_tokens": budget,
                    "stop_token_ids": self.chat.chat.stop_token_ids,
                    "seed": zlib.crc32(f"{s.seed}/{len(prompt)}".encode()),
                }
            )
            self.engine.check_fits(len(prompt), params)
        except ChatRequestError as e:
            return error(e.status, str(e), e.param, code=e.code)
        except ContextTooLong as e:
            return error(400, str(e), "messages", code="context_length_exceeded")
        s.calls += 1

        def record(gen: Generation, completion: ChatCompletion, reply: Reply) -> None:
            if gen.finish_reason == "aborted" or s.id not in self.sessions:
                return  # not in the trajectory: nothing a retry must be given again
            s.answered[token] = completion
            if not traj.token_ids:
                traj.append_prompt(prompt)
            elif extends:
                traj.append_observation(prompt[n:])
            else:
                traj.start_sequence(prompt, SequenceReason.REWRITTEN, new=len(prompt) - shared)
                s.rewrites += 1
            traj.append_generation(gen)
            s.replies.append(reply)

        return await self.chat.respond(
            app, req, request, prompt, params, request_id=s.id, on_reply=record, live_stream=False
        )


class _Server(uvicorn.Server):
    """uvicorn in the driver's event loop: the driver's own signal handling stays as it is."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
