"""`openai` engine: any OpenAI-compatible completions server (agentrl serve, vLLM, ...) over httpx.

Token ids go in as the `prompt`; token ids come back as `choices[].token_ids` (vLLM's
`return_token_ids`, >= 0.10.2) or, from older servers, parsed from "token_id:N" strings
(`return_tokens_as_token_ids`), never by re-encoding text. Requests always stream, so that
`abort` can end one and still return the tokens it has.

Every sampling setting is sent explicitly, including the neutral `repetition_penalty`,
`min_p` and `ignore_eos`: a vLLM server otherwise fills unset fields from the model's
generation_config, which would change the distribution tokens are drawn from.

Failures: connection errors, timeouts and 5xx replies are retried with exponential backoff
(a retried request starts over); a 4xx reply raises at once with the server's message
(`ContextTooLong` for a context overflow, else `RequestRejected`); no answer after every
retry raises `ServerUnavailable`.

The two kinds of server differ in how weights reach them, which model a request names and how a request
is aborted: each is a `ServerDialect`, chosen once when the engine connects (`server_dialect`; `server`:
agentrl, vllm, or auto: agentrl when it answers GET /agentrl/version):
- `AgentrlServe` (agentrl serve): the tensors are uploaded (safetensors) to POST /agentrl/weights; an aborted
  request is ended by the server (POST /agentrl/abort), which sends the tokens made so far.
- `VLLMServe` (`vllm serve`, >= 0.16.0): each update is written into `weights_dir`, a folder the server sees at
  the same path (a shared filesystem), and loaded through vLLM's documented endpoints.
  A LoRA adapter is written in peft's format and loaded under a new name per version
  (POST /v1/load_lora_adapter; vLLM started with --enable-lora, a big enough --max-lora-rank, and
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); later requests name it as their `model` and the previous
  one is unloaded (/v1/unload_lora_adapter), while requests in flight finish with the adapter they
  were sent with. Full weights are written as a safetensors checkpoint (the checkpoint's layout) and
  reloaded in place between two engine steps: POST /pause?mode=keep, POST /collective_rpc
  {"method": "reload_weights", "kwargs": {"weights_path": DIR}} (the worker's reload_weights takes
  weights_path since vLLM 0.16.0), POST /reset_prefix_cache?reset_running_requests=true (no KV of the
  old weights is reused, requests in flight recompute theirs), POST /resume; these need the server
  started with VLLM_SERVER_DEV_MODE=1. Nothing goes over NCCL or needs a GPU here. (vLLM's own weight
  transfer endpoints, /init_weight_transfer_engine and /update_weights, carry only the control messages:
  the tensors go over NCCL or CUDA IPC between the trainer's GPU and the server's.) An aborted request's
  stream is closed, which makes the server abort it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import torch
from pydantic import BaseModel

from agentrl.engine.base import (
    Capabilities,
    ContextTooLong,
    FinishReason,
    Generation,
    InferenceEngine,
    SamplingParams,
)
from agentrl.engine.config import EngineConfig, EngineModel
from agentrl.engine.protocol import (
    CollectiveRpc,
    Completion,
    CompletionChoice,
    CompletionRequest,
    LoadLoraAdapter,
    ModelList,
    PolicyVersion,
    UnloadLoraAdapter,
)
from agentrl.models.layout import checkpoint_layout, meta_model_at

MAX_BACKOFF_S = 8.0
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "aborted"}

ServerKind = Literal["auto", "agentrl", "vllm"]

NO_WEIGHTS_DIR = (
    "{url} is a vLLM server, which reads weights from files: set engine.weights_dir (OpenAIEngine(weights_dir=)) to "
    "a folder it sees at the same path, or load them the server's own way and call update_weights() with no "
    "arguments to bump this engine's policy version"
)
# What a vLLM server must be started with for the endpoints that do not exist otherwise.
_VLLM_NEEDS = {
    "/v1/load_lora_adapter": "--enable-lora and the environment VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
    "/v1/unload_lora_adapter": "--enable-lora and the environment VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
    "/pause": "the environment VLLM_SERVER_DEV_MODE=1 (vLLM >= 0.16.0)",
    "/collective_rpc": "the environment VLLM_SERVER_DEV_MODE=1",
    "/reset_prefix_cache": "the environment VLLM_SERVER_DEV_MODE=1",
    "/resume": "the environment VLLM_SERVER_DEV_MODE=1",
}


class RequestRejected(ValueError):
    """The server refused the request (HTTP 4xx); retrying it unchanged would not help."""


class ServerError(RuntimeError):
    """The server failed: a 5xx reply after every retry, an error inside a stream, or a malformed reply."""


class ServerUnavailable(ConnectionError):
    """No answer from the server after every retry."""


class _Retryable(ServerError):
    """A 5xx reply: the next attempt may succeed."""


@dataclass(eq=False)
class _Pending:
    """One request as received so far."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_versions: list[int] = field(default_factory=list)
    sent: int = 0
    """this engine's policy version when the current attempt was sent"""
    finish: str | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    """set once the server has sent a chunk: it holds the request"""
    aborted: bool = False
    task: asyncio.Task[None] | None = None
    """the current attempt (one streaming POST)"""

    def restart(self, version: int) -> None:
        self.tokens, self.logprobs, self.versions, self.kv_versions, self.finish = [], [], [], [], None
        self.sent = version
        self.started.clear()


