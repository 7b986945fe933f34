"""The `hf` engine's batch KV cache: one slab per layer that rows join and leave in place.

Rows are requests and columns positions; every row's newest token sits in the same (last)
column, shorter rows are left-padded and the padding is masked. The storage keeps spare rows
and spare columns on both sides, so each operation of continuous batching copies only what
changes: a decode step writes one column, a joining request writes its own rows, a finished
one is overwritten by a row from the end. transformers' DynamicLayer re-concatenates the whole
layer on every step (and a join or a leave would copy the whole batch); on CPU those copies
cost more than the attention itself. Storage never written holds zeros, storage left behind
holds stale KV: finite either way, and always masked.

For a decode step of fixed shapes (`agentrl.engine.graphs`, what a CUDA graph replays), `static`
makes `update` write the new column at a device index into the first rows of the storage and
hand the attention every column of them; the engine then advances the live columns itself
(`advance`), since a replayed graph runs no Python. `storage` names the storage: a graph holds
its addresses, and a new one (`_reserve` grew it) needs a new graph.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class SlabLayer(DynamicLayer):
    def __init__(self) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None  # (row capacity, heads, column capacity, head_dim)
        self._v: torch.Tensor | None = None
        self._rows = self._lo = self._hi = 0  # live rows [0, rows), live columns [lo, hi)
        self.static: tuple[torch.Tensor, int] | None = None  # (column (1,) on the device, rows): see the docstring

    @property
    def storage(self) -> torch.Tensor | None:
        """The keys' storage (the values' is allocated with it)."""
        return self._k

    @property
    def columns(self) -> tuple[int, int]:
        """The live columns [lo, hi) within the storage's."""
        return self._lo, self._hi

    @property
    def width(self) -> int:
        return self._hi - self._lo

    def _init(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.lazy_initialization(keys, values)
        H, D = keys.shape[1], keys.shape[3]
        self._k, self._v = keys.new_zeros(0, H, 0, D), values.new_zeros(0, H, 0, D)

    def _sync(self) -> None:
        self.keys = self._k[: self._rows, :, self._lo : self._hi]
        self.values = self._v[: self._rows, :, self._lo : self._hi]

    def _reserve(self, rows: int, left: int, right: int) -> None:
        """Room for `rows` more rows, `left` more columns before the live ones and `right` after."""
        cap_rows, H, cap_cols, D = self._k.shape
        if self._rows + rows <= cap_rows and self._lo >= left and self._hi + right <= cap_cols:
            return
        n, w = self._rows + rows, self.width
        pad_l, pad_r = left + 64 + w // 4, right + 64 + w // 2
        k = self._k.new_zeros(max(n, cap_rows, n + n // 4), H, pad_l + w + pad_r, D)
        v = self._v.new_zeros(k.shape)
        k[: self._rows, :, pad_l : pad_l + w] = self._k[: self._rows, :, self._lo : self._hi]
        v[: self._rows, :, pad_l : pad_l + w] = self._v[: self._rows, :, self._lo : self._hi]
        self._k, self._v, self._lo, self._hi = k, v, pad_l, pad_l + w

    # -- what the model calls ---------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.static is not None:
            column, rows = self.static
            self._k[:rows].index_copy_(2, column, key_states)
            self._v[:rows].index_copy_(2, column, value_states)
            return self._k[:rows], self._v[:rows]
        s = key_states.shape[2]
        if self._k is None:  # a fresh prefill
            self._init(key_states, value_states)
            self._reserve(key_states.shape[0], 0, s)
            self._rows = key_states.shape[0]
        self._reserve(0, 0, s)
        self._k[: self._rows, :, self._hi : self._hi + s] = key_states
        self._v[: self._rows, :, self._hi : self._hi + s] = value_states
        self._hi += s
        self._sync()
        return self.keys, self.values

    # -- what the engine calls --------------------------------------------------------

    @classmethod
    def assemble(cls, parts: list[tuple[torch.Tensor, torch.Tensor] | None], width: int, extra: int) -> SlabLayer:
        """A slab of one row per part: its (keys, values) of shape (heads, n, head_dim) right-aligned
        in `width` columns (None: an empty row), with room for `extra` more columns."""
        like = next(p for p in parts if p is not None)
        layer = cls()
        layer._init(like[0][None], like[1][None])
        layer._reserve(len(parts), 0, width + extra)
        layer._rows, layer._hi = len(parts), layer._lo + width
        for i, p in enumerate(parts):
            if p is not None:
                n = p[0].shape[1]
                layer._k[i, :, layer._hi - n : layer._hi] = p[0]
                layer._v[i, :, layer._hi - n : layer._hi] = p[1]
        layer._sync()
        return layer

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New rows (b, heads, n, head_dim), right-aligned with the live ones (their last columns
        line up); when n is wider than the live columns, the live rows gain masked columns."""
        if self._k is None:
            self._init(keys, values)
        b, n = keys.shape[0], keys.shape[2]
        self._reserve(b, max(0, n - self.width), 0)
        self._lo = min(self._lo, self._hi - n)
        self._k[self._rows : self._rows + b, :, self._hi - n : self._hi] = keys
        self._v[self._rows : self._rows + b, :, self._hi - n : self._hi] = values
        self._rows += b
        self._sync()

    def reserve(self, rows: int) -> None:
        """Storage for at least `rows` rows and one more live column (a fixed-shape step pads the batch)."""
        self._reserve(max(0, rows - self._rows), 0, 1)

    def advance(self) -> None:
        """A fixed-shape step wrote the next column: it is live now."""
        self._hi += 1
        self._sync()

    def remove_rows(self, holes: torch.Tensor, sources: torch.Tensor, rows: int, drop_columns: int) -> None:
        """Keep the first `rows` rows, after moving row sources[i] into row holes[i]; drop the first
        `drop_columns` live columns (no row uses them any more)."""
        if len(holes):
            self._k[holes, :, self._lo : self._hi] = self._k[sources, :, self._lo : self._hi]
            self._v[holes, :, self._lo : self._hi] = self._v[sources, :, self._lo : self._hi]
        self._rows = rows
        self._lo += drop_columns
        self._sync()
