"""GiGPO's advantages against a loop transcription of the paper's equations, and on hand-computed cases."""

import itertools
import random
import statistics
from collections import defaultdict

import pytest
import torch

from agentrl.algo import gigpo_advantages, outcome_advantages

EPS = 1e-6


def reference(r, mask, keys, groups, gamma, omega, scale, eps):
    """The definitions, one Python float at a time: lists of lists in, (values, degenerate, sizes, shared) out."""
    N, K = len(r), len(r[0])
    real = [(i, k) for i in range(N) for k in range(K) if mask[i][k]]

    def normalise(x, pool):  # (x − mean) / (pstdev + eps), or x − mean; 0 when the pool's values are all equal
        if max(pool) == min(pool):
            return 0.0
        mean = statistics.fmean(pool)
        return (x - mean) / (statistics.pstdev(pool) + eps) if scale else x - mean

    # episode level: R_i = Σ_k r_{i,k} over real turns, normalised within its group
    R = [sum(r[i][k] for k in range(K) if mask[i][k]) for i in range(N)]
    episode_pool = defaultdict(list)
    for i in range(N):
        episode_pool[groups[i]].append(R[i])
    AE = [normalise(R[i], episode_pool[groups[i]]) for i in range(N)]

    # step level: R^γ_{i,k} = r_{i,k} + γ R^γ_{i,k+1}, grouped by (episode group, anchor state)
    ret = [[0.0] * K for _ in range(N)]
    for i in range(N):
        running = 0.0
        for k in reversed(range(K)):
            running = (r[i][k] if mask[i][k] else 0.0) + gamma * running
            ret[i][k] = running
    step_pool = defaultdict(list)
    for i, k in real:
        step_pool[groups[i], keys[i][k]].append(ret[i][k])

    values = [[0.0] * K for _ in range(N)]
    sizes = [[0] * K for _ in range(N)]
    for i, k in real:
        pool = step_pool[groups[i], keys[i][k]]
        values[i][k] = AE[i] + omega * normalise(ret[i][k], pool)
        sizes[i][k] = len(pool)
    silent = {g: all(values[i][k] == 0 for i, k in real if groups[i] == g) for g in set(groups)}
    degenerate = [silent[groups[i]] for i in range(N)]
    shared = sum(sizes[i][k] > 1 for i, k in real) / len(real) if real else 0.0
    return values, degenerate, sizes, shared


