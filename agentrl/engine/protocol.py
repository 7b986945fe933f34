"""The OpenAI completions wire format as agentrl speaks it: `agentrl serve` and `OpenAIEngine` share it.

Requests are OpenAI's completions request with one prompt of token ids, plus the vLLM
extensions agentrl needs (top_k, stop_token_ids, return_token_ids, return_tokens_as_token_ids,
request_id, ...). They are strict: a field the server would ignore is an error, because an
ignored sampling setting would silently change what the returned logprobs mean.

Responses (and the stream chunks, which have the same shape) add, per generated token,
`choices[].policy_versions` (the policy version of the weights that sampled it) and
`choices[].policy_kv_versions` (the oldest policy version among the KV it was sampled over:
`Generation.kv_versions`). They are parsed leniently, so that a vLLM server's replies, with
their extra fields and without these two, parse too.

At the end: the bodies of vLLM's own endpoints that `OpenAIEngine` installs weights on a vLLM server with.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentrl.engine.base import SamplingParams

TokenId = Annotated[int, Field(ge=0, strict=True)]

TEXT_PROMPT = (
    "text prompts are not accepted: agentrl serve is token-in/token-out (generated ids are never re-encoded); "
    "tokenize with the model's tokenizer and send the token ids as `prompt`"
)

# Fields OpenAI / vLLM clients send, accepted only at the value that leaves the sampling
# distribution as agentrl.engine.sampling defines it. `ignore_eos` is True because the engines
# stop only at `stop_token_ids` (put the EOS id there).
NEUTRAL: dict[str, Any] = {
    "n": 1,
    "echo": False,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "ignore_eos": True,
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    """send `usage` with the last chunk"""


class CompletionRequest(BaseModel):
    """POST /v1/completions: one prompt of token ids."""

    model_config = ConfigDict(extra="forbid")

    prompt: list[TokenId] = Field(min_length=1)
    """token ids; OpenAI's batch form holding one prompt, [[ids]], is accepted too"""
    model: str | None = None
    """the served model's name; None: the one the server serves"""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    """vLLM extension; 0 or -1 turns it off"""
    stop_token_ids: list[TokenId] = []
    """vLLM extension; generation stops after any of these (the stop token is part of the output)"""
    stop: list[str] | str | None = None
    """stop strings: refused, a token-in/token-out server stops on `stop_token_ids`"""
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0)
    """0: return the sampled token's logprob (the only choice: the engines report no alternatives)"""
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    """vLLM extension: `choices[].token_ids` holds the generated ids"""
    return_tokens_as_token_ids: bool = False
    """vLLM extension: `logprobs.tokens` holds "token_id:N" strings instead of token text"""
    skip_special_tokens: bool = True
    """whether `text` leaves out special tokens (the token ids always hold them)"""
    request_id: str | None = None
    """vLLM extension: the engine's request id, which POST /agentrl/abort takes; default: a fresh one"""
    user: str | None = None
    n: int = NEUTRAL["n"]
    echo: bool = NEUTRAL["echo"]
    presence_penalty: float = NEUTRAL["presence_penalty"]
    frequency_penalty: float = NEUTRAL["frequency_penalty"]
    repetition_penalty: float = NEUTRAL["repetition_penalty"]
    min_p: float = NEUTRAL["min_p"]
    ignore_eos: bool = NEUTRAL["ignore_eos"]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt_of_ids(cls, v: Any) -> Any:
        if isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(x, str) for x in v)):
            raise ValueError(TEXT_PROMPT)
        if isinstance(v, list) and v and isinstance(v[0], list):
            if len(v) > 1:
                raise ValueError(f"one prompt per request, got {len(v)}; send them as separate requests")
            return v[0]
        return v

    @model_validator(mode="after")
    def _no_ignored_settings(self) -> CompletionRequest:
        for name, neutral in NEUTRAL.items():
            if getattr(self, name) != neutral:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported (only {neutral!r}): it would change the "
                    "distribution the returned logprobs describe"
                )
        if self.logprobs:
            raise ValueError(
                f"logprobs={self.logprobs} is not supported: only 0 (the sampled token's logprob); "
                "the engines report no alternative tokens"
            )
        if self.stop:
            raise ValueError("`stop` strings are not supported by a token-in/token-out server: use `stop_token_ids`")
        return self

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            max_tokens=self.max_tokens,
            stop_token_ids=tuple(self.stop_token_ids),
            seed=self.seed,
        )


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CompletionLogprobs(_Reply):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionChoice(_Reply):
    index: int = 0
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    """"stop" | "length" | "abort"; None until the last chunk of a stream"""
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    policy_versions: list[int] | None = None
    """agentrl extension: the policy version of each generated token"""
    policy_kv_versions: list[int] | None = None
    """agentrl extension: per generated token, the oldest policy version among the KV it was sampled over"""


