"""Reward functions, potential-based shaping, reward specs and relabelling a dataset's rewards.

Every reward here is a pure function over the columns of the `steps` table
(numpy arrays, rows sorted by `(episode_id, step)`), returning one float per
step. A reward *spec* string such as ``outcome+subgoal:0.1+step:-0.01`` names a
sum of such terms; `relabel` recomputes `reward`, `return_to_go` and `return`
of a dataset under a new spec into a new dataset, recording its lineage.
`discounted_returns` is the one implementation of return-to-go that ingestion
and relabelling share.

Notation: N = number of step rows; `episode_index` (N,) holds one value per
row, equal within an episode, episodes contiguous.
"""

from __future__ import annotations

import numpy as np


def episode_boundaries(episode_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start offsets and lengths of the contiguous episodes in `episode_index` (N,).

    Returns `(starts (E,) int64, lengths (E,) int64)`. Raises ValueError if an
    episode's rows are not contiguous (the rows must be sorted by episode).
    """
    episode_index = np.asarray(episode_index)
    n = episode_index.shape[0]
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    is_start = np.ones(n, dtype=bool)
    is_start[1:] = episode_index[1:] != episode_index[:-1]
    starts = np.flatnonzero(is_start).astype(np.int64)
    if np.unique(episode_index).shape[0] != starts.shape[0]:
        raise ValueError("episode rows are not contiguous: sort steps by (episode_id, step) first")
    lengths = np.diff(np.append(starts, n))
    return starts, lengths


def discounted_returns(rewards: np.ndarray, episode_index: np.ndarray, gamma: float) -> np.ndarray:
    """Return-to-go of every step: `G_t = r_t + gamma * G_{t+1}` within an episode, `G_T = r_T`.

    rewards: (N,) float, rows sorted by episode then step.
    episode_index: (N,) any dtype, equal for the rows of one episode (ids or codes).
    gamma: discount in [0, 1].
    Returns (N,) float64.

    Vectorised over episodes: one numpy pass per position-from-the-end (so
    max episode length passes), which keeps the exact recursion's arithmetic
    instead of dividing by gamma**t, which underflows on long episodes.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    rewards = np.asarray(rewards, dtype=np.float64)
    episode_index = np.asarray(episode_index)
    if rewards.shape != episode_index.shape or rewards.ndim != 1:
        raise ValueError(
            f"rewards {rewards.shape} and episode_index {episode_index.shape} must be 1-D of equal length"
        )
    returns = rewards.copy()
    if rewards.shape[0] == 0:
        return returns
    starts, lengths = episode_boundaries(episode_index)
    ends = starts + lengths  # exclusive
    # steps_to_end[i] = 0 on an episode's last row, 1 on the one before, ...
    steps_to_end = np.repeat(ends, lengths) - 1 - np.arange(rewards.shape[0])
    order = np.argsort(steps_to_end, kind="stable")
    cuts = np.searchsorted(steps_to_end[order], np.arange(1, int(lengths.max()) + 1))
    for k in range(1, int(lengths.max())):
        rows = order[cuts[k - 1] : cuts[k]]  # rows exactly k steps before their episode's end
        returns[rows] += gamma * returns[rows + 1]
    return returns
