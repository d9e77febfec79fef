"""The real-logs benchmark's statistics on hand-built cases: the paired bootstrap interval of the learned
value's AUC minus a baseline's (ROC AUC itself is tested with the product's `confidence` module)."""

from __future__ import annotations

import numpy as np

from benchmarks.real_logs_auc import auc_difference_interval
from offline_agent.learn.confidence import roc_auc

LABELS = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 0], dtype=bool)


def test_a_score_against_itself_differs_by_exactly_zero():
    scores = np.linspace(0.0, 1.0, 10)
    assert auc_difference_interval([scores, scores], scores, LABELS, resamples=200) == (0.0, 0.0)


def test_a_perfect_score_against_a_reversed_one_differs_by_one_in_every_draw():
    perfect = np.where(LABELS, 1.0, 0.0) + np.linspace(0.0, 0.1, 10)
    assert auc_difference_interval([perfect], -perfect, LABELS, resamples=200) == (1.0, 1.0)


def test_the_interval_is_paired_and_reproducible():
    rng = np.random.default_rng(0)
    labels = rng.random(60) < 0.4
    noisy = labels + rng.normal(0.0, 1.0, 60)  # AUC well above chance
    close = noisy + rng.normal(0.0, 0.05, 60)
    low, high = auc_difference_interval([noisy], close, labels, seed=3)
    assert -0.05 < low <= 0.0 <= high < 0.05  # nearly the same scores: pairing keeps the interval tight
    assert auc_difference_interval([noisy], close, labels, seed=3) == (low, high)  # a seed, the same interval
    chance_low, chance_high = auc_difference_interval([noisy], np.zeros(60), labels, seed=3)
    assert 0.0 < chance_low < roc_auc(noisy, labels) - 0.5 < chance_high  # against a constant (AUC 0.5)
