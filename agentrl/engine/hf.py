"""`hf` engine: a transformers model decoding many requests in one batch with a KV cache.

Continuous batching, written here because transformers' own `generate` decodes a fixed
batch to the end, and its continuous-batching manager neither reports the logprob of the
distribution a token was drawn from nor lets a weight update land between two steps.
A background thread runs the loop; each iteration:

1. finishes aborted requests with the tokens they have;
2. one decode step for every running request: feed its last sampled token, sample the
   next from `agentrl.engine.sampling` (each request its own generator and parameters);
3. prefills newly arrived requests as a left-padded batch, samples their first token and
   merges their KV cache into the running one (left-padding the shorter side);
4. drops finished rows from the cache, and cache columns no row uses any more.

So a request joins while others are mid-generation, as multi-turn rollouts need: an episode
back from its sandbox does not wait for the batch to drain. The thread, the step lock that
`update_weights` shares (new weights land between two steps; later tokens carry the new
version) and the futures are `agentrl.engine.threaded`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from agentrl.engine.base import SamplingParams
from agentrl.engine.sampling import sample, sampling_logprobs
from agentrl.engine.threaded import Request, ThreadedEngine


@dataclass(eq=False, kw_only=True)
class _Request(Request):
    generator: torch.Generator
    n_ctx: int = 0  # real (unpadded) tokens in this row's KV cache


class HFEngine(ThreadedEngine):
    """The embedded engine. Pass the trainer's own module to share its weights (no copy).

    With a shared module the trainer changes weights in place: it wraps the change in
    `with engine.paused():` (no decode step runs meanwhile) and then calls
    `await engine.update_weights()` with no arguments, which only bumps the version.
    """

    name = "hf"
    thread_name = "agentrl-hf-engine"
    logprob_semantics = "log q(y): q = softmax(top_p(top_k(logits / T))), renormalised; greedy: softmax(logits)"

    def __init__(self, model: PreTrainedModel, *, max_batch_size: int = 64, max_context: int | None = None,
                 seed: int = 0) -> None:  # fmt: skip
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        super().__init__(max_context or int(model.config.max_position_embeddings))
        self.model = model
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self._seeds = itertools.count(seed * 1_000_003)
        self._rows: list[_Request] = []  # the running batch, in cache row order
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # (B, L) 1 where the cache column holds a real token

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu", **kwargs) -> HFEngine:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
        return cls(model, **kwargs)

    # -- requests --------------------------------------------------------------------

    def _new_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                     loop: asyncio.AbstractEventLoop) -> _Request:  # fmt: skip
        seed = params.seed if params.seed is not None else next(self._seeds)
        generator = torch.Generator(self.device).manual_seed(seed)
        return _Request(id=request_id, prompt=prompt, params=params, loop=loop, future=loop.create_future(),
                        generator=generator)  # fmt: skip

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No decode step runs inside this block (for in-place updates of a shared model)."""
        with self._lock:
            yield

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None, *,
                             lora: Mapping[str, torch.Tensor] | None = None) -> int:  # fmt: skip
        return await asyncio.to_thread(self._install, state_dict, lora)

    def _install(self, state_dict: Mapping[str, torch.Tensor] | None, lora: Mapping[str, torch.Tensor] | None) -> int:
        if state_dict is not None and lora is not None:
            raise ValueError("pass either a full state_dict or a LoRA adapter, not both")
        with self._lock, torch.no_grad():
            if lora is not None:
                from peft import PeftModel, set_peft_model_state_dict

                if not isinstance(self.model, PeftModel):
                    raise ValueError("a LoRA update needs the engine's model to be a peft PeftModel")
                result = set_peft_model_state_dict(self.model, dict(lora))
                if result.unexpected_keys:
                    raise ValueError(f"LoRA update has keys the adapter lacks: {result.unexpected_keys[:5]}")
            elif state_dict is not None:
                self.model.load_state_dict(dict(state_dict), strict=True)
            # Neither: the module is shared with the trainer and already holds the new weights.
            self._version += 1
            return self._version

    # -- the decode loop (engine thread) --------------------------------------------

    def _busy(self) -> bool:
        return bool(self._rows)

    def _take(self) -> list[Request]:
        room = self.max_batch_size - len(self._rows)
        return [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]

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
        """Feed each row's last sampled token; sample the next one."""
        assert self._cache is not None and self._mask is not None
        B = len(self._rows)
        input_ids = torch.tensor([[r.tokens[-1]] for r in self._rows], device=self.device)  # (B, 1)
        positions = torch.tensor([[r.n_ctx] for r in self._rows], device=self.device)  # (B, 1)
        self._mask = torch.cat([self._mask, self._mask.new_ones(B, 1)], dim=1)  # (B, L+1)
        out = self.model(input_ids=input_ids, attention_mask=self._mask, position_ids=positions,
                         past_key_values=self._cache, use_cache=True)  # fmt: skip
        for r in self._rows:
            r.n_ctx += 1
        self._sample(self._rows, out.logits[:, -1])

    def _prefill(self, reqs: list[_Request]) -> None:
        """Left-padded prefill of new prompts, merged into the running batch."""
        L = max(len(r.prompt) for r in reqs)
        ids = torch.zeros(len(reqs), L, dtype=torch.long, device=self.device)  # (n, L)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            ids[i, L - len(r.prompt) :] = torch.tensor(r.prompt, device=self.device)
            mask[i, L - len(r.prompt) :] = 1
            r.n_ctx = len(r.prompt)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        self._merge(reqs, cache, mask)
        self._sample(reqs, out.logits[:, -1])

    def _merge(self, reqs: list[_Request], cache: DynamicCache, mask: torch.Tensor) -> None:
        if self._cache is None or not self._rows:
            self._rows, self._cache, self._mask = list(reqs), cache, mask
            return
        L = max(mask.shape[1], self._mask.shape[1])

        def lpad(t: torch.Tensor, dim: int) -> torch.Tensor:  # left-pad dim `dim` up to L
            pad = [0, 0] * (t.dim() - 1 - dim) + [L - t.shape[dim], 0]
            return F.pad(t, pad)

        layers = [
            (torch.cat([lpad(a.keys, 2), lpad(b.keys, 2)]), torch.cat([lpad(a.values, 2), lpad(b.values, 2)]))
            for a, b in zip(self._cache.layers, cache.layers, strict=True)
        ]
        self._cache = DynamicCache(layers)
        self._mask = torch.cat([lpad(self._mask, 1), lpad(mask, 1)])
        self._rows.extend(reqs)

    def _sample(self, rows: list[_Request], logits: torch.Tensor) -> None:
        """Sample one token per row (logits (B, V)); rows with the same settings in one pass."""
        by_setting: dict[tuple[float, int, float], list[int]] = {}
        for i, r in enumerate(rows):
            by_setting.setdefault((r.params.temperature, r.params.top_k, r.params.top_p), []).append(i)
        for (temperature, top_k, top_p), idx in by_setting.items():
            logq = sampling_logprobs(logits[idx], temperature, top_k, top_p)  # (n, V)
            ys = sample(logq, temperature, [rows[i].generator for i in idx])  # (n,)
            lps = logq.gather(-1, ys[:, None])[:, 0].tolist()
            for i, y, lp in zip(idx, ys.tolist(), lps, strict=True):
                r = rows[i]
                r.tokens.append(y)
                r.logprobs.append(lp)
                r.versions.append(self._version)
                if y in r.params.stop_token_ids:
                    r.finish = "stop"
                elif len(r.tokens) >= r.params.max_tokens:
                    r.finish = "length"

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if r.finish is None]
        if len(keep) == len(self._rows):
            return
        for r in self._rows:
            if r.finish is not None:
                self._resolve(r)
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._cache = self._mask = None
            return
        idx = torch.tensor(keep, device=self.device)
        self._mask = self._mask[idx]
        start = int((self._mask.sum(0) > 0).long().argmax())  # first column some row still uses
        self._mask = self._mask[:, start:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]