class OpenAIEngine(InferenceEngine):
    """A client of one server. `await engine.connect()` learns the model, `max_context` and, from
    `agentrl serve`, the policy version; `generate` connects on its first call.

    base_url: the server, with or without the trailing `/v1`.
    model: the served model to ask for; None takes the first in `/v1/models`.
    server: agentrl (agentrl serve), vllm (`vllm serve`), or auto: agentrl when it answers GET
        /agentrl/version, else vllm. It chooses the `ServerDialect` (see the module's doc).
    weights_dir: vllm: where updates are written for the server to load (the same path on both
        sides); None: this engine takes no tensors, `update_weights()` only moves its version.
    policy: vllm: the policy's checkpoint folder (`path`: full weights are written in its layout, the
        adapter config for its model) and its LoRA settings (`lora`: needed for adapter updates).
    version: vllm: the policy version to start from (agentrl serve reports its own).
    timeout_s: the longest wait for a connection or for the next bytes of a reply (agentrl
        serve sends a request's tokens when it ends: keep it above the longest generation).
    max_retries: further attempts after a connection error, timeout or 5xx reply.
    max_context: the context length; None reads `max_model_len` from `/v1/models`.
    api_key: sent as `Authorization: Bearer KEY` on every request (agentrl serve --api-key, vllm serve --api-key).

    Policy versions: each token carries the server's `policy_versions` and `policy_kv_versions` when it
    sends them (agentrl serve), else, for both, this engine's own version when the request was sent
    (the server's can only be newer): the counter that this engine's weight updates move, and that
    `update_weights()` with no arguments bumps after a foreign server's weights were changed its own way.
    """

    name = "openai"
    logprob_semantics = (
        "the server's. agentrl serve: agentrl.engine.sampling's, log q(y) with q = softmax(top_p(top_k(logits / T))) "
        "renormalised, greedy: softmax(logits). vLLM: the same only when started with "
        "`--logprobs-mode processed_logprobs` (vLLM >= 0.10.2); its default, raw_logprobs, is softmax(logits) "
        "before temperature, top-k and top-p"
    )
    # The flag and its choices (raw_logprobs (default), raw_logits, processed_logprobs, processed_logits)
    # were checked against vLLM's engine-argument docs and its v1 Sampler (v0.10.2 and later): processed
    # logprobs are taken after temperature and top-k/top-p, and for greedy requests before temperature.

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        timeout_s: float = 600.0,
        max_retries: int = 5,
        retry_backoff_s: float = 0.5,
        max_context: int | None = None,
        server: ServerKind = "auto",
        weights_dir: str | Path | None = None,
        policy: EngineModel | None = None,
        version: int = 0,
        api_key: str | None = None,
    ) -> None:
        if max_retries < 0 or retry_backoff_s < 0 or timeout_s <= 0:
            raise ValueError("need max_retries >= 0, retry_backoff_s >= 0 and timeout_s > 0")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.server = server
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.policy = policy or EngineModel()
        self._max_context = max_context
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        # A request holds its connection while it streams; httpx's default pool (100 connections) would hold back
        # the 101st request, and an abort (a POST of its own) until some request ends by itself.
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s),
            headers=headers,
            limits=httpx.Limits(max_connections=None),
        )
        self._version = version
        self._dialect: ServerDialect | None = None  # chosen when it connects
        self._connecting = asyncio.Lock()
        self._inflight: dict[str, _Pending] = {}

    @classmethod
    def from_config(cls, cfg: EngineConfig, model: EngineModel, *, version: int = 0, seed: int = 0) -> OpenAIEngine:
        """A client of `cfg.base_url`; the server holds the weights (agentrl serve reports its own policy version)."""
        return cls(
            cfg.base_url,
            cfg.served_model,
            server=cfg.server,
            weights_dir=cfg.weights_dir,
            policy=model,
            version=version,
            api_key=cfg.api_key(),
        )

    @classmethod
    def unavailable(cls, cfg: EngineConfig) -> str | None:
        url = f"{cfg.base_url.rstrip('/').removesuffix('/v1')}/v1/models"
        try:
            key = cfg.api_key()
            httpx.get(url, timeout=5, headers={"Authorization": f"Bearer {key}"} if key else None).raise_for_status()
        except httpx.HTTPError as e:
            return f"{url} does not answer ({type(e).__name__}: {e}): start the server (agentrl serve --model DIR)"
        if cfg.weights_dir is not None and not Path(cfg.weights_dir).is_dir():
            return f"engine.weights_dir {cfg.weights_dir} is not a folder: create it where the server sees it too"
        return None

    @property
    def capabilities(self) -> Capabilities:
        """What the server takes (`ServerDialect.capabilities`), known once connected."""
        return self._connected().capabilities

    async def start(self) -> None:
        await self.connect()

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        if self._max_context is None:
            raise RuntimeError(
                f"max_context of {self.base_url} is not known yet: `await engine.connect()` first, "
                "or pass max_context= (needed when the server does not report max_model_len)"
            )
        return self._max_context

    async def connect(self) -> OpenAIEngine:
        """Ask the server what it serves (retrying until it answers); later calls return at once."""
        async with self._connecting:
            if self._dialect is not None:
                return self
            models = ModelList.model_validate(self._ok(await self._send("GET", "/v1/models")).json())
            served = [m.id for m in models.data]
            card = next((m for m in models.data if self.model in (None, m.id)), None)
            if card is None:
                raise RequestRejected(f"{self.base_url} does not serve model {self.model!r}; it serves {served}")
            self.model = card.id
            if self._max_context is None:
                self._max_context = card.max_model_len
            self._dialect = await server_dialect(self)
        return self

    # -- requests --------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None
    ) -> Generation:
        await self.connect()
        self.check_fits(len(prompt_ids), params)
        rid = request_id or uuid.uuid4().hex
        if rid in self._inflight:
            raise ValueError(f"request id {rid!r} is already in flight")
        body = self._body(list(prompt_ids), params, rid)
        st = self._inflight[rid] = _Pending()
        try:
            for attempt in range(self.max_retries + 1):
                if attempt:
                    await asyncio.sleep(self._backoff(attempt - 1))
                st.restart(self._version)  # a retry generates from the prompt again
                if st.aborted:
                    break
                st.task = asyncio.create_task(self._stream(body, st))
                try:
                    await asyncio.wait({st.task})
                except asyncio.CancelledError:  # our caller gave up: close the stream (the server then aborts)
                    st.task.cancel()
                    raise
                if st.task.cancelled() or st.task.exception() is None or st.aborted:
                    break
                error = st.task.exception()
                if not isinstance(error, _Retryable | httpx.TransportError):
                    raise error
            else:
                raise self._gave_up(error, self.max_retries + 1)
        finally:
            del self._inflight[rid]
        if st.finish in ("stop", "length"):
            finish = _FINISH[st.finish]
        elif st.aborted or st.finish == "abort":
            finish = "aborted"
        else:
            raise ServerError(f"{self.base_url}: the stream ended without a finish_reason (got {st.finish!r})")
        return Generation(
            st.tokens, st.logprobs, st.versions, finish, prompt_len=len(prompt_ids), kv_versions=st.kv_versions
        )

    async def abort(self, request_id: str) -> None:
        st = self._inflight.get(request_id)
        if st is None or st.aborted:
            return
        st.aborted = True
        if st.started.is_set() and await self._connected().abort(request_id):
            return  # the server ends the stream itself, sending the tokens made so far
        if st.task is not None:
            st.task.cancel()  # closing the stream makes the server abort; the tokens received are kept

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None = None, *, lora: Mapping[str, torch.Tensor] | None = None
    ) -> int:
        """Install the weights the server's way (`AgentrlServe`, `VLLMServe`) and return the new version."""
        if state_dict is not None and lora is not None:
            raise ValueError("pass either a full state_dict or a LoRA adapter, not both")
        await self.connect()
        await self._connected().update_weights(state_dict, lora)
        return self._version

    async def close(self) -> None:
        await self._client.aclose()

    # -- HTTP ------------------------------------------------------------------------

    def _body(self, prompt_ids: list[int], p: SamplingParams, rid: str) -> dict:
        req = CompletionRequest(
            model=self._connected().model,
            prompt=prompt_ids,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            stop_token_ids=list(p.stop_token_ids),
            seed=p.seed,
            logprobs=0,
            stream=True,
            return_token_ids=True,
            return_tokens_as_token_ids=True,
            request_id=rid,
            repetition_penalty=1.0,
            min_p=0.0,
            ignore_eos=True,
        )
        return req.model_dump(exclude_unset=True, exclude_none=True)

    async def _stream(self, body: dict, st: _Pending) -> None:
        """One attempt: POST with `stream: true` and fold the server-sent chunks into `st`."""
        async with self._client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                self._ok(resp)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ServerError(f"{self.base_url}: {_message(chunk)}")
                for choice in Completion.model_validate(chunk).choices:
                    self._fold(choice, st)
                st.started.set()

    def _fold(self, choice: CompletionChoice, st: _Pending) -> None:
        lp = choice.logprobs
        ids = choice.token_ids if choice.token_ids is not None else [_token_id(t) for t in (lp.tokens if lp else [])]
        logprobs = lp.token_logprobs if lp else []
        if len(logprobs) != len(ids) or any(x is None for x in logprobs):
            raise ServerError(f"{self.base_url} sent {len(ids)} token ids but logprobs {logprobs}: need one per token")
        # A server that does not say (vLLM) gets the version this request was sent under, for the tokens and
        # for the KV they were sampled over: its weights can only be as new or newer, so staleness is not
        # under-counted (and a vLLM request keeps the LoRA adapter it was sent with to its end).
        versions = choice.policy_versions if choice.policy_versions is not None else [st.sent] * len(ids)
        kv = choice.policy_kv_versions if choice.policy_kv_versions is not None else [st.sent] * len(ids)
        st.tokens += ids
        st.logprobs += logprobs
        st.versions += versions
        st.kv_versions += kv
        if versions:
            self._version = max(self._version, versions[-1])  # follow the server's updates made by others
        if choice.finish_reason is not None:
            if choice.finish_reason not in _FINISH:
                raise ServerError(f"{self.base_url}: unexpected finish_reason {choice.finish_reason!r}")
            st.finish = choice.finish_reason

    async def _send(self, method: str, path: str, *, resend: bool = True, **kwargs) -> httpx.Response:
        """One request, retried on connection errors, timeouts and 5xx replies; 4xx replies are returned.

        resend=False (a weight upload): retry only failures to connect, which never reached the
        server; a lost reply or a 5xx might follow an update that was applied.
        """
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt - 1))
            try:
                resp = await self._client.request(method, path, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                error: Exception = e
                continue
            except httpx.TransportError as e:
                if not resend:
                    raise ServerError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
                error = e
                continue
            if resp.status_code < 500:
                return resp
            error = _Retryable(f"{self.base_url}{path}: HTTP {resp.status_code}: {_message(resp)}")
            if not resend:
                raise error
        raise self._gave_up(error, self.max_retries + 1)

    def _ok(self, resp: httpx.Response) -> httpx.Response:
        """`resp` if it succeeded; a 4xx raises what the server said, a 5xx raises retryably."""
        if resp.status_code < 400:
            return resp
        message = f"{self.base_url} refused the request (HTTP {resp.status_code}): {_message(resp)}"
        if resp.status_code >= 500:
            raise _Retryable(message)
        if resp.status_code == 400 and _is_context_overflow(resp):
            raise ContextTooLong(message)
        raise RequestRejected(message)

    def _gave_up(self, error: Exception, attempts: int) -> Exception:
        if isinstance(error, ServerError):
            return ServerError(f"{error} (after {attempts} attempts)")
        return ServerUnavailable(
            f"no answer from {self.base_url} after {attempts} attempts: {type(error).__name__}: {error or 'no detail'}"
        )

    def _backoff(self, attempt: int) -> float:
        return min(self.retry_backoff_s * 2**attempt, MAX_BACKOFF_S)

    def _connected(self) -> ServerDialect:
        if self._dialect is None:
            raise RuntimeError(f"what {self.base_url} is and takes is not known yet: `await engine.connect()` first")
        return self._dialect


# -- the servers' dialects ---------------------------------------------------------------


class ServerDialect(ABC):
    """What differs between the servers an `OpenAIEngine` speaks to: the weight updates they take and how, the
    `model` a request names, and whether an aborted request is ended by asking. One is chosen when the engine
    connects (`server_dialect`); nothing else asks which server it is."""

    def __init__(self, engine: OpenAIEngine) -> None:
        self.engine = engine

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """The weight updates the server takes from this engine."""

    @property
    def model(self) -> str:
        """What a request names as its `model`: the served model, by default."""
        return self.engine.model

    async def abort(self, request_id: str) -> bool:
        """Ask the server to end a request it holds: True if it then ends the stream itself, with the tokens made
        so far. By default it is not asked (False): the engine closes the stream, and the server aborts."""
        return False

    @abstractmethod
    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None, lora: Mapping[str, torch.Tensor] | None
    ) -> None:
        """Install `state_dict` or `lora` (not both; neither: the server's weights changed its own way) and move
        the engine's version to the one its later tokens carry."""