def random_case(rng):
    N, K = rng.randint(1, 8), rng.randint(1, 5)
    lengths = [rng.randint(0 if rng.random() < 0.1 else 1, K) for _ in range(N)]  # ragged, now and then empty
    mask = [[int(k < lengths[i]) for k in range(K)] for i in range(N)]
    r = [[rng.choice([0.0, 0.0, 0.5, 1.0]) for _ in range(K)] for _ in range(N)]  # padding turns hold junk too
    keys = [[rng.randrange(3) for _ in range(K)] for _ in range(N)]  # few states: step groups form
    groups = sorted(rng.randrange(max(1, N // 3)) for _ in range(N))
    return r, mask, keys, groups


CASES = list(itertools.product([1.0, 0.9], [0.0, 0.5, 1.0], [True, False]))  # γ, ω, scale


@pytest.mark.parametrize(("gamma", "omega", "scale"), CASES)
def test_matches_the_equations_transcribed_as_loops(gamma, omega, scale):
    rng = random.Random(f"{gamma}-{omega}-{scale}")
    for _ in range(10):
        r, mask, keys, groups = random_case(rng)
        values, degenerate, sizes, shared = reference(r, mask, keys, groups, gamma, omega, scale, EPS)
        adv = gigpo_advantages(
            torch.tensor(r, dtype=torch.float64),
            torch.tensor(mask),
            torch.tensor(keys),
            torch.tensor(groups),
            gamma=gamma,
            omega=omega,
            scale=scale,
            eps=EPS,
        )
        torch.testing.assert_close(adv.values, torch.tensor(values, dtype=torch.float64))
        assert adv.degenerate.tolist() == degenerate
        assert adv.step_groups.tolist() == sizes
        assert adv.shared_steps == pytest.approx(shared)


def test_distinct_states_leave_the_episode_term_alone():
    r = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 2.0], [1.0, 0.0, 0.0], [0.0, 0.3, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
    groups = torch.tensor([0, 0, 0, 1, 1])
    keys = torch.arange(15).view(5, 3)  # no two turns in the same state
    adv = gigpo_advantages(r, mask, keys, groups, gamma=0.9)
    outcome = outcome_advantages((r * mask).sum(1), groups)
    torch.testing.assert_close(adv.values, outcome.values[:, None] * mask)
    torch.testing.assert_close(adv.episode, outcome.values)
    assert (adv.step == 0).all()
    assert adv.shared_steps == 0.0
    assert adv.step_groups.tolist() == mask.tolist()


def test_omega_zero_is_the_episode_term_alone():
    r = torch.tensor([[0.0, 1.0], [0.5, 0.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]])
    groups = torch.tensor([0, 0, 0, 0])
    keys = torch.tensor([[0, 1], [0, 1], [0, 9], [1, 0]])  # shared states, returns that differ in them
    adv = gigpo_advantages(r, mask, keys, groups, gamma=0.9, omega=0.0)
    torch.testing.assert_close(adv.values, outcome_advantages((r * mask).sum(1), groups).values[:, None] * mask)
    assert adv.shared_steps > 0 and (adv.step != 0).any()  # the step term is there, just not weighed in


def test_two_trajectories_sharing_their_first_state():
    # a: rewards (0, 1), b: rewards (0, 0); both start in state 0, then a reaches state 1, b state 2
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    keys = torch.tensor([[0, 1], [0, 2]])
    groups = torch.tensor([0, 0])
    # R = (1, 0): mean 0.5, pstdev 0.5, A^E = ±0.5 / (0.5 + eps)
    # γ = 0.5: R^γ_a = (0.5, 1), R^γ_b = (0, 0); state 0's group {0.5, 0}: mean 0.25, pstdev 0.25,
    # A^S = ±0.25 / (0.25 + eps); states 1 and 2 are lone turns: A^S = 0
    adv = gigpo_advantages(r, mask, keys, groups, gamma=0.5, eps=EPS)
    e, s = 0.5 / (0.5 + EPS), 0.25 / (0.25 + EPS)
    torch.testing.assert_close(adv.values, torch.tensor([[e + s, e], [-e - s, -e]]))
    torch.testing.assert_close(adv.episode, torch.tensor([e, -e]))
    torch.testing.assert_close(adv.step, torch.tensor([[s, 0.0], [-s, 0.0]]))
    assert adv.step_groups.tolist() == [[2, 1], [2, 1]]
    assert adv.shared_steps == 0.5
    assert not adv.degenerate.any()
    # unscaled, ω = 0.5: A^E = ±0.5, A^S = ±0.25
    centred = gigpo_advantages(r, mask, keys, groups, gamma=0.5, omega=0.5, scale=False)
    assert centred.values.tolist() == [[0.625, 0.5], [-0.625, -0.5]]


def test_a_state_revisited_within_one_trajectory_is_one_step_group():
    # one trajectory (its episode group alone: A^E = 0) in state 0 twice, rewards (1, 1): R^γ = (2, 1)
    adv = gigpo_advantages(torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), torch.tensor([[0, 0]]), torch.tensor([0]))
    torch.testing.assert_close(adv.values, torch.tensor([[0.5, -0.5]]) / (0.5 + EPS))
    assert adv.step_groups.tolist() == [[2, 2]] and adv.shared_steps == 1.0


def test_degenerate_only_when_no_turn_carries_signal():
    # group 0: equal episodes, every turn in a state of its own -> no signal at all
    # group 1: equal episode returns (1 and 1), but c takes 2 turns and d one from the same first state:
    # γ = 0.5 gives R^γ = 0.5 for c and 1 for d there, so the step term differs
    r = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    keys = torch.tensor([[0, 1], [2, 3], [0, 4], [0, 0]])  # state 0 in group 0 is not state 0 in group 1
    groups = torch.tensor([0, 0, 1, 1])
    adv = gigpo_advantages(r, mask, keys, groups, gamma=0.5)
    assert adv.degenerate.tolist() == [True, True, False, False]
    assert (adv.values[:2] == 0).all()
    assert (adv.episode == 0).all()
    assert adv.step_groups.tolist() == [[1, 1], [1, 1], [2, 1], [2, 0]]
    assert adv.values[2, 0] < 0 < adv.values[3, 0]  # d's first move was worth more than c's


@pytest.mark.parametrize(
    ("field", "bad", "match"),
    [
        ("turn_rewards", torch.zeros(3), "turn_rewards must be"),
        ("turn_rewards", torch.zeros(0, 2), "at least one trajectory"),
        ("turn_mask", torch.ones(3, 3), "turn_mask must have"),
        ("step_keys", torch.zeros(2, 2, dtype=torch.long), "step_keys must have"),
        ("step_keys", torch.zeros(3, 2), "step_keys must hold integer"),
        ("groups", torch.zeros(3, 1, dtype=torch.long), "groups must be"),
        ("groups", torch.zeros(2, dtype=torch.long), "groups must be"),
        ("groups", torch.zeros(3), "groups must hold integer"),
    ],
)
def test_bad_inputs_are_named(field, bad, match):
    args = {
        "turn_rewards": torch.zeros(3, 2),
        "turn_mask": torch.ones(3, 2),
        "step_keys": torch.zeros(3, 2, dtype=torch.long),
        "groups": torch.zeros(3, dtype=torch.long),
    }
    args[field] = bad
    with pytest.raises(ValueError, match=match):
        gigpo_advantages(**args)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_reward_is_refused_and_padding_turns_may_hold_anything(bad):
    keys, groups = torch.zeros(2, 2, dtype=torch.long), torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"turn_rewards must be finite, got (nan|inf) at \(0, 1\)"):
        gigpo_advantages(torch.tensor([[0.0, bad], [1.0, 0.0]]), torch.ones(2, 2), keys, groups)
    # junk on b's padding turn: R = (1, 0) as without it
    adv = gigpo_advantages(torch.tensor([[0.0, 1.0], [0.0, bad]]), torch.tensor([[1, 1], [1, 0]]), keys, groups)
    torch.testing.assert_close(adv.episode, outcome_advantages(torch.tensor([1.0, 0.0]), groups).values)
    assert torch.isfinite(adv.values).all()
