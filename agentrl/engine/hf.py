"""`hf` engine: a transformers model decoding many requests in one batch with a KV cache.

Continuous batching, written here because transformers' own `generate` decodes a fixed
batch to the end, and its continuous-batching manager neither reports the logprob of the
distribution a token was drawn from nor lets a weight update land between two steps.
A background thread runs the loop; each iteration:

1. finishes aborted requests with the tokens they have;
2. a window of decode steps for every running request (`decode_window`, 1 on the CPU):
   feed its last sampled token, sample the next from `agentrl.engine.sampling` (each request
   its own seed's noise and settings, all rows in one pass), and read the window's tokens and
   logprobs back in one transfer;
3. prefills newly arrived requests as a left-padded batch, samples their first token and
   merges their KV cache into the running one (left-padding the shorter side);
4. drops finished rows from the cache, and cache columns no row uses any more.

So a request joins while others are mid-generation, as multi-turn rollouts need: an episode
back from its sandbox does not wait for the batch to drain. The thread, the step lock that
`update_weights` shares (new weights land between two steps; later tokens carry the new
version) and the futures are `agentrl.engine.threaded`'s.

Between two changes of the running set, a step's inputs stay on the device (`_Batch`): the next
input ids are the sampled tensor and the positions a tensor advanced in place, and the attention
mask goes to the model as the 4D mask it would build (transformers reads a 2D one back to see
whether it can be skipped). So a window of decode steps synchronises with the device once, when
it reads the tokens back, and on a GPU the host queues the window's steps ahead of the kernels.
Within a window a row's stop is found on the device: a row that stops (a stop token, or its
max_tokens) decodes on to the window's end, its later tokens dropped and their KV columns masked,
so its cached prefix holds only the tokens it returns. Requests join, aborts land and weights
change between two windows.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import Cache

from agentrl.engine.base import Capabilities, SamplingParams
from agentrl.engine.config import EngineConfig, EngineModel
from agentrl.engine.graphs import FixedShapeDecode
from agentrl.engine.kv import SlabLayer
from agentrl.engine.prefix_cache import PrefixCache, common_prefix
from agentrl.engine.sampling import RowSampling, seed_key
from agentrl.engine.threaded import Request, ThreadedEngine
from agentrl.models.cache import CACHE
from agentrl.models.lora import is_lora

MAX_BATCH_SIZE = 64  # rows decoded together, by default
DECODE_WINDOW = {"cuda": 8}  # decode steps between two reads back, by device type; others 1


def _full_attention(cfg) -> bool:
    """Every layer attends to the whole context (no sliding window): masks go by the padding alone, and a padding
    column between a row's tokens changes nothing."""
    types = getattr(cfg, "layer_types", None)
    return all(t == "full_attention" for t in types) if types else not getattr(cfg, "sliding_window", None)


def _check_update(
    tensors: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], what: str, whose: str, *, missing: bool
) -> None:
    """Refuse an update whose keys or shapes are not `own`'s before a tensor is copied: torch and peft copy every
    tensor that fits before they raise, which left the engine sampling a mix of old and new weights under the old
    version, over a prefix cache of the old weights' KV."""
    problems = []
    if extra := sorted(tensors.keys() - own.keys()):
        problems.append(f"has keys {whose} lacks: {extra[:5]}")
    if missing and (absent := sorted(own.keys() - tensors.keys())):
        problems.append(f"lacks keys of {whose}: {absent[:5]}")
    if wrong := [
        f"{k} {tuple(v.shape)} (not {tuple(own[k].shape)})"
        for k, v in tensors.items()
        if k in own and v.shape != own[k].shape
    ]:
        problems.append(f"has tensors of the wrong shape: {wrong[:5]}")
    if problems:
        raise ValueError(f"{what} {'; '.join(problems)}; no weight was changed")


