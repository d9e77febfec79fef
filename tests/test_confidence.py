"""How sure an off-policy estimate is: the bootstrap interval and the logs' coverage of the policy; how well a
value predicts success: ROC AUC and its interval. On hand-built cases whose answers are known exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offline_agent.learn.confidence import (
    action_coverage,
    auc_interval,
    bootstrap_interval,
    fqe_interval,
    logged_nearby,
    roc_auc,
)

LABELS = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 0], dtype=bool)


def test_the_interval_of_identical_values_is_that_value():
    assert bootstrap_interval(np.full((3, 20), 0.25)) == (0.25, 0.25)


def test_two_episodes_give_the_three_possible_means_with_their_probabilities():
    # Resamples of (0, 1) have mean 0, 0.5 or 1 with probabilities 1/4, 1/2, 1/4: the 2.5% and 97.5%
    # percentiles are the extremes.
    assert bootstrap_interval(np.array([0.0, 1.0]), resamples=4000) == (0.0, 1.0)


def test_fqe_runs_that_disagree_widen_the_interval_to_both():
    # Each run is certain of its episodes; which run a draw picks is the only noise: half the draws say 0.2.
    runs = np.array([[0.2] * 10, [0.6] * 10])
    assert bootstrap_interval(runs) == pytest.approx((0.2, 0.6))
    assert bootstrap_interval(runs[:1]) == pytest.approx((0.2, 0.2))


def test_the_fqe_interval_adds_the_first_states_variance_and_the_refits():
    estimate = np.array([0.2, 0.4, 0.6, 0.8])  # mean 0.5, sample variance 0.2 / 3, of the mean 0.2 / 12
    refits = np.array([[0.3, 0.5, 0.5, 0.3], [0.5, 0.7, 0.7, 0.5]])  # refit means 0.4 and 0.6: variance 0.02
    z = 1.959963984540054
    half = z * np.sqrt(0.2 / 12 + 0.02)
    assert fqe_interval(estimate, refits) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-12)
    only_states = z * np.sqrt(0.2 / 12)
    assert fqe_interval(estimate) == pytest.approx((0.5 - only_states, 0.5 + only_states), abs=1e-12)
    assert fqe_interval(estimate, refits[:1]) == fqe_interval(estimate)  # one refit has no spread to add
    # Refits that agree add nothing, however far they are from the estimate: the interval is around the estimate.
    assert fqe_interval(estimate, np.zeros((3, 4))) == fqe_interval(estimate)
    assert fqe_interval(np.full(5, 0.25)) == (0.25, 0.25)
    with pytest.raises(ValueError, match="one value per first state"):
        fqe_interval(np.zeros(0))


def test_half_successes_match_the_binomial_interval():
    values = np.array([0.0, 1.0] * 50)  # mean 0.5, the mean of 100 resampled episodes has sd 0.05
    low, high = bootstrap_interval(values, resamples=20000, seed=3)
    assert low == pytest.approx(0.5 - 1.96 * 0.05, abs=0.012) and high == pytest.approx(0.5 + 1.96 * 0.05, abs=0.012)
    assert bootstrap_interval(values, resamples=20000, seed=3) == (low, high)  # a seed gives the same interval


def test_coverage_counts_the_choices_logged_in_the_k_most_similar_states():
    # Logged: state (1, 0) took action 0, (0, 1) took 1, (1, 1) took 2.
    logged_states = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    logged_actions = torch.tensor([0, 1, 2])
    states = torch.tensor([[1.0, 0.1], [0.1, 1.0], [1.0, 0.1], [0.2, 1.0]])
    chosen = torch.tensor([0, 1, 1, 5])  # logged nearby, logged nearby, logged only 2 states away, never logged
    assert action_coverage(states, chosen, logged_states, logged_actions, k=1) == 2 / 4
    assert action_coverage(states, chosen, logged_states, logged_actions, k=3) == 3 / 4
    # Chunks change nothing, and k larger than the logs takes them all.
    assert action_coverage(states, chosen, logged_states, logged_actions, k=9, chunk=1) == 3 / 4
    # Per state, what FQE's bounds read: which choices are logged nearby.
    nearby = logged_nearby(states, chosen, logged_states, logged_actions, k=1, chunk=3)
    assert nearby.tolist() == [True, True, False, False]


def test_empty_inputs_are_errors():
    with pytest.raises(ValueError, match="at least one episode"):
        bootstrap_interval(np.zeros((2, 0)))
    with pytest.raises(ValueError, match="at least one state"):
        action_coverage(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), torch.eye(2), torch.tensor([0, 1]))


def test_a_resample_takes_whole_episodes_as_often_as_they_are_drawn():
    from offline_agent.learn.fqe import resample_episodes

    episode_index = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])  # episode 2 is in another split: not in `rows`
    rows = torch.tensor([0, 1, 2, 3, 4, 6, 7])
    blocks = {0: [0, 1], 1: [2, 3, 4], 3: [6, 7]}
    seen = set()
    for seed in range(20):
        drawn = resample_episodes(episode_index, rows, torch.Generator().manual_seed(seed))
        counts = torch.bincount(drawn, minlength=8).tolist()
        times = {e: counts[block[0]] for e, block in blocks.items()}
        assert all(counts[r] == times[e] for e, block in blocks.items() for r in block)  # whole episodes
        assert sum(times.values()) == 3 and counts[5] == 0  # as many draws as episodes, none from elsewhere
        seen.add(tuple(times.values()))
    assert (1, 1, 1) in seen and len(seen) > 3  # sometimes the split itself, mostly not


def test_fqe_fits_on_resamples_differ_and_value_every_test_episode():
    from offline_agent.learn.fqe import FQEConfig, fitted_q_evaluation
    from offline_agent.learn.networks import QNetwork
    from tests import learn_data

    f = learn_data.color_lock_features()
    torch.manual_seed(0)
    net = QNetwork(f.dim, 16, n_heads=1)
    common = dict(steps=60, batch_size=32, hidden=16, split="test", log_every=60)
    whole = fitted_q_evaluation(f, net, FQEConfig(**common))
    again = fitted_q_evaluation(f, net, FQEConfig(**common))
    resampled = fitted_q_evaluation(f, net, FQEConfig(**common, resample=True))
    assert torch.equal(whole.episode_values, again.episode_values)  # the split alone: the seed decides
    assert resampled.episode_values.shape == whole.episode_values.shape == (whole.episodes,)
    assert not torch.equal(resampled.episode_values, whole.episode_values)
    # Fitted on every logged transition, FQE still values the split's first states, and only those.
    everything = fitted_q_evaluation(f, net, FQEConfig(**common, fit_on="all"))
    assert everything.episode_values.shape == whole.episode_values.shape
    assert not torch.equal(everything.episode_values, whole.episode_values)
    assert everything.behaviour_value == whole.behaviour_value


def test_auc_counts_ties_half():
    assert roc_auc([0.9, 0.1, 0.8, 0.7, 0.2, 0.3, 0.6, 0.4, 0.5, 0.0], LABELS) == 1.0
    assert roc_auc(np.zeros(10), LABELS) == 0.5
    assert roc_auc([0.2, 0.1], [True, False]) == 1.0 and np.isnan(roc_auc([0.2, 0.1], [True, True]))
    # 3 successes, 2 failures: of the 6 (success, failure) pairs, 4 ordered right and 1 tie -> 4.5 / 6
    assert roc_auc([0.9, 0.5, 0.5, 0.1, 0.7], [True, True, False, False, False]) == 0.75


def test_the_auc_interval_is_exact_where_every_resample_agrees():
    ordered = np.where(LABELS, 1.0, 0.0) + np.linspace(0.0, 0.1, 10)
    assert auc_interval(ordered, LABELS, resamples=200) == (1.0, 1.0)
    assert auc_interval(-ordered, LABELS, resamples=200) == (0.0, 0.0)
    assert auc_interval(np.zeros(10), LABELS, resamples=200) == (0.5, 0.5)
    assert all(np.isnan(auc_interval(ordered, np.ones(10, dtype=bool))))


def test_the_auc_interval_holds_the_auc_and_is_reproducible():
    rng = np.random.default_rng(0)
    labels = rng.random(80) < 0.5
    scores = labels + rng.normal(0.0, 1.0, 80)
    low, high = auc_interval(scores, labels, seed=1)
    assert 0.5 < low < roc_auc(scores, labels) < high < 1.0
    assert 0.1 < high - low < 0.3  # 80 episodes: a standard error near 0.05
    assert auc_interval(scores, labels, seed=1) == (low, high)
