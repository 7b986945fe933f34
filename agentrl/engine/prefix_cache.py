"""Automatic prefix caching for the `hf` engine: reuse the KV of tokens seen before.

Agent rollouts resend almost the same prompt every turn: turn k+1's prompt is turn k's
prompt, its generated tokens and an observation delta; the G samples of a group share the
task prompt, and every task shares the system prompt and tool schemas. Without reuse each
turn re-prefills the whole context, which dominates on CPU.

Entries are token id sequences with their per-layer KV (one row, padding removed). A new
prompt reuses the entry with the longest common prefix (causal attention: the KV of the
first m tokens depends on those m tokens only) and prefills the rest. Content keyed, like
vLLM's automatic prefix caching, so callers need no session ids. The KV belongs to one set
of weights: the engine clears the cache on every weight update, or tokens sampled after it
would not come from the current policy. Bounded by a token budget, least recently used out.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (heads, n, head_dim)


def common_prefix(a: list[int] | torch.Tensor, b: list[int] | torch.Tensor) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    a, b = torch.as_tensor(a[:n]), torch.as_tensor(b[:n])
    diff = (a != b).nonzero()
    return int(diff[0]) if len(diff) else n


@dataclass(eq=False)
class _Entry:
    ids: torch.Tensor  # (n,) long
    kv: KV


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._tokens = 0
        self._keys = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens

    def lookup(self, prompt: list[int]) -> tuple[int, KV | None]:
        """The longest cached prefix of `prompt` (at most len - 1 tokens: the last is prefilled
        for its logits) and its KV, or (0, None)."""
        limit = len(prompt) - 1
        if limit < 1 or not self._entries:
            return 0, None
        q = torch.tensor(prompt[:limit])
        best, best_m = None, 0
        for key, e in self._entries.items():
            m = common_prefix(e.ids, q)
            if m > best_m:
                best, best_m = key, m
        if best is None:
            return 0, None
        self._entries.move_to_end(best)
        e = self._entries[best]
        return best_m, [(k[:, :best_m], v[:, :best_m]) for k, v in e.kv]

    def insert(self, ids: list[int], kv: KV) -> None:
        """Remember `ids` (KV columns one per id). Entries it extends are dropped: it serves them."""
        if self.max_tokens <= 0 or not ids or len(ids) > self.max_tokens:
            return
        new = torch.tensor(ids)
        for key, e in list(self._entries.items()):
            n = len(e.ids)
            if n <= len(new) and torch.equal(e.ids, new[:n]):
                self._drop(key)
            elif n > len(new) and torch.equal(e.ids[: len(new)], new):
                self._entries.move_to_end(key)  # already served by a longer entry
                return
        self._entries[next(self._keys)] = _Entry(new, kv)
        self._tokens += len(new)
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def _drop(self, key: int) -> None:
        self._tokens -= len(self._entries.pop(key).ids)
