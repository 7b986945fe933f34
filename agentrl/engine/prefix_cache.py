"""Automatic prefix caching for the `hf` engine: reuse the KV of tokens seen before.

Agent rollouts resend almost the same prompt every turn: turn k+1's prompt is turn k's
prompt, its generated tokens and an observation delta; the G samples of a group share the
task prompt, and every task shares the system prompt and tool schemas. Without reuse each
turn re-prefills the whole context, which dominates on CPU.

Entries are token id sequences with their per-layer KV (one row, padding removed) and, when
the engine records MoE routing, each position's experts: a hit's routing is the one its KV was
computed with, so what a request reports for its prompt is what conditioned its tokens. A new
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
from typing import NamedTuple

import torch
import torch.nn.functional as F

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (heads, n, head_dim)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    diff = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return int(diff[0]) if len(diff) else n


@dataclass(eq=False)
class _Entry:
    ids: torch.Tensor  # (n,) long
    kv: KV
    routing: torch.Tensor | None  # (n, layers, k): each position's experts, when recorded


class Hit(NamedTuple):
    tokens: int
    """m: how many leading tokens of the prompt the entry holds (0: no hit)"""
    kv: KV | None
    routing: torch.Tensor | None
    """(m, layers, k) when the entry recorded it"""


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._tokens = 0
        self._keys = itertools.count()
        # every entry's ids, one row each, padded with -1, so one compare serves all entries
        self._rows: list[int] = []  # the key of each row
        self._table = torch.empty(0, 0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens

    def _matches(self, ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Every entry's key and how many leading tokens it shares with `ids`."""
        n = min(len(ids), self._table.shape[1])
        return self._rows, (self._table[:, :n] == ids[:n]).cumprod(1).sum(1)

    def lookup(self, prompt: list[int]) -> Hit:
        """The longest cached prefix of `prompt` (at most len - 1 tokens: the last is prefilled
        for its logits) with its KV and routing, or Hit(0, None, None)."""
        if len(prompt) < 2 or not self._entries:
            return Hit(0, None, None)
        keys, shared = self._matches(torch.tensor(prompt[:-1]))
        m, row = (int(x) for x in shared.max(0))
        if m == 0:
            return Hit(0, None, None)
        self._entries.move_to_end(keys[row])
        entry = self._entries[keys[row]]
        routing = None if entry.routing is None else entry.routing[:m]
        return Hit(m, [(k[:, :m], v[:, :m]) for k, v in entry.kv], routing)

    def insert(self, ids: list[int], kv: KV, routing: torch.Tensor | None = None) -> None:
        """Remember `ids` (KV columns one per id; `routing` (len(ids), layers, k) when recorded). Entries it
        extends are dropped: it serves them."""
        if self.max_tokens <= 0 or not ids or len(ids) > self.max_tokens:
            return
        new = torch.tensor(ids)
        if self._entries:
            keys, shared = self._matches(new)
            for key, m in zip(list(keys), shared.tolist(), strict=True):
                n = len(self._entries[key].ids)
                if m == n:  # a prefix of the new one
                    self._drop(key)
                elif m == len(new):  # the new one is a prefix of it: already served
                    self._entries.move_to_end(key)
                    return
        key = next(self._keys)
        self._entries[key] = _Entry(new, kv, routing)
        width = max(self._table.shape[1], len(new))
        self._table = torch.cat(
            [
                F.pad(self._table, (0, width - self._table.shape[1]), value=-1),
                F.pad(new, (0, width - len(new)), value=-1)[None],
            ]
        )
        self._rows.append(key)
        self._tokens += len(new)
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._rows, self._table = [], self._table[:0]
        self._tokens = 0

    def _drop(self, key: int) -> None:
        self._tokens -= len(self._entries.pop(key).ids)
        row = self._rows.index(key)
        del self._rows[row]
        self._table = torch.cat([self._table[:row], self._table[row + 1 :]])