class Usage(_Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(_Reply):
    """A completion, or one chunk of a streamed one."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Reply):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "agentrl"
    max_model_len: int | None = None
    """most tokens (prompt plus generated) one request may hold, as vLLM reports it"""


class ModelList(_Reply):
    object: str = "list"
    data: list[ModelCard]


class ErrorInfo(_Reply):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Reply):
    error: ErrorInfo


class AbortRequest(BaseModel):
    """POST /agentrl/abort: end a request early; its stream ends with the tokens made so far."""

    model_config = ConfigDict(extra="forbid")

    request_id: str


class PolicyVersion(_Reply):
    """GET /agentrl/version, and the reply to POST /agentrl/weights."""

    version: int
    weight_updates: list[str] | None = None
    """GET /agentrl/version: the updates POST /agentrl/weights takes ("full", "lora": the served engine's)"""


# -- chat completions: POST /v1/chat/completions (agentrl serve, and the session gateway of a training run)


class ChatFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str = "{}"
    """the arguments as a JSON object's text, as OpenAI sends them"""


class ChatToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: str = "function"
    function: ChatFunction


class ChatMessage(BaseModel):
    """One message of a request. Fields the SDK echoes back from a reply (refusal, annotations, audio) are ignored;
    content parts other than text are refused."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as one string (text parts joined); "" for none."""
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content)
        return self.content or ""

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list) and (bad := sorted({str(p.get("type")) for p in v} - {"text"})):
            raise ValueError(f"content parts of type {bad} are not supported: text only")
        return v


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str = "function"
    function: dict[str, Any]
    """name, description, parameters (a JSON schema), as OpenAI takes them"""


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions: OpenAI's request, rendered with the served model's chat template.

    Strict as the completions request is: a setting the server would ignore is an error naming it. Sampling
    settings are the completions request's; `logprobs: true` returns the sampled tokens' logprobs (no alternatives:
    `top_logprobs` is 0 or absent); `return_token_ids` (vLLM's extension) returns `prompt_token_ids` and
    `choices[].token_ids`."""

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """auto (the default with tools) or none; required and a named function need constrained decoding: refused"""
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for max_tokens; None for both: as many as the context leaves"""
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    stop: list[str] | str | None = None
    n: int = NEUTRAL["n"]
    presence_penalty: float = NEUTRAL["presence_penalty"]
    frequency_penalty: float = NEUTRAL["frequency_penalty"]

    @model_validator(mode="after")
    def _no_ignored_settings(self) -> ChatCompletionRequest:
        if self.n != 1:
            raise ValueError(
                f"n={self.n} is not supported: one choice per request (a group is G requests, each its own session)"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != NEUTRAL[name]:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported (only 0.0)")
        if self.stop:
            raise ValueError("`stop` strings are not supported: generation ends at the chat template's end of turn")
        if isinstance(self.tool_choice, dict) or self.tool_choice not in (None, "auto", "none"):
            raise ValueError(
                f"tool_choice={self.tool_choice!r} is not supported: only auto and none (the engines do not constrain "
                "decoding to a call)"
            )
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatReplyMessage(_Reply):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ChatToolCall] | None = None


class ChatTokenLogprob(_Reply):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = []


class ChatLogprobs(_Reply):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(_Reply):
    index: int = 0
    message: ChatReplyMessage
    finish_reason: str | None = None
    """stop, length, tool_calls, or abort"""
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None
    policy_versions: list[int] | None = None
    """agentrl extension, as in completions"""
    policy_kv_versions: list[int] | None = None


class ChatCompletion(_Reply):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    """with `return_token_ids`: the prompt as the server laid it out"""


class ChatDeltaToolCall(_Reply):
    index: int
    id: str | None = None
    type: str | None = None
    function: ChatFunction | None = None


class ChatDelta(_Reply):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ChatDeltaToolCall] | None = None


class ChatChunkChoice(_Reply):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None
    policy_versions: list[int] | None = None
    policy_kv_versions: list[int] | None = None


class ChatCompletionChunk(_Reply):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


# vLLM's own endpoints, with which `OpenAIEngine` installs weights on a `vllm serve` server (shapes as in
# vLLM 0.16.0's vllm/entrypoints/serve/lora/protocol.py and serve/rpc/api_router.py; vLLM ignores extra fields).


class LoadLoraAdapter(BaseModel):
    """POST /v1/load_lora_adapter (vLLM started with --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    """the name requests then give as `model`; a name already loaded is refused"""
    lora_path: str
    """a folder in peft's format (adapter_config.json, adapter_model.safetensors), read by the server"""


class UnloadLoraAdapter(BaseModel):
    """POST /v1/unload_lora_adapter: new requests can no longer name it (requests in flight keep it)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str


class CollectiveRpc(BaseModel):
    """POST /collective_rpc (vLLM with VLLM_SERVER_DEV_MODE=1): call `method` on every worker."""

    model_config = ConfigDict(extra="forbid")

    method: str
    kwargs: dict[str, str] = {}
    """keyword arguments; vLLM passes only strings over HTTP"""
