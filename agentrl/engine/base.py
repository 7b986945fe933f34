"""The inference engine contract: token ids in; token ids, logprobs, versions out.

Words used throughout (fixed here once):
- request: one `generate` call, a prompt of token ids and `SamplingParams`;
- policy version: an integer the engine increments on every weight update; every
  generated token records the version of the weights that sampled it;
- engine logprob (lp_b in docs/design.md §4): log q(y_t), where q is the distribution the
  token was actually drawn from (see `agentrl.engine.sampling`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch

    from agentrl.engine.config import EngineConfig, EngineModel

FinishReason = Literal["stop", "length", "aborted"]
WeightUpdate = Literal["full", "lora"]


MIN_TEMPERATURE = 1e-5
"""the smallest temperature but 0 (vLLM's threshold for greedy too)"""


class SamplingParams(BaseModel):
    """How to sample one request. Validated here, before anything reaches a model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0)
    """softmax temperature; 0 means greedy decoding, else at least `MIN_TEMPERATURE`"""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """nucleus sampling: keep the smallest set of tokens whose probability reaches top_p"""
    top_k: int = Field(0, ge=0)
    """keep the k most likely tokens; 0 turns it off"""
    max_tokens: int = Field(256, ge=1)
    """generate at most this many tokens (finish reason "length")"""
    stop_token_ids: tuple[int, ...] = ()
    """generation stops after any of these; the stop token is part of the output"""
    seed: int | None = None
    """the key of this request's own sampling noise, so its tokens do not depend on batching (None: the engine's)"""

    @model_validator(mode="after")
    def _greedy_has_no_filters(self) -> SamplingParams:
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={self.temperature:g} is neither 0 (greedy) nor at least {MIN_TEMPERATURE:g}: logits "
                "divided by it approach float32's limit (at 1e-39 every logprob was NaN); for greedy set 0"
            )
        if self.temperature == 0 and (self.top_p < 1 or self.top_k):
            raise ValueError("top_p / top_k have no effect with temperature=0 (greedy); leave them at 1.0 / 0")
        return self


@dataclass
class Generation:
    """What one request produced. The three per-token lists have the same length."""

    token_ids: list[int]
    logprobs: list[float]
    """engine logprob of each generated token, under `InferenceEngine.logprob_semantics`"""
    versions: list[int]
    """policy version of the weights that sampled each token"""
    finish_reason: FinishReason
    prompt_len: int = 0
    routed_experts: list[list[list[int]]] | None = field(default=None, repr=False)
    """MoE models, when asked: per generated token, per layer, the experts of the forward that sampled it (its
    previous position's)"""
    prompt_routing: list[list[list[int]]] | None = field(default=None, repr=False)
    """with `routed_experts`: per prompt position 0 … prompt_len − 2, per layer, the experts it was sent to
    (prefix-cache hits included: the routing their KV was computed with); the last prompt position's are
    `routed_experts[0]`"""
    kv_versions: list[int] | None = None
    """per token, the oldest policy version among the KV it was sampled over (a weight update can land
    mid-request: later tokens are sampled by new weights over KV the old ones computed); None: the same
    as `versions` (an engine that knows no better must pass the version its request started with)"""

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs) == len(self.versions), "per-token lists differ in length"
        if self.kv_versions is None:
            self.kv_versions = list(self.versions)
        assert len(self.kv_versions) == len(self.versions), "per-token lists differ in length"


@dataclass(frozen=True)
class Capabilities:
    """What an engine declares about itself, so that callers (weight sync, the training loop) read a
    field instead of probing the engine. Valid once the engine has started (`start()`)."""

    weight_updates: frozenset[WeightUpdate] = frozenset({"full"})
    """the tensors `update_weights` accepts: a full state dict, a LoRA adapter (empty: none, only the
    version moves, e.g. a foreign server whose weights change by other means)"""
    shares_module: bool = False
    """it samples with the very module it was built with (the learner's own, in one process): an update
    is made in place, inside `paused()`, and `update_weights()` with no tensors only moves the version"""
    pausable: bool = False
    """`paused()` holds the decode loop: no step runs inside it"""
    dtype: str | None = None
    """the dtype it samples with ("float32", "bfloat16", ...); None: not known here (a remote server)"""
    records_routing: bool = False
    """MoE models: each `Generation` carries `routed_experts` and `prompt_routing`"""