@dataclass(eq=False, kw_only=True)
class _Request(Request):
    key: tuple[int, int]  # its seed's noise key (agentrl.engine.sampling)
    n_ctx: int = 0  # real (unpadded) tokens in this row's KV cache
    kv_version: int = 0  # the policy version its prefill ran under (its KV is older than later tokens')


@dataclass(eq=False)
class _Batch:
    """The running rows' decode inputs on the device, valid until a row joins or leaves."""

    ids: torch.Tensor  # (B,) each row's last sampled token: the next step's input
    counters: torch.Tensor  # (B, 2) that token's position, and the index in its request of the token it samples
    sampling: RowSampling
    stops: torch.Tensor  # (B, S) each row's stop token ids, padded with -1
    max_tokens: torch.Tensor  # (B,)


class HFEngine(ThreadedEngine):
    """The embedded engine, sampling with the transformers module it is given.

    `shared=True`: the module is the trainer's own (no copy). The trainer changes its weights in
    place, wrapped in `with engine.paused(new_version=True):` (no decode step runs meanwhile, and the next version
    begins as the block ends; `await engine.update_weights()` with no arguments after a plain `paused()` moves it
    too, but a step may run between the two). Otherwise the
    engine owns its module and takes full state dicts, and LoRA adapters when it is a peft model.
    """

    name = "hf"
    thread_name = "agentrl-hf-engine"
    logprob_semantics = "log q(y): q = softmax(top_p(top_k(logits / T))), renormalised; greedy: softmax(logits)"

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int = MAX_BATCH_SIZE,
        max_context: int | None = None,
        prefix_cache_tokens: int = 65536,
        record_routing: bool = False,
        seed: int = 0,
        version: int = 0,
        shared: bool = False,
        bf16_weights: bool = False,
        decode_window: int | None = None,
        cuda_graphs: bool = False,
        fixed_shapes: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if decode_window is not None and decode_window < 1:
            raise ValueError(f"decode_window must be >= 1, got {decode_window}")
        super().__init__(max_context or int(model.config.max_position_embeddings), version=version)
        self.model = model
        self.shared = shared
        if bf16_weights and shared:
            raise ValueError("bf16_weights rounds the engine's own copy: a shared module is the learner's")
        self.bf16_weights = bf16_weights
        """float32 compute over weights rounded to bfloat16: the engine side of a bf16 deployment"""
        if bf16_weights:
            self._round_weights()
        self._lora = is_lora(model)  # a peft model: its adapters take LoRA updates
        self.device = next(model.parameters()).device
        self.decode_window = decode_window or DECODE_WINDOW.get(self.device.type, 1)
        """decode steps between two reads of the sampled tokens back to the host"""
        text = model.config.get_text_config()
        self._full_attention = _full_attention(text)
        self._mask_4d = self._full_attention and text._attn_implementation == "sdpa"  # a decode step's 4D mask
        self._fixed: FixedShapeDecode | None = None  # the decode step over fixed shapes (agentrl.engine.graphs)
        if cuda_graphs or fixed_shapes:
            if cuda_graphs and self.device.type != "cuda":
                raise ValueError(f"cuda_graphs captures decode steps on a GPU: the model is on {self.device}")
            if shared:
                raise ValueError(
                    "fixed-shape decoding (cuda_graphs) needs the engine's own weights: a graph keeps the addresses of "
                    "the weights it was captured with, which the learner's module does not promise to keep"
                )
            if not self._mask_4d:
                raise ValueError(
                    "fixed-shape decoding (cuda_graphs) needs sdpa attention over the whole context (no sliding window)"
                )
        self._vocab = model.config.get_text_config().vocab_size
        self.max_batch_size = max_batch_size
        self._seeds = itertools.count(seed * 1_000_003)
        self._rows: list[_Request] = []  # the running batch, in cache row order
        self._batch: _Batch | None = None  # their decode inputs; None: rebuilt at the next step
        self._cache: Cache | None = None
        self._mask: torch.Tensor | None = None  # (B, L) 1 where the cache column holds a real token
        self._prefix = PrefixCache(prefix_cache_tokens)  # 0 turns prefix reuse off
        self.prefilled_tokens = 0  # prompt tokens run through the model
        # MoE routing: each router's chosen experts at the last forward, captured by a hook
        self._routers: list[torch.Tensor | None] | None = None
        if record_routing:
            self._hook_routers()
        if cuda_graphs or fixed_shapes:
            self._fixed = FixedShapeDecode(model, max_batch_size, capture=cuda_graphs, records=self._routers)
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache

    def _hook_routers(self) -> None:
        base = self.model.get_base_model() if self._lora else self.model
        gates = [getattr(layer.mlp, "gate", None) for layer in base.get_decoder().layers]
        if not gates or any(g is None for g in gates):
            raise ValueError("record_routing needs an MoE model whose layers route with `mlp.gate`")
        self._routers = [None] * len(gates)

        def capture(i: int):
            def hook(module, args, out) -> None:  # transformers' routers return (logits, weights, indices)
                self._routers[i] = out[2]

            return hook

        for i, gate in enumerate(gates):
            gate.register_forward_hook(capture(i))

    def _routing(self) -> torch.Tensor:
        """(tokens of the last forward, layers, k): the experts each token was sent to."""
        return torch.stack(self._routers, 1)

    @classmethod
    def from_config(cls, cfg: EngineConfig, model: EngineModel, *, version: int = 0, seed: int = 0) -> HFEngine:
        """Samples with `model.module` when given (shared), else with its own copy loaded from `model.path`
        (in `cfg.dtype`, auto: float32), with `model.lora`'s adapters when the policy trains LoRA."""
        if model.module is not None:
            module, shared = model.module, True
        elif model.path is None:
            raise ValueError("the hf engine needs a model: EngineModel(path=...) or EngineModel(module=...)")
        else:
            from agentrl.models.lora import with_lora

            dtype = torch.float32 if cfg.dtype in ("auto", "bfloat16_weights") else getattr(torch, cfg.dtype)
            module, shared = AutoModelForCausalLM.from_pretrained(model.path, dtype=dtype), False
            if model.lora is not None:
                module = with_lora(module, model.lora)
            module = module.to(model.device)
        return cls(
            module.eval(),
            max_batch_size=cfg.max_batch_size or MAX_BATCH_SIZE,
            prefix_cache_tokens=cfg.prefix_cache_tokens,
            record_routing=cfg.record_routing,
            seed=seed,
            version=version,
            shared=shared,
            bf16_weights=cfg.dtype == "bfloat16_weights",
            decode_window=cfg.decode_window,
            cuda_graphs=cfg.cuda_graphs,
        )

    @property
    def graphs_captured(self) -> int:
        """CUDA graphs of the decode step captured so far (engine.cuda_graphs)."""
        return self._fixed.captures if self._fixed is not None else 0

    @torch.no_grad()
    def _round_weights(self) -> None:
        for p in self.model.parameters():
            p.copy_(p.to(torch.bfloat16))

    @property
    def capabilities(self) -> Capabilities:
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        dtype = "bfloat16_weights" if self.bf16_weights else dtype
        return Capabilities(
            weight_updates=frozenset({"full", "lora"} if self._lora else {"full"}),
            shares_module=self.shared,
            pausable=True,
            dtype=dtype,
            records_routing=self._routers is not None,
        )

    # -- requests --------------------------------------------------------------------

    def _new_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> _Request:
        if min(prompt) < 0 or max(prompt) >= self._vocab:  # the decode thread would fail on it, and on every request
            bad = next(t for t in prompt if not 0 <= t < self._vocab)
            raise ValueError(f"prompt token id {bad} is not in the model's vocabulary (0 to {self._vocab - 1})")
        # the decode thread puts stop ids in an int64 tensor: one past 2^63 would fail it, and every request with it
        if bad := [t for t in params.stop_token_ids if not 0 <= t < self._vocab]:
            raise ValueError(f"stop token ids {bad[:5]} are not in the model's vocabulary (0 to {self._vocab - 1})")
        seed = params.seed if params.seed is not None else next(self._seeds)
        return _Request(
            id=request_id, prompt=prompt, params=params, loop=loop, future=loop.create_future(), key=seed_key(seed)
        )

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None = None, *, lora: Mapping[str, torch.Tensor] | None = None
    ) -> int:
        return await asyncio.to_thread(self._install, state_dict, lora)

    def _install(self, state_dict: Mapping[str, torch.Tensor] | None, lora: Mapping[str, torch.Tensor] | None) -> int:
        if state_dict is not None and lora is not None:
            raise ValueError("pass either a full state_dict or a LoRA adapter, not both")
        if state_dict is None and lora is None and not self.shared:
            raise ValueError("this engine holds its own weights: pass the new state_dict or LoRA adapter")
        with self._lock, torch.no_grad():
            if lora is not None:
                from peft import get_peft_model_state_dict, set_peft_model_state_dict

                if not self._lora:
                    raise ValueError(
                        "a LoRA update needs the engine's model to be a peft PeftModel "
                        "(agentrl serve: start it with --lora-rank)"
                    )
                _check_update(lora, get_peft_model_state_dict(self.model), "LoRA update", "the adapter", missing=False)
                set_peft_model_state_dict(self.model, dict(lora))
            elif state_dict is not None:
                _check_update(state_dict, self.model.state_dict(), "state_dict", "the model", missing=True)
                self.model.load_state_dict(dict(state_dict), strict=True)
            if self.bf16_weights:
                self._round_weights()
            # Neither: the module is shared with the trainer and already holds the new weights.
            return self._next_version()

    def _next_version(self) -> int:
        self._prefix.clear()  # KV of the old weights: reusing it would not sample the new policy
        return super()._next_version()

    # -- the decode loop (engine thread) --------------------------------------------

    def _busy(self) -> bool:
        return bool(self._rows)

    def _take(self) -> list[Request]:
        """The waiting requests in order while the batch has room, and every aborted one whatever the room (`_step`
        resolves it at once, rather than when a row frees)."""
        room, taken, kept = self.max_batch_size - len(self._rows), [], []
        for req in self._waiting:
            if req.aborted or room > 0:
                taken.append(req)
                room -= not req.aborted
            else:
                kept.append(req)
        self._waiting.clear()
        self._waiting.extend(kept)
        return taken

    @torch.no_grad()
    def _step(self, new: list[_Request]) -> None:
        for req in self._rows:
            if req.aborted:
                req.finish = "aborted"
        self._drop_finished()
        if self._rows:
            self._decode()
        new_live = []
        for req in new:
            if req.aborted:
                self._resolve(req, "aborted")
            else:
                new_live.append(req)
        if new_live:
            self._prefill(new_live)
        self._drop_finished()

    def _decode(self) -> None:
        """Decode a window of steps: feed each row's last sampled token, sample the next; read them back once."""
        assert self._cache is not None and self._mask is not None
        rows = self._rows
        if self._batch is None:  # the running set changed: its inputs come from the host, once
            self._batch = self._inputs(rows)
        b = self._batch
        steps = min(self.decode_window, max(r.params.max_tokens - len(r.tokens) for r in rows))
        live = torch.ones(len(rows), dtype=torch.bool, device=self.device)  # not stopped yet
        # no row padded: no mask at all, which lets sdpa take its grouped-query path (a stopped row's own
        # later columns are then in its attention, but what it decodes after its stop is dropped anyway)
        padded = any(r.n_ctx < self._mask.shape[1] for r in rows)
        drawn = []
        for _ in range(steps):
            # the token fed is a stopped row's stop token or later: its KV column stays out of the row's context
            self._mask = torch.cat([self._mask, live[:, None].to(self._mask.dtype)], 1)  # (B, L+1)
            if self._fixed is not None:
                logits = self._fixed(self._cache, b.ids, b.counters[:, :1], self._mask)
            else:
                logits = self.model(
                    input_ids=b.ids[:, None],
                    attention_mask=self._attention_mask() if padded else None,
                    position_ids=b.counters[:, :1],
                    use_cache=True,
                    **{CACHE: self._cache},
                ).logits[:, -1]
            routing = self._routing()[: len(rows)] if self._routers is not None else None  # fixed shapes pad rows
            b.ids, packed = self._draw(logits, b.sampling, b.counters[:, 1], routing)
            drawn.append(packed)
            # now the count of tokens each row has; a stopped row's stay, so no position passes prompt + max_tokens
            # (its later steps are dropped, and a model with learned positions has none beyond max_context)
            b.counters += live[:, None]
            if steps > 1:
                live &= (b.ids[:, None] != b.stops).all(1) & (b.counters[:, 1] < b.max_tokens)
        for r in rows:
            r.n_ctx += steps
        self._append(rows, torch.stack(drawn, 1))

    def _inputs(self, rows: list[_Request]) -> _Batch:
        state = torch.tensor([[r.tokens[-1], r.n_ctx, len(r.tokens), r.params.max_tokens] for r in rows])
        width = max(1, max(len(r.params.stop_token_ids) for r in rows))
        stops = torch.tensor([[*r.params.stop_token_ids] + [-1] * (width - len(r.params.stop_token_ids)) for r in rows])
        state, stops = state.to(self.device), stops.to(self.device)
        return _Batch(
            ids=state[:, 0],
            counters=state[:, 1:3].clone(),
            sampling=self._row_sampling(rows),
            stops=stops,
            max_tokens=state[:, 3],
        )

    def _attention_mask(self) -> torch.Tensor:
        """The decode step's mask: on sdpa the (B, 1, 1, L) boolean one transformers would build from the 2D
        mask, which it reads back to see whether it may skip it (a decode step's one query attends to every
        real column); else the 2D mask."""
        return self._mask[:, None, None, :].bool() if self._mask_4d else self._mask

    def _prefill(self, reqs: list[_Request]) -> None:
        """Prefill new prompts and merge them into the running batch; identical prompts (the G
        samples of a group) are computed once."""
        unique: dict[tuple[int, ...], int] = {}
        which = [unique.setdefault(tuple(r.prompt), len(unique)) for r in reqs]  # row -> unique prompt
        cache, mask, logits, routing = self._forward_prompts([list(p) for p in unique])
        for r in reqs:
            r.n_ctx, r.kv_version = len(r.prompt), self._version
        self._merge(reqs, cache, mask, which)
        last_routing = None
        if routing is not None:
            for r, u in zip(reqs, which, strict=True):
                r.prompt_routing = routing[u][:-1].tolist()
                r.routed = []
            last_routing = torch.stack([routing[u][-1] for u in which])
        idx = torch.tensor(which, device=self.device)
        first = torch.zeros_like(idx)  # each row samples its request's token 0
        _, packed = self._draw(logits[idx], self._row_sampling(reqs), first, last_routing)
        self._append(reqs, packed[:, None])

    def _forward_prompts(
        self, prompts: list[list[int]]
    ) -> tuple[Cache, torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
        """One forward over distinct prompts, reusing cached prefixes; returns the batch's KV cache,
        its (U, L) mask, each prompt's last logits (U, V) and, when recording routing, each prompt's
        experts at every position (len(prompt), layers, k): the cached prefix's as recorded with its
        KV, the rest from this forward. Every prompt's KV (and routing) joins the prefix cache.

        A prefix several of these prompts share beyond what the cache holds (the system prompt and
        tool schemas, after a weight update emptied the cache) is computed once, first. Row layout,
        columns: [pad | cached prefix (m) | pad | suffix (s)], both parts right-aligned, so the
        cached KV stacks into one past and the suffix into one left-padded input; the 2D mask hides
        both pads and explicit position ids keep every row's positions 0..m+s-1.
        """
        if shared := self._shared_prefixes(prompts):
            self._forward_prompts(shared)
        hits = [self._prefix.lookup(p) for p in prompts]
        if not self._full_attention:
            # a sliding window masks by column, not by position: a row's cached prefix and its suffix must be
            # adjacent, so each suffix spans the longest one's columns (such a row reuses less of its prefix)
            S = max(len(p) - hit.tokens for p, hit in zip(prompts, hits, strict=True))
            hits = [
                hit if len(p) - hit.tokens >= S else self._prefix.lookup(p[: max(0, len(p) - S) + 1])
                for p, hit in zip(prompts, hits, strict=True)
            ]
        m = [hit.tokens for hit in hits]
        s = [len(p) - n for p, n in zip(prompts, m, strict=True)]
        U, Lp, S = len(prompts), max(m), max(s)
        ids = torch.zeros(U, S, dtype=torch.long, device=self.device)
        positions = torch.zeros_like(ids)
        mask = torch.zeros(U, Lp + S, dtype=torch.long, device=self.device)
        for i, (p, mi, si) in enumerate(zip(prompts, m, s, strict=True)):
            ids[i, S - si :] = torch.tensor(p[mi:], device=self.device)
            positions[i, S - si :] = torch.arange(mi, mi + si, device=self.device)
            mask[i, Lp - mi : Lp] = 1
            mask[i, Lp + S - si :] = 1
        cache = Cache(layer_class_to_replicate=SlabLayer)
        if Lp:
            n_layers = len(next(hit.kv for hit in hits if hit.kv is not None))
            cache = Cache(
                layers=[
                    SlabLayer.assemble([hit.kv[layer] if hit.kv else None for hit in hits], Lp, S)
                    for layer in range(n_layers)
                ]
            )
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1, **{CACHE: cache})
        self.cached_tokens += sum(m)
        self.prefilled_tokens += sum(s)
        routing = None
        if self._routers is not None:
            fresh = self._routing().reshape(U, S, len(self._routers), -1).to(torch.int16)
            routing = [
                fresh[i, S - si :] if hit.routing is None else torch.cat([hit.routing, fresh[i, S - si :]])
                for i, (hit, si) in enumerate(zip(hits, s, strict=True))
            ]
        for i, p in enumerate(prompts):
            self._remember(p, cache, mask, i, None if routing is None else routing[i])
        return cache, mask, out.logits[:, -1], routing

    def _shared_prefixes(self, prompts: list[list[int]], min_tokens: int = 32) -> list[list[int]]:
        """Prefixes that neighbouring prompts (in sorted order) share, at least `min_tokens` longer than
        what the prefix cache already holds for them."""
        if len(prompts) < 2 or self._prefix.max_tokens <= 0:
            return []
        ordered = sorted(prompts)
        out: dict[tuple[int, ...], None] = {}
        for a, b in itertools.pairwise(ordered):
            n = common_prefix(a, b)
            if n >= min_tokens and n - self._prefix.lookup(a[: n + 1]).tokens >= min_tokens:
                out[tuple(a[:n])] = None
        return [list(p) for p in out]

    def _remember(
        self, ids: list[int], cache: Cache, mask: torch.Tensor, row: int, routing: torch.Tensor | None
    ) -> None:
        """Put row `row`'s KV (its real columns, copied out of the batch) in the prefix cache, with the routing
        (len(ids), layers, k) it was computed with when recording."""
        if self._prefix.max_tokens <= 0:
            return
        cols = mask[row].nonzero()[:, 0]
        kv = [
            (layer.keys[row].index_select(1, cols), layer.values[row].index_select(1, cols)) for layer in cache.layers
        ]
        assert kv[0][0].shape[1] == len(ids), "KV columns and ids disagree"
        self._prefix.insert(ids, kv, routing)

    def _merge(self, reqs: list[_Request], cache: Cache, mask: torch.Tensor, which: list[int]) -> None:
        """Append the prefilled rows (row i of the batch is row which[i] of `cache`) to the running batch."""
        idx = torch.tensor(which, device=self.device)
        if self._cache is None:
            self._cache = Cache(layers=[SlabLayer() for _ in cache.layers])
            self._mask = mask.new_zeros(0, 0)
        for main, new in zip(self._cache.layers, cache.layers, strict=True):
            main.append_rows(new.keys[idx], new.values[idx])
        W = self._cache.layers[0].width
        self._mask = torch.cat(
            [F.pad(self._mask, (W - self._mask.shape[1], 0)), F.pad(mask[idx], (W - mask.shape[1], 0))]
        )
        self._rows.extend(reqs)
        self._batch = None

    def _row_sampling(self, rows: list[_Request]) -> RowSampling:
        return RowSampling.of([r.params for r in rows], [r.key for r in rows], self._vocab, self.device)

    def _draw(
        self, logits: torch.Tensor, sampling: RowSampling, index: torch.Tensor, routing: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row (logits (B, V); `index` (B,) its index in the request), all rows in one pass,
        on the device: the tokens (B,), and (B, 2 [+ layers * k]) float32 of each token, its logprob and, when
        recording, the routing (B, layers, k) of the position that sampled it (token and expert ids are exact in
        float32 below 2^24), for `_append` to read back with others in one transfer."""
        logq = sampling.logprobs(logits)
        ys = sampling.sample(logq, index)
        parts = [ys[:, None], logq.gather(-1, ys[:, None])]
        if routing is not None:
            parts.append(routing.flatten(1))
        return ys, torch.cat(parts, 1)

    def _append(self, rows: list[_Request], drawn: torch.Tensor) -> None:
        """Read back `_draw`'s (B, steps, ...) in one transfer; append each row's tokens up to its stop."""
        k = self._routers[0].shape[-1] if self._routers is not None else 0
        for r, row in zip(rows, drawn.tolist(), strict=True):
            for y, lp, *experts in row:
                y = int(y)
                r.tokens.append(y)
                r.logprobs.append(lp)
                r.versions.append(self._version)
                r.kv_versions.append(r.kv_version)  # its prefill's: the KV holds nothing older
                if k:
                    r.routed.append([[int(e) for e in experts[i : i + k]] for i in range(0, len(experts), k)])
                if y in r.params.stop_token_ids:
                    r.finish = "stop"
                elif len(r.tokens) >= r.params.max_tokens:
                    r.finish = "length"
                if r.finish is not None:
                    break  # what the row decoded after its stop is dropped

    def _drop_finished(self) -> None:
        B, rows = len(self._rows), self._rows
        n = sum(r.finish is None for r in rows)
        if n == B:
            return
        for i, r in enumerate(rows):
            if r.finish is not None:
                self._resolve(r)
                if r.kv_version == self._version:  # its KV is all of the current weights
                    # the last sampled token was never fed: the KV holds the prompt and the rest
                    routing = None if r.routed is None else torch.tensor(r.prompt_routing + r.routed, dtype=torch.int16)
                    self._remember(r.prompt + r.tokens[:-1], self._cache, self._mask, i, routing)
        # rows that go on, from the end, move into the finished rows' places: only they are copied
        holes = [i for i in range(n) if rows[i].finish is not None]
        sources = [i for i in range(n, B) if rows[i].finish is None]
        for h, src in zip(holes, sources, strict=True):
            rows[h] = rows[src]
        self._rows = rows[:n]
        self._batch = None
        if holes:
            self._mask[holes] = self._mask[sources]
        self._mask = self._mask[:n]
        used = (self._mask.sum(0) > 0).nonzero()
        start = int(used[0]) if len(used) else self._mask.shape[1]  # columns before it: no row uses them
        self._mask = self._mask[:, start:]
        holes_t, sources_t = torch.tensor(holes, device=self.device), torch.tensor(sources, device=self.device)
        for layer in self._cache.layers:
            layer.remove_rows(holes_t, sources_t, n, start)
