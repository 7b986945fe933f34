"""The plumbing the in-process engines (`hf`, `vllm`) share: requests served by one loop thread.

asyncio callers submit a `Request`; a daemon thread takes the waiting ones, runs one engine
step at a time while holding `_lock` (so `update_weights`, taking the same lock, lands between
two steps), and resolves each request's future on the caller's own loop. A failure inside the
loop fails every request in flight, and every later one, instead of leaving them waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from abc import abstractmethod
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from agentrl.engine.base import FinishReason, Generation, InferenceEngine, SamplingParams


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Generation]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_versions: list[int] = field(default_factory=list)  # per token: the oldest version in the KV it was sampled over
    routed: list[list[list[int]]] | None = None  # per generated token, per layer: the experts chosen
    prompt_routing: list[list[list[int]]] | None = None  # per prompt position but the last: the experts chosen
    aborted: bool = False
    finish: FinishReason | None = None


class ThreadedEngine(InferenceEngine):
    """Subclasses set `thread_name` and implement `_new_request`, `_busy` and `_step`."""

    thread_name: ClassVar[str]

    def __init__(self, max_context: int, *, version: int = 0) -> None:
        self._max_context = max_context
        self._version = version  # a resumed run continues its count
        self._lock = threading.Lock()  # held by every engine step and every weight update
        self._cv = threading.Condition()  # guards _waiting, _closed, _error
        self._waiting: deque[Request] = deque()
        self._by_id: dict[str, Request] = {}  # every request not yet resolved
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: BaseException | None = None

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    @contextlib.contextmanager
    def paused(self, *, new_version: bool = False) -> Iterator[None]:
        """No engine step runs inside this block (capabilities.pausable). `new_version`: the block changes the
        shared module's weights, and the next policy version begins as it ends (unless it raised), before any step:
        a step between the block and a later `update_weights()` would sample the new weights under the old version."""
        with self._lock:
            yield
            if new_version:
                self._next_version()

    def _next_version(self) -> int:
        """The weights changed (under the step lock): later tokens carry the next version."""
        self._version += 1
        return self._version

    # -- hooks (engine thread unless said otherwise) ---------------------------------

    @abstractmethod
    def _new_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> Request:
        """A request of the subclass's own type (called on the caller's loop)."""

    @abstractmethod
    def _busy(self) -> bool:
        """True while the engine holds requests it is generating for."""

    @abstractmethod
    def _step(self, new: list[Request]) -> None:
        """Admit `new`, run one engine step, `_resolve` the requests that finished."""

    def _take(self) -> list[Request]:
        """The waiting requests to admit now (all of them, unless a subclass bounds its batch)."""
        new = list(self._waiting)
        self._waiting.clear()
        return new

    # -- requests --------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None
    ) -> Generation:
        self.check_fits(len(prompt_ids), params)
        loop = asyncio.get_running_loop()
        req = self._new_request(request_id or uuid.uuid4().hex, list(prompt_ids), params, loop)
        with self._cv:
            if self._error is not None:
                raise RuntimeError(f"the engine's decode loop failed: {self._error!r}") from self._error
            if self._closed:
                raise RuntimeError("engine is closed")
            if req.id in self._by_id:
                raise ValueError(f"request id {req.id!r} is already in flight")
            self._by_id[req.id] = req
            self._waiting.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
                self._thread.start()
            self._cv.notify()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.aborted = True  # the loop drops it at its next step
            raise

    async def abort(self, request_id: str) -> None:
        req = self._by_id.get(request_id)
        if req is not None:
            req.aborted = True
            with self._cv:
                self._cv.notify()

    async def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # -- the loop --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._waiting or self._busy() or self._closed):
                        self._cv.wait()
                    if self._closed:
                        break
                with self._lock:  # taken under the step lock: what queued during a pause enters together
                    with self._cv:
                        new = self._take()
                    self._step(new)
        except BaseException as e:
            with self._cv:
                self._error = e
        with self._cv:
            pending = list(self._by_id.values())
        for req in pending:
            self._resolve(req, error=self._error or RuntimeError("engine closed"))

    def _resolve(self, req: Request, finish: FinishReason | None = None, error: BaseException | None = None) -> None:
        """Hand `req`'s result (or `error`) to its caller; `finish` overrides `req.finish`."""
        self._by_id.pop(req.id, None)
        req.finish = finish or req.finish or "aborted"
        result = (
            None
            if error
            else Generation(
                req.tokens,
                req.logprobs,
                req.versions,
                req.finish,
                len(req.prompt),
                routed_experts=req.routed,
                prompt_routing=req.prompt_routing,
                kv_versions=req.kv_versions,
            )
        )

        def settle() -> None:
            if req.future.done():
                return
            if error is not None:
                req.future.set_exception(error)
            else:
                req.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is waiting
            req.loop.call_soon_threadsafe(settle)
