"""The scorer's prefix tree (agentrl.train.scoring): rows that start alike run their common positions once, on the
parent row's KV cache; lp, entropy, router logits and gradients are those of the unshared batch. Tiny models."""

import pytest
import torch
from torch import nn

from agentrl.engine.base import SamplingParams
from agentrl.models.tiny import tiny_model
from agentrl.train import scoring
from agentrl.train.logprobs import target_logprobs
from agentrl.train.scoring import Scorer

SMALL = dict(vocab_size=2048, pad_token_id=0, bos_token_id=1, eos_token_id=1)
PARAMS = SamplingParams(temperature=0.8)
UNSHARED = 10**9  # a min_shared_prefix no row reaches


def tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(2, 2000, (n,), generator=g).tolist()


def growing(g: torch.Generator, prompt: list[int], K: int, context: int, own: int) -> list[list[int]]:
    """K rows of one trajectory: row k = the prompt, k chunks of context, then its own tokens."""
    chunks = [tokens(g, context) for _ in range(K)]
    return [prompt + [t for chunk in chunks[:k] for t in chunk] + tokens(g, own + k % 3) for k in range(K)]


def batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask, right-padded."""
    L = max(map(len, rows))
    ids = torch.tensor([r + [0] * (L - len(r)) for r in rows])
    return ids, (torch.arange(L) < torch.tensor([len(r) for r in rows])[:, None]).long()


def scored(scorer: Scorer, ids, mask, routing=None, router: bool = False):
    """lp, entropy, router logits, and each parameter's gradient of a weighted Σ lp over the real positions."""
    model = scorer.policy
    model.zero_grad(set_to_none=True)
    lp, entropy, logits = scorer(ids, mask, PARAMS, entropy=True, router=router, routing=routing)
    (lp * mask * torch.linspace(0.5, 1.5, ids.shape[1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), entropy, logits, grads


def assert_same(shared, plain) -> None:
    for a, b in zip(shared[:2], plain[:2], strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(shared[2] or (), plain[2] or (), strict=True):
        torch.testing.assert_close(a, b)
    assert shared[3].keys() == plain[3].keys()
    for name, grad in shared[3].items():  # float32 sums in another order: a few ulps of the largest entry apart
        expected = plain[3][name]
        torch.testing.assert_close(grad, expected, atol=4e-6 * expected.abs().max(), rtol=1.3e-6, msg=name)


def test_a_mixed_batch_scores_as_unshared():
    """Two trajectories of 4 rows of a growing context (sharing a system prompt, each its own task) and a row sharing
    only 5 tokens of the system prompt: a tree of two roots, 3 deep; the unshared batch's lp, entropy, router logits
    and gradients, also in two length chunks."""
    g = torch.Generator().manual_seed(0)
    system = tokens(g, 12)
    rows = [
        *growing(g, system + tokens(g, 10), K=4, context=9, own=5),
        *growing(g, system + tokens(g, 14), K=4, context=7, own=6),
        system[:5] + tokens(g, 30),
    ]
    order = torch.randperm(len(rows), generator=g).tolist()
    ids, mask = batch([rows[i] for i in order])
    model = tiny_model("qwen3_moe", seed=0, **SMALL).train()
    plain = scored(Scorer(model, min_shared_prefix=UNSHARED), ids, mask, router=True)
    tree = Scorer(model, min_shared_prefix=8)
    forwards = tree._plan(ids, mask)
    assert len(forwards[0][2]) == 2  # the roots: a longest row, and the row sharing 5 tokens
    depth = {row: 0 for row in forwards[0][2]}
    for parent, _, rows_ in forwards[1:]:
        depth.update({row: depth[parent] + 1 for row in rows_})
    assert max(depth.values()) == 2 and len(depth) == len(rows)
    assert_same(scored(tree, ids, mask, router=True), plain)
    assert_same(
        scored(Scorer(model, min_shared_prefix=8, chunk_tokens=5 * ids.shape[1]), ids, mask, router=True), plain
    )


def test_a_growing_context_runs_about_its_distinct_tokens(monkeypatch):
    """K = 8 rows, row k's context a prefix of row k + 1's: the decoder runs about the distinct tokens (the longest
    row and the others' own tokens), not Σ length, and the lm head each of them once (but the first)."""
    g = torch.Generator().manual_seed(1)
    K = 8
    rows = growing(g, tokens(g, 40), K=K, context=30, own=20)
    ids, mask = batch(rows)
    model = tiny_model("qwen3", seed=0, **SMALL).train()
    counted: list[int] = []  # the decoder's input ids per forward
    headed: list[int] = []  # the positions the lm head scores per call

    def count(module: nn.Module, args: tuple) -> None:
        counted.append(args[0].numel())

    def head(hidden, *args, **kwargs):
        headed.append(hidden.shape[:-1].numel())
        return target_logprobs(hidden, *args, **kwargs)

    model.get_input_embeddings().register_forward_pre_hook(count)
    monkeypatch.setattr(scoring, "target_logprobs", head)
    plain = scored(Scorer(model, min_shared_prefix=UNSHARED), ids, mask)
    unshared, counted[:], headed[:] = sum(counted), [], []
    tree = scored(Scorer(model), ids, mask)
    ran = sum(counted)
    lengths = [len(r) for r in rows]
    distinct = max(lengths) + sum(lengths[k] - 40 - 30 * k for k in range(K - 1))  # the longest + the others' own
    print(
        f"K={K}: ran {ran} tokens in {len(counted)} forwards, the lm head {sum(headed)}; distinct {distinct}, "
        f"Σ length {sum(lengths)}, unshared (padded) {unshared}"
    )
    assert ran <= 1.3 * distinct and ran < 0.5 * sum(lengths)
    assert sum(headed) == distinct - 1
    assert_same(tree, plain)


def test_rows_routed_apart_share_only_up_to_there():
    """Routing replay: rows 0 and 1 hold the same first 20 tokens, but row 1's record routes position 12 elsewhere
    (one layer): row 1 takes only positions 0..11 from row 0, row 2 (routed as row 0) all 20; the unshared replay's
    lp, entropy, router logits and gradients."""
    g = torch.Generator().manual_seed(2)
    prompt = tokens(g, 20)
    ids, mask = batch([prompt + tokens(g, 20), prompt + tokens(g, 15), prompt + tokens(g, 10)])
    model = tiny_model("qwen3_moe", seed=0, **SMALL).train()
    B, L = ids.shape
    layers, E, k = model.config.num_hidden_layers, model.config.num_experts, model.config.num_experts_per_tok
    routing = torch.rand(B, L, layers, E, generator=g).argsort(-1)[..., :k].to(torch.int16)
    routing[:, :20] = routing[:1, :20]
    routing[1, 12, 1] = torch.tensor([e for e in range(E) if e not in routing[1, 12, 1]][:k])
    routing = torch.where(mask.bool()[..., None, None], routing, -1)
    tree = Scorer(model, replay=True, min_shared_prefix=4)
    assert tree._plan(ids, mask, routing) == [(-1, 0, [0]), (0, 12, [1]), (0, 20, [2])]
    assert tree._plan(ids, mask) == [(-1, 0, [0]), (0, 20, [1, 2])]  # without the routing: one prefix
    plain = scored(Scorer(model, replay=True, min_shared_prefix=UNSHARED), ids, mask, routing, router=True)
    assert_same(scored(tree, ids, mask, routing, router=True), plain)


def test_a_sliding_window_cache_is_not_shared():
    """A model with a sliding-window layer: its KV cache is not the plain one, every row is a root."""
    g = torch.Generator().manual_seed(3)
    prompt = tokens(g, 40)
    ids, mask = batch([prompt + tokens(g, 10), prompt + tokens(g, 5)])
    assert Scorer(tiny_model("qwen3", **SMALL))._plan(ids, mask) == [(-1, 0, [0]), (0, 40, [1])]
    window = tiny_model("mixtral", **SMALL, sliding_window=16)
    assert Scorer(window)._plan(ids, mask) == [(-1, 0, [0, 1])]


@pytest.mark.slow  # the fast tier: test_logprobs' empty chunk
def test_a_length_bucket_of_one_token_rows_scores_as_unshared():
    """A long row and two one-token rows (nothing to score) in two length buckets, the second all one-token rows:
    the unchunked batch's lp, entropy and gradients (zeros on the short rows)."""
    g = torch.Generator().manual_seed(4)
    ids, mask = batch([tokens(g, 40), tokens(g, 1), tokens(g, 1)])
    model = tiny_model("qwen3", seed=0, **SMALL).train()
    plain = scored(Scorer(model, min_shared_prefix=UNSHARED), ids, mask)
    assert_same(scored(Scorer(model, chunk_tokens=ids.shape[1]), ids, mask), plain)
