"""pass@k: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code")."""

from __future__ import annotations

import math
from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one problem from n samples of which c are correct:

        pass@k = 1 − C(n − c, k) / C(n, k) = 1 − Π_{i = n−c+1}^{n} (1 − k / i)

    The product form (the paper's numerically stable one) avoids the huge binomials. 1 when
    every k-subset holds a correct sample (n − c < k).
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_ks(counts: Iterable[tuple[int, int]], ks: Iterable[int]) -> dict[int, float]:
    """pass@k for each k, over the problems with at least k samples (NaN where none has)."""
    counts = list(counts)
    return {k: mean_pass_at_k(enough, k) if (enough := [(n, c) for n, c in counts if n >= k]) else math.nan for k in ks}


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k over problems, each given as (n samples, c correct): the mean of the per-problem estimates."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("pass@k of no problems")
    return sum(values) / len(values)
