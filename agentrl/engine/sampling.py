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

Drawing (the `hf` engine): a batch of rows, each with its own settings (`RowSampling`), is
filtered in one pass and drawn with counter-based noise, so that a request's tokens depend on
its seed and its logits alone, never on its batch. For the t-th token (t = 0 first) of a
request whose seed gives the 32-bit words key_0, key_1 (splitmix64), counter x's noise is

    h_j(x) = mix(key_j xor (t · φ mod 2^32) xor mix(2x + j))          j = 0, 1
    U(x)   = (h_0(x) · 2^20 + ⌊h_1(x) / 2^12⌋ + 1/2) / 2^52           uniform on a 2^52 grid in (0, 1)
    E(x)   = −log U(x)                                                  Exp(1)

and the token is drawn in two stages, a block B_b = {256b, …, 256b + 255} by its mass, then a
token within it, so that a row needs V/256 + 256 noise values, not V:

    b* = argmax_b  q(B_b) / E(2b)
    y  = 256 b* + argmax_s  q(256 b* + s) / E(2s + 1)
    P(y = v) = q(B_b) · q(v) / q(B_b) = q(v)        (v in B_b; the stages' noise is independent)

argmax_v q(v) / E_v is the Gumbel-max trick (argmax log q(v) − log E_v, −log E_v Gumbel). U is
never 0 or 1, so E is finite and positive; a token's chance moves by ~2^−52 / q(v) from the grid,
and q = exp(log q) in float32 drops tokens of probability below 1e−45. mix is a 32-bit integer
hash (Wellons' hash-prospector [16 21f0aaad 15 735a2d97 15]) whose multipliers are below 2^31:
every product of a 32-bit state stays below 2^63 in int64.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrl.engine.base import SamplingParams

MASK32 = 0xFFFFFFFF
BLOCK = 256  # tokens per block of the first stage
PHI = 0x61C88647  # 2^32 / golden ratio, negated mod 2^32: an odd multiplier below 2^31


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


def seed_key(seed: int) -> tuple[int, int]:
    """A seed (any integer) as the two 32-bit words of its splitmix64 hash: a request's noise key."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z & MASK32, z >> 32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash `mix`, in place on int64 values below 2^32."""
    x ^= x >> 16
    x *= 0x21F0AAAD
    x &= MASK32
    x ^= x >> 15
    x *= 0x735A2D97
    x &= MASK32
    x ^= x >> 15
    return x


@functools.cache
def _counter_keys(blocks: int, device: torch.device) -> torch.Tensor:
    """mix(2x + j), j = 0, 1, for the counters x of `blocks` blocks (2b) then of a block's tokens (2s + 1): (2, 1,
    blocks + BLOCK), the counters' part of both hashes."""
    x = torch.cat([2 * torch.arange(blocks), 2 * torch.arange(BLOCK) + 1]).to(device)
    return _mix(torch.stack([2 * x, 2 * x + 1]))[:, None]


def exponential_noise(keys: torch.Tensor, index: torch.Tensor, blocks: int) -> torch.Tensor:
    """E(x) of the module docstring for each row, of `blocks` blocks then of BLOCK tokens: keys (n, 2) the rows'
    `seed_key`s, index (n,) the index in its request of the token each row draws (below 2^31) -> (n, blocks + BLOCK)
    float64."""
    r = keys.T ^ ((index * PHI) & MASK32)  # (2, n)
    h = _mix(r[:, :, None] ^ _counter_keys(blocks, keys.device))  # (2, n, blocks + BLOCK)
    u = ((h[0] << 20) | (h[1] >> 12)).double().mul_(2.0**-52).add_(2.0**-53)  # exact in float64: never 0 or 1
    return u.log_().neg_()


Rows = slice | torch.Tensor | None
"""Some rows of a batch: all of them (slice(None)), an index tensor of them, or none"""


def _rows(flags: list[bool], device: torch.device) -> Rows:
    if not any(flags):
        return None
    if all(flags):
        return slice(None)
    return torch.tensor([i for i, f in enumerate(flags) if f], device=device)


def _put(z: torch.Tensor, rows: Rows, values: torch.Tensor) -> torch.Tensor:
    """z with `rows` replaced by `values`, out of place (z may be the caller's logits)."""
    return values if isinstance(rows, slice) else z.index_put((rows,), values)


@dataclass(frozen=True)
class RowSampling:
    """Each row's settings and noise key, as device tensors: a batch of any mix of settings filters and
    draws in one pass. Top-k and top-p run on the rows that use them only (the work of a group of their own),
    rows chosen with the batch, so that no step asks the device which rows those are."""

    temperature: torch.Tensor | None  # (n,) float32, 1 on greedy rows (their logprob is untempered); None: all 1
    greedy: torch.Tensor  # (n,) bool
    keys: torch.Tensor  # (n, 2) int64: seed_key of each row's seed
    top_k_rows: Rows  # the rows filtered by top-k
    top_k: torch.Tensor | None  # their k, int64
    max_top_k: int
    top_p_rows: Rows  # the rows filtered by top-p
    top_p: torch.Tensor | None  # their p, float32
    any_greedy: bool
    any_sampled: bool  # some row is not greedy

    @classmethod
    def of(cls, params: list[SamplingParams], keys: list[tuple[int, int]], vocab: int, device: torch.device):
        """The rows' settings, copied from the host once."""
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        floats = torch.tensor([[p.temperature, p.top_p] for p in params], device=device)
        ints = torch.tensor([[k, *key] for k, key in zip(top_k, keys, strict=True)], device=device)
        greedy = floats[:, 0] == 0
        top_k_rows = _rows([k > 0 for k in top_k], device)
        top_p_rows = _rows([p.top_p < 1 for p in params], device)
        tempered = any(p.temperature not in (0, 1) for p in params)
        return cls(
            temperature=floats[:, 0].masked_fill(greedy, 1.0) if tempered else None,
            greedy=greedy,
            keys=ints[:, 1:],
            top_k_rows=top_k_rows,
            top_k=ints[top_k_rows, 0] if top_k_rows is not None else None,
            max_top_k=max(top_k),
            top_p_rows=top_p_rows,
            top_p=floats[top_p_rows, 1] if top_p_rows is not None else None,
            any_greedy=any(p.temperature == 0 for p in params),
            any_sampled=any(p.temperature > 0 for p in params),
        )

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """log q of each row under its own settings: (n, V) -> (n, V), what `sampling_logprobs` gives the row alone."""
        z = logits.float() if self.temperature is None else logits.float() / self.temperature[:, None]
        if self.top_k_rows is not None:
            zk = z[self.top_k_rows]
            kth = torch.topk(zk, self.max_top_k, dim=-1).values.gather(-1, self.top_k[:, None] - 1)
            z = _put(z, self.top_k_rows, zk.masked_fill(zk < kth, float("-inf")))
        if self.top_p_rows is not None:
            zp = z[self.top_p_rows]
            z_sorted, order = torch.sort(zp, dim=-1, descending=True)
            p_sorted = torch.softmax(z_sorted, dim=-1)
            mass_before = torch.cumsum(p_sorted, dim=-1) - p_sorted
            drop_sorted = mass_before >= self.top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            z = _put(z, self.top_p_rows, zp.masked_fill(drop, float("-inf")))
        return torch.log_softmax(z, dim=-1)

    def sample(self, logq: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """One token per row of log q (n, V), its request's `index`-th (n,); argmax on greedy rows."""
        if not self.any_sampled:
            return torch.argmax(logq, dim=-1)
        n, V = logq.shape
        blocks = -(-V // BLOCK)
        q = F.pad(logq.exp(), (0, blocks * BLOCK - V)).view(n, blocks, BLOCK)  # the padding: probability 0
        e = exponential_noise(self.keys, index, blocks)
        b = torch.argmax(q.sum(-1) / e[:, :blocks], dim=-1)  # (n,)
        in_block = q.gather(1, b[:, None, None].expand(n, 1, BLOCK))[:, 0]  # (n, BLOCK)
        ys = torch.argmax(in_block / e[:, blocks:], dim=-1).add_(b, alpha=BLOCK)
        return torch.where(self.greedy, torch.argmax(logq, dim=-1), ys) if self.any_greedy else ys
