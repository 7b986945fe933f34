"""Scoring: lp_θ of every token of a batch under the trainer's policy (and its entropy and router logits),
the one forward pass the update, its diagnostics and checkpoints share."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from agentrl.engine.base import SamplingParams
from agentrl.models.cache import CACHE
from agentrl.train.logprobs import check_plain_head, target_logprobs
from agentrl.train.policy import causal_lm
from agentrl.train.replay import RoutingReplay


class Scorer(nn.Module):
    """lp_θ of every token given its prefix, without the (B, T, V) logits; the FSDP2 root.

    Position t of the output scores token t from the hidden state at t − 1 (position 0 and the padding: 0).

    Length buckets: rows are scored in chunks of similar length (sorted, at most
    `chunk_tokens` padded positions each) and put back in order, so one long episode does
    not pad the whole batch to its length (attention and masks grow with B·L²). Every row is
    scored on its own, so the results and, through one backward over all chunks, the
    gradients are those of the unchunked batch.

    Shared prefix tree: the rows of a rollout batch start alike (the system prompt and tool
    schemas, for a group also the task), and a trajectory's rows (its turns re-rendered, each
    row's context a prefix of the next's) much more. Within a chunk, rows longest first, each
    row takes its first P positions from the row before it that it starts alike with longest
    (P kept below its length; a root, run whole, if P < `min_shared_prefix`): the rows of a
    parent and P run positions P on, on the parent's KV cache of positions < P (a view,
    expanded to the rows), their values before P are the parent's and position P is scored
    from the parent's hidden state at P − 1, so the decoder and the lm head run each
    distinct prefix once: about the distinct tokens, not Σ length (a trajectory of K turns:
    O(K), not O(K²)). The same lp_θ, entropy and router logits, and, since the expanded KV
    sums the rows' gradients into their parent's, the same gradients. Off under activation
    checkpointing (its recomputation would replay the cache update), and for a model whose
    KV cache is not transformers' plain `DynamicLayer` in every layer (sliding-window,
    linear-attention, …: a cropped cache would not be its first P positions). With a routing
    to replay, a position is shared only where the rows' routing is the same too.

    Routing replay (`replay`, MoE; agentrl.train.replay): `routing` (B, L, layers, k), position-indexed, routes
    each position with a record (≥ 0) to those experts, the gate weights recomputed from the learner's
    router logits; the router logits returned are the router's own.
    """

    def __init__(
        self,
        policy: nn.Module,
        *,
        min_shared_prefix: int = 32,
        chunk_tokens: int = 16384,
        replay: bool = False,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        check_plain_head(causal_lm(policy))
        self.policy = policy
        self.device = device
        """where the forward runs (None: on its inputs' device); the inputs may then be host tensors"""
        self.min_shared_prefix = min_shared_prefix
        self.chunk_tokens = chunk_tokens
        self.replay = RoutingReplay(policy) if replay else None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        *,
        entropy: bool = False,
        router: bool = False,
        routing: torch.Tensor | None = None,
    ):
        """(lp (B, L), entropy (B, L) or None, router logits per layer (B·L, E) or None), on `self.device`.

        The plan (chunks, the prefix tree, which positions are scored) is made from host copies of the ids and
        the mask: given on the host, the forward reads nothing back from the device."""
        if routing is not None:
            if self.replay is None:
                raise ValueError("a routing to replay needs a Scorer built with replay=True")
            self.replay.check(routing)
        device = self.device or input_ids.device
        host = input_ids.cpu(), attention_mask.cpu(), None if routing is None else routing.cpu()
        on_device = tuple(
            None if x is None else x.to(device, non_blocking=True) for x in (input_ids, attention_mask, routing)
        )
        B, L = input_ids.shape
        lengths = host[1].sum(-1)
        order = torch.argsort(lengths, descending=True, stable=True)
        parts, start = [], 0
        while start < B:
            Lc = max(int(lengths[order[start]]), 1)  # the chunk's longest row: the first, sorted
            rows = order[start : start + max(1, self.chunk_tokens // Lc)]
            rows_d = rows.to(device, non_blocking=True)
            chunk = [None if x is None else x[rows, :Lc] for x in host]
            chunk += [None if x is None else x[rows_d, :Lc] for x in on_device]
            parts.append(self._score(*chunk, params, entropy, router))
            start += len(rows)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(B)
        inverse = inverse.to(device, non_blocking=True)

        def cat(chunks: list[torch.Tensor]) -> torch.Tensor:  # (n, Lc, ...) each -> (B, L, ...) in sorted order
            return torch.cat([F.pad(c, (0, 0) * (c.dim() - 2) + (0, L - c.shape[1])) for c in chunks])

        lp = cat([p[0] for p in parts])[inverse]
        ent = cat([p[1] for p in parts])[inverse] if entropy else None
        routed = None
        if router:
            # (B·L, E) per layer, gathered in row order from the flattened sorted rows: a tensor of its own, never a
            # view (FSDP2 warns that an in-place op on a view its module returned would skip its hooks)
            flat = (inverse[:, None] * L + torch.arange(L, device=inverse.device)).flatten()
            routed = tuple(cat([p[2][k] for p in parts]).flatten(0, 1)[flat] for k in range(len(parts[0][2])))
        return lp, ent, routed

    def _score(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        routing_h: torch.Tensor | None,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        routing: torch.Tensor | None,
        params: SamplingParams,
        entropy: bool,
        router: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        """One chunk, given on the host (ids, mask, routing_h: the plan's) and on the device (what runs): lp and
        entropy (B, L), router logits per layer (B, L, E); 0 on the padding."""
        lm = causal_lm(self.policy)
        decoder, head = lm.get_decoder(), lm.get_output_embeddings().weight
        kwargs = {"output_router_logits": True} if router else {}

        def replay(part: torch.Tensor | None) -> dict[str, torch.Tensor]:  # RoutingReplay's hooks take it
            return {} if part is None else {"routing_replay": part}

        B, L = input_ids.shape
        device = input_ids.device
        lengths = mask.sum(-1)  # (B,)
        length = lengths.tolist()  # the same, as ints
        forwards = self._plan(ids, mask, routing_h)
        parents = {parent for parent, _, _ in forwards}
        # The own positions of a row: P..length − 1 (a root's: all). Numbered in the forwards' order, they are where
        # every value is computed, once; src (B, L) says which one each row's position takes: its own, or before P
        # its parent's (and so on up the tree); N, a zero after the last, on the padding.
        src, first, N = torch.full((B, L), -1), torch.zeros(B, dtype=torch.long), 0
        for parent, P, rows in forwards:
            for r in rows:
                src[r, :P] = src[parent, :P]
                src[r, P : length[r]] = torch.arange(N, N + length[r] - P)
                first[r], N = P, N + length[r] - P
        src = src.masked_fill(src < 0, N)

        def to_device(x: torch.Tensor) -> torch.Tensor:
            return x.to(device, non_blocking=True)

        hidden, routed, caches = [], [], {}  # (own positions, H) per forward; a parent row's (KV cache, batch index)
        for parent, P, rows in forwards:
            n, W = len(rows), max(P + 1, *(length[r] for r in rows))  # positions P..W − 1 of n rows
            index = to_device(torch.tensor(rows))
            out = decoder(
                input_ids=input_ids[index, P:W],
                attention_mask=attention_mask[index, :W],
                use_cache=parent >= 0 or not parents.isdisjoint(rows),  # a cache in, or one a child takes
                **({} if parent < 0 else {CACHE: _prefix(*caches[parent], P, n)}),
                **kwargs,
                **replay(None if routing is None else routing[index, P:W]),
            )
            # (n·(W − P),) -> the positions that are not padding, in order
            own = to_device((torch.arange(P, W) < lengths[rows, None]).flatten().nonzero()[:, 0])
            hidden.append(out.last_hidden_state.flatten(0, 1)[own])
            if router:
                routed.append([logits.view(n * (W - P), -1)[own] for logits in out.router_logits])
            caches.update({r: (getattr(out, CACHE), i) for i, r in enumerate(rows) if r in parents})

        # lp of each own position t ≥ 1, from the hidden state at t − 1 (the row's own, or at P its parent's): the
        # lm head runs once per distinct token
        positions = torch.arange(L)
        scored = (positions[1:] >= first[:, None]) & (positions[1:] < lengths[:, None])  # (B, L − 1)
        at, before, targets = (to_device(x[scored]) for x in (src[:, 1:], src[:, :-1], ids[:, 1:]))  # (M,) each
        src = to_device(src)
        lp, ent = target_logprobs(torch.cat(hidden)[before][None], head, targets[None], params, entropy=entropy)

        def spread(values: torch.Tensor) -> torch.Tensor:  # (M,) at `at` -> (B, L): every row's positions
            return values.new_zeros(N + 1).index_put((at,), values)[src]

        lp, ent = spread(lp[0]), spread(ent[0]) if entropy else None
        if router:  # (N, E) per layer, and the zero row -> (B, L, E)
            routed = tuple(F.pad(torch.cat(layer), (0, 0, 0, 1))[src] for layer in zip(*routed, strict=True))
        return lp, ent, routed if router else None

    def _plan(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, routing: torch.Tensor | None = None
    ) -> list[tuple[int, int, list[int]]]:
        """The prefix tree as the forwards that run it, each after its parent's: (parent, P, rows), rows that run
        positions P on, on the parent row's KV cache of positions < P; the roots first, as (-1, 0, roots).

        Rows longest first, each takes from the row planned before it that it starts alike with longest (with a
        routing to replay, routed alike too), P kept below its length; a root if P < `min_shared_prefix`."""
        B = input_ids.shape[0]
        lengths = attention_mask.sum(-1)
        order = torch.argsort(lengths, descending=True, stable=True)
        lm = causal_lm(self.policy)
        # transformers 5.24 renamed the flag (the old name warns)
        checkpointing = getattr(lm, "is_activation_checkpointing", None)
        if checkpointing is None:
            checkpointing = lm.is_gradient_checkpointing
        # a cropped KV cache is the positions < P of each layer's keys and values: full attention's plain layer only
        plain = all(type(layer) is DynamicLayer for layer in DynamicCache(config=lm.config).layers)
        parent, shared = [0] * B, [0] * B  # in planning order: the index of the parent there, P
        if plain and not checkpointing:
            ids, on = input_ids[order], attention_mask[order].bool()
            if routing is not None:  # (B, L): one number per distinct routing record (layers, k)
                _, record = torch.unique(routing[order].flatten(2).flatten(0, 1), dim=0, return_inverse=True)
                record = record.view(B, -1)

            def alike(j: int) -> torch.Tensor:  # (B, L): where each row holds row j's token (routed alike)
                same = (ids == ids[j]) & on & on[j]
                return same if routing is None else same & (record == record[j])

            common = torch.stack([alike(j).long().cumprod(1).sum(1) for j in range(B)])  # (B, B): first positions alike
            earlier = torch.ones(B, B, dtype=torch.bool, device=common.device).tril(-1)  # (B, B): planned before
            # ties to the first (longest) row: rows sharing only the system prompt all take from the one longest
            longest, parent = common.masked_fill(~earlier, -1).max(1)
            parent, shared = parent.tolist(), torch.minimum(longest, lengths[order] - 1).tolist()
        # rows of one parent and P run together on its KV, expanded (no copy); rows of other parents with the same P
        # would need their KVs concatenated (a copy), and a row's parent is mostly its trajectory's own longest row
        forwards: dict[tuple[int, int], list[int]] = {}
        order = order.tolist()
        for j, row in enumerate(order):
            key = (order[parent[j]], shared[j]) if shared[j] >= max(self.min_shared_prefix, 1) else (-1, 0)
            forwards.setdefault(key, []).append(row)
        return [(p, P, rows) for (p, P), rows in forwards.items()]

    def _shared_prefix(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, routing: torch.Tensor | None = None
    ) -> int:
        """P: the positions all rows start with alike (routed alike, with a routing to replay), kept below every row's
        length, where they make one tree (the tree's shallowest P); 0 where not."""
        (_, _, roots), *children = self._plan(input_ids, attention_mask, routing)
        return min((P for _, P, _ in children), default=0) if len(roots) == 1 else 0


def _prefix(cache: Cache, row: int, P: int, n: int) -> Cache:
    """`cache` of row `row` cropped to its first P positions, for n rows: a shallow copy whose layers see a view of
    the keys and values (n, heads, P, head dim), expanded, so the rows' gradients sum into the one prefix."""
    prefix = copy.copy(cache)
    prefix.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in prefix.layers:
        layer.keys = layer.keys[row : row + 1, :, :P].expand(n, -1, -1, -1)
        layer.values = layer.values[row : row + 1, :, :P].expand(n, -1, -1, -1)
    return prefix
