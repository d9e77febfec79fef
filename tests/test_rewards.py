import numpy as np
import pytest

from offline_agent.rewards import discounted_returns


def test_discounted_returns_exact_values():
    rewards = np.array([1.0, 0.0, 2.0, 5.0, -1.0, 3.0], dtype=np.float32)
    episodes = np.array(["a", "a", "a", "b", "c", "c"])
    got = discounted_returns(rewards, episodes, gamma=0.5)
    # a: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5 ; b: 5 ; c: G1 = 3, G0 = -1 + 1.5 = 0.5
    np.testing.assert_array_equal(got, [1.5, 1.0, 2.0, 5.0, 0.5, 3.0])
    assert got.dtype == np.float64


def test_discounted_returns_gamma_one_is_reverse_cumsum_and_integer_ids():
    got = discounted_returns(np.array([1.0, 2.0, 3.0, 4.0]), np.array([7, 7, 7, 9]), gamma=1.0)
    np.testing.assert_array_equal(got, [6.0, 5.0, 3.0, 4.0])


def test_discounted_returns_matches_scalar_recursion_on_random_episodes():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=50)
    episodes = np.repeat(np.arange(50), lengths)
    rewards = rng.normal(size=episodes.shape[0])
    expected = np.empty_like(rewards)
    start = 0
    for length in lengths:
        g = 0.0
        for i in range(start + length - 1, start - 1, -1):
            g = rewards[i] + 0.9 * g
            expected[i] = g
        start += length
    np.testing.assert_allclose(discounted_returns(rewards, episodes, 0.9), expected, rtol=0, atol=1e-12)


def test_discounted_returns_empty_and_bad_input():
    assert discounted_returns(np.zeros(0), np.zeros(0, dtype=str), 0.9).shape == (0,)
    with pytest.raises(ValueError, match="not contiguous"):
        discounted_returns(np.ones(3), np.array(["a", "b", "a"]), 0.9)
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns(np.ones(3), np.array(["a", "a", "a"]), 1.5)
