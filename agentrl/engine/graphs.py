"""The `hf` engine's decode step over fixed shapes, and its CUDA graphs.

A decode step launches hundreds of small kernels (the "1b" shape: 16 layers of attention, router and experts),
and on a GPU the host's launches, not the kernels, set its pace. A CUDA graph replays a captured step's kernels
in one launch, but only over the shapes and addresses it was captured with. So this step runs over fixed shapes:

- the batch is padded to a bucket of rows (1, 2, 4, ... up to the engine's max_batch_size): a graph per bucket;
- the attention reads every column of the KV storage (`SlabLayer.static`), those outside a row's context
  masked, so its cost follows the storage's width (at most about 1.5x the live width: `SlabLayer._reserve`);
- the inputs are copied into buffers the graph reads: the ids, the positions, the 4D mask, the column written.

A bucket's graph is captured at its first step and replayed while the KV storage stays where it is; when the
storage grows (a longer context), the graphs are dropped and captured again over the new one. A weight update
copies into the same parameters, so graphs survive it; an engine sharing the learner's module cannot use them
(that module promises no fixed addresses for its weights).

Without capture the same fixed-shape step runs eagerly: that is how the CPU checks its numerics.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from agentrl.engine.kv import SlabLayer
from agentrl.models.cache import CACHE


class FixedShapeDecode:
    """Decode steps of `model` over fixed shapes, captured in CUDA graphs when `capture`.

    `records`: a list the model's forward hooks fill at each forward (the engine's routing records); a graph's
    own entries, its output tensors, are put back at each of its replays."""

    def __init__(
        self, model: PreTrainedModel, max_rows: int, *, capture: bool, records: list[torch.Tensor | None] | None = None
    ) -> None:
        self.model = model
        self.capture = capture
        self.buckets = sorted({min(1 << i, max_rows) for i in range(max_rows.bit_length() + 1)})
        self.records = records
        self.captures = 0  # graphs captured so far
        self._storage: torch.Tensor | None = None  # the KV storage the buffers and graphs were made for
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list]] = {}
        self._pool = None  # the graphs' memory pool, one per KV storage (`_reset`)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def __call__(self, cache: Cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The last logits (B, V) of one decode step: `ids` (B,) fed at `positions` (B, 1), `mask` (B, width + 1)
        the live columns' mask and the new column's; the new column becomes live in every layer."""
        rows, b = ids.shape[0], self.bucket(ids.shape[0])
        layers: list[SlabLayer] = cache.layers
        for layer in layers:
            layer.reserve(b)
        if layers[0].storage is not self._storage:
            self._reset(layers[0].storage)
        lo, hi = layers[0].columns
        self._ids[:rows] = ids
        self._positions[:rows] = positions
        self._mask.zero_()
        self._mask[:rows, 0, 0, lo : hi + 1] = mask
        self._mask[rows:b, 0, 0, hi] = True  # padding rows attend to their own column: no row is all masked
        self._column.fill_(hi)
        for layer in layers:
            layer.static = (self._column, b)
        try:
            logits = self._run(cache, b)
        finally:
            for layer in layers:
                layer.static = None
        for layer in layers:
            layer.advance()
        return logits[:rows]

    def _reset(self, storage: torch.Tensor) -> None:
        rows, _, columns, _ = storage.shape
        device = storage.device
        self._storage = storage
        self._graphs.clear()
        # a new pool for the new graphs: capturing again into a pool whose graphs are gone while tensors in it live on
        # (the last step's logits, the routing records) has met PyTorch's internal use_count assert elsewhere
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._ids = torch.zeros(rows, dtype=torch.long, device=device)
        self._positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._mask = torch.zeros(rows, 1, 1, columns, dtype=torch.bool, device=device)
        self._column = torch.zeros(1, dtype=torch.long, device=device)

    def _forward(self, cache: Cache, b: int) -> torch.Tensor:
        out = self.model(
            input_ids=self._ids[:b, None],
            attention_mask=self._mask[:b],
            position_ids=self._positions[:b],
            use_cache=True,
            **{CACHE: cache},
        )
        return out.logits[:, -1]

    def _run(self, cache: Cache, b: int) -> torch.Tensor:
        if not self.capture:
            return self._forward(cache, b)
        if b not in self._graphs:
            # a warm-up on a side stream first (lazy initialisation, kernel choices), as capture requires
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(cache, b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # one memory pool for every bucket's graph over this storage: a graph's intermediates may lie where
            # another's outputs do, which is safe because each replay's outputs are consumed (queued on the same
            # stream) before the next replay. thread_local: a learner in another thread may use the GPU meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._forward(cache, b)
            self._graphs[b] = (graph, logits, list(self.records or ()))
            self.captures += 1
        graph, logits, records = self._graphs[b]
        graph.replay()
        if self.records is not None:
            self.records[:] = records
        return logits
