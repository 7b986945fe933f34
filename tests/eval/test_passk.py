"""pass@k against hand-computed values and the binomial closed form."""

import math

import pytest

from agentrl.eval.passk import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 2 / 5),  # pass@1 is the fraction correct
        (5, 2, 2, 1 - 3 / 10),  # C(3,2) / C(5,2)
        (10, 3, 5, 1 - 21 / 252),  # C(7,5) / C(10,5)
        (10, 0, 10, 0.0),
        (4, 1, 4, 1.0),  # every 4-subset of 4 holds the correct one
        (200, 1, 100, 0.5),
    ],
)
def test_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_equals_the_binomial_closed_form():
    for n in range(1, 25):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_mean_over_problems_and_bad_input():
    assert mean_pass_at_k([(5, 2), (5, 0), (5, 5)], 1) == pytest.approx((0.4 + 0 + 1) / 3)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(5, 1, 10)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k([], 1)
