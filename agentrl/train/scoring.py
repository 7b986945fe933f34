"""Scoring: lp_θ of every token of a batch under the trainer's policy (and its entropy and router logits),
the one forward pass the update, its diagnostics and checkpoints share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.engine.base import SamplingParams
from agentrl.models.cache import CACHE
from agentrl.train.logprobs import target_logprobs
from agentrl.train.policy import causal_lm
from agentrl.train.replay import RoutingReplay


class Scorer(nn.Module):
    """lp_θ of every token given its prefix, without the (B, T, V) logits; the FSDP2 root.

    Position t of the output scores token t from the hidden state at t − 1 (position 0: 0).

    Length buckets: rows are scored in chunks of similar length (sorted, at most
    `chunk_tokens` padded positions each) and put back in order, so one long episode does
    not pad the whole batch to its length (attention and masks grow with B·L²). Every row is
    scored on its own, so the results and, through one backward over all chunks, the
    gradients are those of the unchunked batch.

    Shared prefix: the rows of a rollout batch start with the same tokens (the system prompt
    and tool schemas, for a group also the task), often most of each row. When all rows of a
    chunk share their first P ≥ `min_shared_prefix` tokens, those P are run once (one row, its
    KV cache broadcast to the rows) and only the suffixes run per row: the same lp_θ, entropy
    and router logits, and, since the broadcast sums the rows' gradients into the one prefix,
    the same gradients, for about P·(B − 1) fewer token forwards and backwards. Off under
    activation checkpointing (its recomputation would replay the cache update). With a routing to
    replay, a position is shared only where every row's routing is the same too.

    Routing replay (`replay`, MoE; agentrl.train.replay): `routing` (B, L, layers, k), position-indexed, routes
    each position with a record (≥ 0) to those experts, the gate weights recomputed from the learner's
    router logits; the router logits returned are the router's own.
    """

    def __init__(
        self, policy: nn.Module, *, min_shared_prefix: int = 32, chunk_tokens: int = 16384, replay: bool = False
    ) -> None:
        super().__init__()
        self.policy = policy
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
        """(lp (B, L), entropy (B, L) or None, router logits per layer (B·L, E) or None)."""
        if routing is not None:
            if self.replay is None:
                raise ValueError("a routing to replay needs a Scorer built with replay=True")
            self.replay.check(routing)
        B, L = input_ids.shape
        lengths = attention_mask.sum(-1)
        order = torch.argsort(lengths, descending=True, stable=True)
        parts, start = [], 0
        while start < B:
            Lc = max(int(lengths[order[start]]), 1)  # the chunk's longest row: the first, sorted
            rows = order[start : start + max(1, self.chunk_tokens // Lc)]
            chunk = None if routing is None else routing[rows, :Lc]
            parts.append(self._score(input_ids[rows, :Lc], attention_mask[rows, :Lc], params, entropy, router, chunk))
            start += len(rows)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(B, device=order.device)

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
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        entropy: bool,
        router: bool,
        routing: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        """One chunk: lp and entropy (B, L), router logits per layer (B, L, E)."""
        lm = causal_lm(self.policy)
        decoder, head = lm.get_decoder(), lm.get_output_embeddings().weight
        kwargs = {"output_router_logits": True} if router else {}

        def replay(part: torch.Tensor | None) -> dict[str, torch.Tensor]:  # RoutingReplay's hooks take it
            return {} if part is None else {"routing_replay": part}

        B, L = input_ids.shape
        P = self._shared_prefix(input_ids, attention_mask, routing)
        if P == 0:
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs, **replay(routing))
            lp, ent = target_logprobs(out.last_hidden_state[:, :-1], head, input_ids[:, 1:], params, entropy=entropy)
            routed = tuple(r.view(B, L, -1) for r in out.router_logits) if router else None
        else:
            pre = decoder(
                input_ids=input_ids[:1, :P],
                use_cache=True,
                **kwargs,
                **replay(None if routing is None else routing[:1, :P]),
            )
            prefix = getattr(pre, CACHE)
            for layer in prefix.layers:  # one row's KV, seen by all B rows (gradients sum back)
                layer.keys, layer.values = layer.keys.expand(B, -1, -1, -1), layer.values.expand(B, -1, -1, -1)
            suf = decoder(
                input_ids=input_ids[:, P:],
                attention_mask=attention_mask,
                use_cache=True,
                **{CACHE: prefix},
                **kwargs,
                **replay(None if routing is None else routing[:, P:]),
            )
            # tokens 1..P-1 from the shared row; tokens P..L-1 from h at P-1 (shared) and the suffixes
            lp0, ent0 = target_logprobs(
                pre.last_hidden_state[:, :-1], head, input_ids[:1, 1:P], params, entropy=entropy
            )
            h = torch.cat([pre.last_hidden_state[:, -1:].expand(B, 1, -1), suf.last_hidden_state[:, :-1]], 1)
            lp1, ent1 = target_logprobs(h, head, input_ids[:, P:], params, entropy=entropy)
            lp = torch.cat([lp0.expand(B, -1), lp1], 1)
            ent = torch.cat([ent0.expand(B, -1), ent1], 1) if entropy else None
            routed = None
            if router:
                routed = tuple(
                    torch.cat([a.view(1, P, -1).expand(B, P, -1), b.view(B, L - P, -1)], 1)
                    for a, b in zip(pre.router_logits, suf.router_logits, strict=True)
                )
        pad = lp.new_zeros(B, 1)
        return torch.cat([pad, lp], 1), torch.cat([pad, ent], 1) if entropy else None, routed

    def _shared_prefix(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, routing: torch.Tensor | None = None
    ) -> int:
        """P: the tokens every row starts with (routed alike, with a routing to replay), kept below every row's
        length; 0 when not worth sharing."""
        lm = causal_lm(self.policy)
        # transformers 5 renamed the flag (the old name warns)
        checkpointing = getattr(lm, "is_activation_checkpointing", None)
        if checkpointing is None:
            checkpointing = lm.is_gradient_checkpointing
        if input_ids.shape[0] < 2 or checkpointing:
            return 0
        same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)  # (L,)
        if routing is not None:  # the one prefix row is routed as every row's record says
            same &= (routing == routing[:1]).flatten(2).all(-1).all(0)
        shared = min(int(same.long().cumprod(0).sum()), int(attention_mask.sum(-1).min()) - 1)
        return shared if shared >= self.min_shared_prefix else 0
