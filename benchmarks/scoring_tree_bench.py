"""What the prefix-tree scorer saves on the rows of long episodes, against scoring every row alone.

An episode of K sequences of a growing context (`rollout.thinking: strip`: sequence k's prompt is the
conversation so far, which sequence k + 1's prompt extends) gives K rows whose lengths grow with k: scored alone
they cost Σ len ≈ K²/2 turns of tokens. The tree scores each row on the cache of the longest row it starts like,
so the decoder runs about their distinct tokens. Both paths are timed here on the same rows (forward and backward
of a loss on lp, the update's work), with `--episodes` such episodes of `--turns` sequences in one batch, on a
tiny Qwen3-MoE in float32; the lp of both are checked equal.

Prints one JSON object: the decoder tokens each path ran (counted by a hook on the embedding), the wall of each
(best of `--repeats`), and their ratios (tree / alone). Run: `python benchmarks/scoring_tree_bench.py` (a minute).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from agentrl.engine.base import SamplingParams
from agentrl.models.tiny import tiny_model
from agentrl.train.scoring import Scorer


def growing_rows(episodes: int, turns: int, prompt: int, turn: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """(episodes·turns, L) right-padded ids: per episode, row k = a shared prompt + k turns of context + its own
    turn (a generated turn that the next rows re-render differently, so it is not in their context)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(episodes):
        context = torch.randint(10, vocab, (prompt + turns * turn,), generator=g)
        for k in range(turns):
            own = torch.randint(10, vocab, (turn,), generator=g)
            rows.append(torch.cat([context[: prompt + k * turn], own]))
    L = max(len(r) for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, L - len(r))) for r in rows]), torch.tensor(
        [len(r) for r in rows]
    )


def run(scorer: Scorer, ids: torch.Tensor, mask: torch.Tensor, repeats: int) -> tuple[float, int, torch.Tensor]:
    """(best wall of forward + backward, decoder tokens of one pass, lp)."""
    counted = [0]
    embed = scorer.policy.get_input_embeddings()
    hook = embed.register_forward_hook(lambda m, args, out: counted.__setitem__(0, counted[0] + args[0].numel()))
    best = float("inf")
    for _ in range(repeats):
        counted[0] = 0
        scorer.policy.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        lp, _, _ = scorer(ids, mask, SamplingParams())
        (lp * mask).sum().backward()
        best = min(best, time.perf_counter() - t0)
    hook.remove()
    return best, counted[0], lp.detach()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--turns", type=int, default=8, help="K: sequences per episode")
    p.add_argument("--prompt", type=int, default=256, help="the shared opening's tokens")
    p.add_argument("--turn", type=int, default=96, help="tokens a turn adds (generated and observation)")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    model = tiny_model("qwen3_moe", seed=0).train()
    ids, lengths = growing_rows(a.episodes, a.turns, a.prompt, a.turn, model.config.vocab_size)
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    tree_s, tree_tokens, tree_lp = run(Scorer(model), ids, mask, a.repeats)
    alone_s, alone_tokens, alone_lp = run(Scorer(model, min_shared_prefix=10**9), ids, mask, a.repeats)
    torch.testing.assert_close(tree_lp, alone_lp, atol=1e-4, rtol=0)
    print(
        json.dumps(
            {
                "rows": len(ids),
                "sum_row_tokens": int(lengths.sum()),
                "tree": {"decoder_tokens": tree_tokens, "wall_s": round(tree_s, 3)},
                "alone": {"decoder_tokens": alone_tokens, "wall_s": round(alone_s, 3)},
                "ratio_tokens": round(tree_tokens / alone_tokens, 3),
                "ratio_wall": round(tree_s / alone_s, 3),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
