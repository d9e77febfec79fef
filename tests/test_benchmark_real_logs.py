"""The real-logs benchmark's statistics on hand-built cases: the paired bootstrap interval of the learned
value's AUC minus a baseline's, and the same-task reference (ROC AUC itself is tested with the product's
`confidence` module)."""

from __future__ import annotations

import numpy as np

from benchmarks.real_logs_auc import auc_difference_interval, same_task_rates
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


def episodes(rows: list[tuple[str, str | None, bool | None]]) -> dict:
    """An episodes table as `to_pydict` gives it, from (episode id, task id or None, success)."""
    return {
        "episode_id": [e for e, _, _ in rows],
        "metadata": [None if t is None else f'{{"task_id": "{t}"}}' for _, t, _ in rows],
        "success": [s for _, _, s in rows],
    }


def test_same_task_rates_score_each_test_episode_by_its_tasks_train_success_rate():
    table = episodes([
        ("a1", "A", True), ("a2", "A", False), ("a3", "A", True), ("a4", "A", None),  # A: 2 of 3 known
        ("b1", "B", False), ("b2", "B", False),
        ("c1", "C", True), ("c2", "C", True),  # C has no train run
        ("x1", None, True), ("x2", None, False),  # no task id: no task's runs
    ])
    train = {"a1", "a2", "a3", "a4", "b1", "x1"}
    rates = same_task_rates(table, train, ["a4", "b2", "c1", "x2"])
    # A: 2 of its 3 known train runs succeeded; B: 0 of 1; C unseen and x2 without a task id: the train
    # split's overall 3 of 5.
    assert rates == [2 / 3, 0.0, 0.6, 0.6]


def test_same_task_rates_are_none_where_every_task_ran_once():
    table = episodes([("a", "A", True), ("b", "B", False), ("c", None, True)])
    assert same_task_rates(table, {"a"}, ["b", "c"]) is None
    # InterCode numbers tasks within each dataset file: task 0 of two files is two tasks.
    table["metadata"] = ['{"dataset": "fs_1", "task_id": 0}', '{"dataset": "fs_2", "task_id": 0}', None]
    assert same_task_rates(table, {"a"}, ["b", "c"]) is None
