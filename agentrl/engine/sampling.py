"""The sampling distribution, shared by the engines and the trainer (invariant 2).

Semantics of an engine logprob: for a sampled token y with logits z (one position),

    q = softmax( top_p( top_k( z / T ) ) )        lp_b(y) = log q(y)

applied in that order (as Hugging Face and vLLM order their logits processors):
temperature T first, then top-k keeps the k largest, then top-p keeps the smallest
prefix of the descending-sorted tokens whose probability mass reaches p (the most
likely token is always kept); removed tokens get probability 0 and q is renormalised
over the kept ones. That is the distribution y was drawn from, so lp_b is the true
behaviour likelihood. The trainer scores lp_θ with the same function on its own logits.

Greedy decoding (T = 0) draws deterministically; its logprob is reported under the
untempered, unfiltered softmax(z), which is what a greedy evaluation wants to see.
"""

from __future__ import annotations

import torch

from agentrl.engine.base import SamplingParams


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """log q over the vocabulary: (..., V) -> (..., V), -inf on filtered-out tokens. Computed in fp32."""
    z = logits.float()
    if temperature > 0:
        z = z / temperature
        V = z.shape[-1]
        if 0 < top_k < V:
            kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if top_p < 1.0:
            z_sorted, order = torch.sort(z, dim=-1, descending=True)
            p_sorted = torch.softmax(z_sorted, dim=-1)
            mass_before = torch.cumsum(p_sorted, dim=-1) - p_sorted  # mass of strictly more likely tokens
            drop_sorted = mass_before >= top_p  # the first token has mass_before 0 < top_p: always kept
            z = z.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return torch.log_softmax(z, dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """lp(y_t) for each position: logits (..., V), token_ids (...) -> (...)."""
    logq = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
    return logq.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def sample(logq: torch.Tensor, temperature: float, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of log q (n, V) -> (n,); argmax when greedy.

    Gumbel-max, argmax(log q + Gumbel noise), draws exactly from q, with each row's noise
    from its own generator: a request's tokens do not depend on what it is batched with.
    """
    if temperature == 0:
        return torch.argmax(logq, dim=-1)
    u = torch.stack([torch.rand(logq.shape[-1], generator=g, device=logq.device) for g in generators])  # (n, V)
    return torch.argmax(logq - torch.log(-torch.log(u)), dim=-1)
