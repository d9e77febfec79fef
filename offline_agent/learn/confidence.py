"""How sure an off-policy estimate is: a bootstrap interval, and how much of the policy the logs cover.

FQE gives one number from one fit on one sample of episodes. Two things make it move: which first states
the test split happens to hold, and which episodes the fit learned from. `fqe_interval` adds up both: the
variance of the mean over the split's first states (its episodes' values, sd^2 / E) and the variance between
refits on bootstrap resamples of the split's episodes, around the estimate of the fit on the split itself.
The estimate is not the refits' mean: a resample holds about 63% of the split's distinct episodes, and FQE
on less data extrapolates more (on PipelineRepair's 73 test episodes the refits averaged 0.71 where the fit
on the split gave 0.88, against a simulated 0.87; benchmarks/results/fqe_estimate.md).
`bootstrap_interval` is the percentile interval of a mean over runs and resampled episodes, which the
bounds use.

An estimate is only as good as the logs' support for what the policy does. `action_coverage` is the share
of the policy's choices that the logs show in a similar state: for each evaluated state, is the action the
policy picks the logged action of one of the `k` most similar logged states (cosine of the state vectors)?
Where coverage is low, FQE extrapolates its Q to actions the logs never tried there, and its value is a
guess (Logistics' CQL: FQE 0.44 against a true 0.04).

A learned value predicts an episode's outcome as well as its ROC AUC for the episode's success says:
`roc_auc`, with `auc_interval` resampling the episodes (a test split of 50-100 episodes gives an AUC a
standard error near 0.05-0.07, so a point value alone says little).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def bootstrap_interval(
    values: np.ndarray, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (R runs, E episodes): each of `resamples` draws
    takes a run at random and E of its episodes with replacement."""
    values = np.atleast_2d(np.asarray(values, dtype=np.float64))  # (R, E)
    runs, episodes = values.shape
    if episodes == 0:
        raise ValueError("bootstrap_interval needs at least one episode")
    rng = np.random.default_rng(seed)
    run = rng.integers(runs, size=resamples)  # (S,)
    pick = rng.integers(episodes, size=(resamples, episodes))  # (S, E)
    means = values[run[:, None], pick].mean(axis=1)  # (S,)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def fqe_interval(estimate: np.ndarray, refits: np.ndarray | None = None, level: float = 0.95) -> tuple[float, float]:
    """Normal interval around the mean of `estimate` (E,), one fit's values at the split's E first states:
    mean +- z * sqrt(var(estimate) / E + var(refit means)), where `refits` (R, E) are R refits' values at the
    same states (sample variances; without refits, or with one, the first term alone)."""
    from statistics import NormalDist

    estimate = np.asarray(estimate, dtype=np.float64)
    if estimate.ndim != 1 or estimate.size == 0:
        raise ValueError("fqe_interval needs one value per first state, at least one")
    variance = estimate.var(ddof=1) / estimate.size if estimate.size > 1 else 0.0
    if refits is not None and len(refits) > 1:
        variance += np.asarray(refits, dtype=np.float64).mean(axis=1).var(ddof=1)
    half = NormalDist().inv_cdf(0.5 + level / 2.0) * float(np.sqrt(variance))
    mean = float(estimate.mean())
    return mean - half, mean + half


def action_coverage(
    states: torch.Tensor,
    chosen: torch.Tensor,
    logged_states: torch.Tensor,
    logged_actions: torch.Tensor,
    k: int = 10,
    chunk: int = 1024,
) -> float:
    """Share of `states` (n, D) whose `chosen` action id (n,) is the logged action (m,) of one of their `k`
    most similar `logged_states` (m, D), by cosine similarity."""
    return float(logged_nearby(states, chosen, logged_states, logged_actions, k, chunk).float().mean())


@torch.no_grad()
def logged_nearby(
    states: torch.Tensor,
    chosen: torch.Tensor,
    logged_states: torch.Tensor,
    logged_actions: torch.Tensor,
    k: int = 10,
    chunk: int = 1024,
) -> torch.Tensor:
    """(n,) bool: is each state's `chosen` action id the logged action of one of the `k` most similar
    `logged_states` (m, D)? states (n, D), chosen (n,), logged_actions (m,)."""
    if states.shape[0] == 0:
        raise ValueError("action_coverage needs at least one state")
    k = min(k, logged_states.shape[0])
    logged = torch.nn.functional.normalize(logged_states.float(), dim=1)
    covered = torch.empty(states.shape[0], dtype=torch.bool)
    for start in range(0, states.shape[0], chunk):
        query = torch.nn.functional.normalize(states[start : start + chunk].float(), dim=1)
        nearest = (query @ logged.T).topk(k, dim=1).indices  # (b, k) rows of the logs
        covered[start : start + chunk] = (logged_actions[nearest] == chosen[start : start + chunk, None]).any(1)
    return covered


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC of `scores` (n,) for the bool `labels` (n,): the probability that a random success scores above a
    random failure, ties counted half (Mann-Whitney U). nan when one class is absent."""
    from scipy.stats import rankdata

    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(scores)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def auc_interval(
    scores: np.ndarray, labels: np.ndarray, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of `roc_auc(scores, labels)` over the episodes (n,): each draw takes n of
    them with replacement; a draw with one class only is drawn again. (nan, nan) when one class is absent."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    if labels.all() or not labels.any():
        return float("nan"), float("nan")
    aucs = [roc_auc(scores[pick], labels[pick]) for pick in two_class_resamples(labels, resamples, seed)]
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(aucs, [tail, 1.0 - tail])
    return float(low), float(high)


def two_class_resamples(labels: np.ndarray, resamples: int, seed: int = 0) -> Iterator[np.ndarray]:
    """`resamples` bootstrap draws of the episodes (n,) bool `labels` belong to, as index arrays (n,) drawn with
    replacement; a draw holding one class only, which has no AUC, is drawn again. `labels` must hold both."""
    rng = np.random.default_rng(seed)
    drawn = 0
    while drawn < resamples:
        pick = rng.integers(len(labels), size=len(labels))
        if labels[pick].all() or not labels[pick].any():
            continue
        drawn += 1
        yield pick
