"""Advantage estimators on hand-computed cases and against a loop over groups."""

import pytest
import torch

from agentrl.algo import outcome_advantages, per_token, returns_to_go, turn_advantages

EPS = 1e-6


def test_outcome_advantages_are_group_normalised():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.2, 0.2, 0.2, 3.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    adv = outcome_advantages(rewards, groups, eps=EPS)
    # group 0: mean 0.5, population std 0.5; group 1: all equal; group 2: mean 2, std 1
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (0.5 + EPS)
    expected = torch.cat([expected, torch.zeros(4), torch.tensor([1.0, -1.0]) / (1 + EPS)])
    torch.testing.assert_close(adv.values, expected)
    assert adv.degenerate.tolist() == [False] * 4 + [True] * 4 + [False] * 2
    centred = outcome_advantages(rewards, groups, scale=False)  # Dr. GRPO: no division by the std
    torch.testing.assert_close(centred.values, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 1, -1]))


def test_returns_to_go_discount_and_padding():
    r = torch.tensor([[1.0, 2.0, 3.0], [5.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(returns_to_go(r, mask, gamma=0.5), torch.tensor([[2.75, 3.5, 3.0], [5.0, 0, 0]]))


def test_turn_advantages_pool_every_real_turn_of_the_group():
    # group 0: a took 2 turns (rewards 0, 1), b took 1 turn (0.5), c 3 turns (0, 0, 0); group 1: d, e
    r = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0, 0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
    groups = torch.tensor([0, 0, 0, 1, 1])
    adv = turn_advantages(r, mask, groups, gamma=0.9, eps=EPS)
    G = returns_to_go(r, mask, gamma=0.9)
    for g in (0, 1):  # the estimator, one group at a time: pooled mean and population std of real turns
        pool = torch.cat([G[i][mask[i].bool()] for i in range(5) if groups[i] == g])
        mu, sigma = pool.mean(), pool.std(unbiased=False)
        for i in range(5):
            if groups[i] == g:
                k = mask[i].bool()
                torch.testing.assert_close(adv.values[i][k], (G[i][k] - mu) / (sigma + EPS))
                assert (adv.values[i][~k] == 0).all()
    assert not adv.degenerate.any()


def test_turn_advantages_with_one_turn_are_outcome_advantages():
    rewards = torch.tensor([0.3, 1.0, 0.0, 0.7, 0.7, 0.7])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    turn = turn_advantages(rewards[:, None], torch.ones(6, 1), groups)
    outcome = outcome_advantages(rewards, groups)
    torch.testing.assert_close(turn.values[:, 0], outcome.values)
    assert turn.degenerate.tolist() == outcome.degenerate.tolist() == [False] * 3 + [True] * 3


def test_per_token_broadcasts_each_turns_value():
    values = torch.tensor([[1.0, -2.0]])
    token_turn = torch.tensor([[0, 0, 0, 1, 1, 1]])  # prompt (turn 0), turn 0, obs, turn 1 ...
    loss_mask = torch.tensor([[0, 1, 0, 0, 1, 1]])
    torch.testing.assert_close(per_token(values, token_turn, loss_mask), torch.tensor([[0.0, 1, 0, 0, -2, -2]]))


@pytest.mark.parametrize("scale", [True, False])
def test_only_a_group_of_equal_returns_is_degenerate(scale):
    one_group = torch.zeros(3, dtype=torch.long)
    # every turn pays 0.5, but two-turn members' first turns return 1.0: the returns differ
    adv = turn_advantages(torch.full((3, 2), 0.5), torch.tensor([[1, 1], [1, 0], [1, 1]]), one_group, scale=scale)
    assert not adv.degenerate.any()
    flat = turn_advantages(
        torch.tensor([[1.0, 0], [1.0, 0], [1.0, 0]]), torch.tensor([[1, 0]] * 3), one_group, scale=scale
    )
    assert flat.degenerate.all() and (flat.values == 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_reward_is_refused_and_padding_turns_may_hold_anything(bad):
    """One NaN or inf reward would make its whole group's advantages NaN, and the update with them."""
    groups = torch.tensor([0, 0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"rewards must be finite, got (nan|inf) at \(1,\)"):
        outcome_advantages(torch.tensor([1.0, bad, 0.0, 1.0, 0.0]), groups)
    r = torch.tensor([[0.0, 1.0], [0.0, bad], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    with pytest.raises(ValueError, match=r"turn_rewards must be finite, got (nan|inf) at \(1, 1\)"):
        turn_advantages(r, torch.ones(5, 2), groups)
    # on a padding turn it is no reward at all
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    junk = torch.tensor([[1.0, 0.0, bad], [0.5, bad, bad]])
    torch.testing.assert_close(returns_to_go(junk, mask, gamma=0.5), torch.tensor([[1.0, 0, 0], [0.5, 0, 0]]))
    adv = turn_advantages(junk, mask, torch.tensor([0, 0]))
    assert torch.isfinite(adv.values).all() and not adv.degenerate.any()