class AgentrlServe(ServerDialect):
    """`agentrl serve`: it takes the tensors over HTTP, reports each token's version itself, and ends an aborted
    request with the tokens made so far."""

    def __init__(self, engine: OpenAIEngine, served: PolicyVersion) -> None:
        super().__init__(engine)
        self.updates = frozenset(served.weight_updates or ())
        """what it said it takes (full state dicts; LoRA adapters if started with --lora-rank)"""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(weight_updates=self.updates)

    async def abort(self, request_id: str) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            resp = await self.engine._client.post("/agentrl/abort", json={"request_id": request_id})
            return resp.status_code == 200
        return False

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None, lora: Mapping[str, torch.Tensor] | None
    ) -> None:
        """Upload the weights (safetensors); the server answers with its new version."""
        tensors = lora if lora is not None else state_dict
        if tensors is None:
            raise ValueError("agentrl serve holds its own copy of the weights: pass the new state_dict or LoRA adapter")
        import safetensors.torch

        payload = await asyncio.to_thread(lambda: safetensors.torch.save(_cpu_copies(tensors)))
        resp = await self.engine._send(
            "POST",
            "/agentrl/weights",
            content=payload,
            resend=False,
            params={"lora": 1} if lora is not None else None,
            headers={"content-type": "application/octet-stream"},
        )
        self.engine._version = PolicyVersion.model_validate(self.engine._ok(resp).json()).version