class ContextTooLong(ValueError):
    """The prompt plus `max_tokens` does not fit the model's context: refused before the model."""


class InferenceEngine(ABC):
    """Generates from token ids; takes weight updates; aborts requests.

    Contract for every engine (set `name` and `logprob_semantics` in ALL subclasses):
    - `from_config(cfg, model, version=, seed=)` builds it from an `EngineConfig` (what `build_engine`,
      and so `agentrl train`, `eval` and `serve`, call); `start()` readies it (connects, for a client)
      and is safe to call again; `async with` starts it.
    - `capabilities` declares the weight updates it takes, its dtype, whether it records routing
      and whether it can pause; nothing outside the engine package inspects an engine otherwise.
    - `generate(prompt_ids, params, request_id=)` returns a `Generation`. Generated ids are
      never detokenised and re-encoded. A request whose prompt plus `max_tokens` exceeds
      `max_context` raises `ContextTooLong` without touching the model.
    - `abort(request_id)` ends that request early: its `generate` returns the tokens made so
      far with finish reason "aborted". Unknown or finished ids are ignored.
    - `update_weights(state_dict=..., lora=...)` installs new weights between two decode
      steps and returns the new policy version (old version + 1). Requests in flight keep
      going; their later tokens carry the new version. With neither (an engine that shares its
      module, or whose weights changed by other means) only the version moves.
    - `paused()`, where `capabilities.pausable`: no decode step runs inside the block.
    - `close()` releases the engine; safe to call twice. `async with` closes it too.
    """

    name: ClassVar[str]
    logprob_semantics: ClassVar[str]

    @classmethod
    def from_config(cls, cfg: EngineConfig, model: EngineModel, *, version: int = 0, seed: int = 0) -> InferenceEngine:
        """The engine `cfg` describes, serving `model`, starting at policy `version`. An engine from another
        package implements this to be usable from `agentrl train` and `agentrl eval` (its own settings
        arrive in `cfg.options`)."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from an EngineConfig: implement from_config")

    @classmethod
    def unavailable(cls, cfg: EngineConfig) -> str | None:
        """Why this engine cannot run here with `cfg` (a missing package, no GPU, a server that does not
        answer), with what to do; None when nothing is known to stop it. Cheap: checked before a run starts."""
        return None

    @property
    def capabilities(self) -> Capabilities:
        """What this engine takes and does (the defaults: full state dicts, nothing else)."""
        return Capabilities()

    def metrics(self) -> dict[str, float]:
        """Counters for a run's metrics log (a fleet: requests and tokens per replica, the affinity hit rate);
        none by default."""
        return {}

    def nodes(self) -> list[str]:
        """The Ray node id of each replica running in its own actor (a fleet's), for a run's placement log; none
        by default (the engine runs in this process, or is a client of servers)."""
        return []

    async def start(self) -> None:  # noqa: B027 (optional hook: most engines are ready once built)
        """Ready the engine (a client connects); later calls return at once. Nothing to do by default."""

    def paused(self, *, new_version: bool = False) -> AbstractContextManager[None]:
        """No decode step runs inside this block (for an in-place update of a shared module); `new_version`: the
        block changed the weights, and the next policy version begins as it ends, before any step."""
        raise NotImplementedError(f"the {self.name} engine cannot pause (capabilities.pausable is False)")

    @property
    @abstractmethod
    def version(self) -> int:
        """The current policy version (starts at 0)."""

    @property
    @abstractmethod
    def max_context(self) -> int:
        """Most tokens (prompt plus generated) one request may hold."""

    @abstractmethod
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None
    ) -> Generation: ...

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None = None, *, lora: Mapping[str, torch.Tensor] | None = None
    ) -> int: ...

    @abstractmethod
    async def close(self) -> None: ...

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        if prompt_len < 1:
            raise ValueError("empty prompt: an engine needs at least one prompt token")
        if prompt_len + params.max_tokens > self.max_context:
            raise ContextTooLong(
                f"prompt of {prompt_len} tokens + max_tokens={params.max_tokens} exceeds the context of "
                f"{self.max_context}; shorten the prompt or lower max_tokens"
            )

    async def __aenter__(self) -> InferenceEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