class VLLMServe(ServerDialect):
    """`vllm serve`: it reads weights from files in the engine's `weights_dir`, loaded through its own endpoints
    (the module's doc says how), and reports no versions."""

    def __init__(self, engine: OpenAIEngine) -> None:
        super().__init__(engine)
        self.adapter: str | None = None
        """the LoRA adapter requests name, once one was loaded"""
        self.written: list[Path] = []
        """the update folders this engine wrote and keeps, oldest first"""
        self.tag = uuid.uuid4().hex[:8]
        """in adapter and folder names: a long-lived server may hold an earlier run's"""

    @property
    def capabilities(self) -> Capabilities:
        """Full state dicts, and LoRA adapters of a LoRA policy, once `weights_dir` is set; else nothing:
        `update_weights()` with no tensors only moves the version."""
        if self.engine.weights_dir is None:
            return Capabilities(weight_updates=frozenset())
        return Capabilities(weight_updates=frozenset({"full", "lora"} if self.engine.policy.lora else {"full"}))

    @property
    def model(self) -> str:
        return self.adapter or self.engine.model

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None, lora: Mapping[str, torch.Tensor] | None
    ) -> None:
        """Write the weights into `weights_dir` and have the server load them; with neither, only bump the
        engine's version."""
        if state_dict is None and lora is None:
            self.engine._version += 1
        elif self.engine.weights_dir is None:
            raise NotImplementedError(NO_WEIGHTS_DIR.format(url=self.engine.base_url))
        elif lora is not None:
            await self._load_adapter(lora)
        else:
            await self._reload(state_dict)

    async def _load_adapter(self, lora: Mapping[str, torch.Tensor]) -> None:
        """Serve the adapter under a new name, which requests sent from now on name."""
        policy = self.engine.policy
        if policy.lora is None or policy.path is None:
            raise ValueError(
                "a LoRA update for a vLLM server needs the policy's LoRA settings and checkpoint "
                "folder for the adapter's config: OpenAIEngine(policy=EngineModel(path, lora=...))"
            )
        from agentrl.models.lora import peft_config

        config = peft_config(policy.lora, meta_model_at(policy.path))

        def write(folder: Path) -> None:
            import safetensors.torch

            config.save_pretrained(str(folder))  # adapter_config.json
            safetensors.torch.save_file(_cpu_copies(lora), str(folder / "adapter_model.safetensors"))

        name = f"agentrl-{self.tag}-v{self.engine._version + 1}"
        # The previous adapter's folder stays: vLLM may read it again for a request in flight that still uses it.
        async with self._update_folder(name, write, keep=2) as folder:
            await self._post("/v1/load_lora_adapter", LoadLoraAdapter(lora_name=name, lora_path=str(folder.resolve())))
        previous, self.adapter = self.adapter, name
        self.engine._version += 1
        if previous is not None:
            await self._post("/v1/unload_lora_adapter", UnloadLoraAdapter(lora_name=previous))

    async def _reload(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Reload the server's weights in place from a checkpoint folder written here."""
        path = self.engine.policy.path

        def write(folder: Path) -> None:
            import safetensors.torch

            tensors = checkpoint_layout(path, state_dict) if path else state_dict
            safetensors.torch.save_file(_cpu_copies(tensors), str(folder / "model.safetensors"))

        async with self._update_folder(f"agentrl-{self.tag}-v{self.engine._version + 1}", write, keep=1) as folder:
            await self._post("/pause", params={"mode": "keep"})  # requests in flight stay, frozen
            try:
                reload = CollectiveRpc(method="reload_weights", kwargs={"weights_path": str(folder.resolve())})
                await self._post("/collective_rpc", reload)
                await self._post("/reset_prefix_cache", params={"reset_running_requests": "true"})
            finally:
                await self._post("/resume")
        self.engine._version += 1

    @contextlib.asynccontextmanager
    async def _update_folder(self, name: str, write: Callable[[Path], None], *, keep: int) -> AsyncIterator[Path]:
        """A new folder `name` in `weights_dir`, filled by `write(folder)` in a thread (it may hold gigabytes), for
        the server to load inside the block. Kept if the block succeeds, with the `keep - 1` this engine wrote
        before it (the older ones are deleted); deleted if anything fails."""
        folder = self.engine.weights_dir / name
        folder.mkdir()
        try:
            await asyncio.to_thread(write, folder)
            yield folder
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.written.append(folder)
        for old in self.written[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        self.written = self.written[-keep:]

    async def _post(self, path: str, body: BaseModel | None = None, params: dict[str, str] | None = None) -> None:
        """POST to one of vLLM's endpoints; one that is not served names the flag the server needs."""
        resp = await self.engine._send(
            "POST", path, json=body.model_dump() if body else None, params=params, resend=False
        )
        if resp.status_code == 404 and _is_missing_route(resp):
            raise RequestRejected(f"{self.engine.base_url}{path} is not served: start vLLM with {_VLLM_NEEDS[path]}")
        self.engine._ok(resp)


async def server_dialect(engine: OpenAIEngine) -> ServerDialect:
    """The dialect of `engine`'s server (its models read): vLLM when `engine.server` says so; else agentrl serve
    when it answers GET /agentrl/version, whose policy version the engine takes; else vLLM, unless `server` says
    agentrl."""
    if engine.server == "vllm":
        return VLLMServe(engine)
    resp = await engine._send("GET", "/agentrl/version")
    if resp.status_code == 200:
        served = PolicyVersion.model_validate(resp.json())
        engine._version = served.version
        return AgentrlServe(engine, served)
    if engine.server == "agentrl":
        raise RequestRejected(
            f"{engine.base_url} is not agentrl serve: GET /agentrl/version answered HTTP "
            f"{resp.status_code} (set server to vllm or auto)"
        )
    return VLLMServe(engine)


def _cpu_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh contiguous CPU copies: safetensors refuses tensors that share storage (tied weights)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def _is_missing_route(resp: httpx.Response) -> bool:
    """FastAPI's own 404 (the path is not served), not an endpoint's "not found" about what it was asked."""
    try:
        return resp.json() == {"detail": "Not Found"}
    except ValueError:
        return False


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ServerError(
            f"the server sent token text {token!r}, not ids: it supports neither return_token_ids nor "
            "return_tokens_as_token_ids (vLLM >= 0.10.2 does)"
        )
    return int(token.removeprefix("token_id:"))


def _error_json(obj: dict) -> dict:
    """The error object of a reply: OpenAI's {"error": {...}}, or older vLLM's flat {"message": ...}."""
    return obj["error"] if isinstance(obj.get("error"), dict) else obj


def _message(reply: httpx.Response | dict) -> str:
    if isinstance(reply, dict):
        return str(_error_json(reply).get("message", reply))
    try:
        return str(_error_json(reply.json()).get("message", reply.text))
    except ValueError:  # not JSON
        return reply.text[:500]


def _is_context_overflow(resp: httpx.Response) -> bool:
    """OpenAI's code for it, or vLLM's message ("This model's maximum context length is ...")."""
    try:
        error = _error_json(resp.json())
    except ValueError:
        return False
    return error.get("code") == "context_length_exceeded" or "maximum context length" in str(error.get("message"))
