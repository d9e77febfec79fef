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

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from offline_agent.errors import UserError
from offline_agent.plugins import load_user_function

if TYPE_CHECKING:
    from offline_agent.dataset import TrajectoryDataset


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


def last_step_mask(episode_index: np.ndarray) -> np.ndarray:
    """(N,) bool: true on the last row of each episode."""
    starts, lengths = episode_boundaries(episode_index)
    mask = np.zeros(np.asarray(episode_index).shape[0], dtype=bool)
    mask[starts + lengths - 1] = True
    return mask


def previous_in_episode(values: np.ndarray, episode_index: np.ndarray, first: float = 0.0) -> np.ndarray:
    """`values` shifted one step later within each episode: out[t] = values[t-1], out[first row] = `first`."""
    values = np.asarray(values, dtype=np.float64)
    out = np.empty_like(values)
    if values.shape[0] == 0:
        return out
    out[1:] = values[:-1]
    starts, _ = episode_boundaries(episode_index)
    out[starts] = first
    return out


def forward_fill_in_episode(
    values: np.ndarray, episode_index: np.ndarray, initial: float = 0.0
) -> np.ndarray:
    """Replace NaNs by the last known value of the same episode (`initial` before any is known)."""
    filled = np.asarray(values, dtype=np.float64).copy()
    if filled.shape[0] == 0:
        return filled
    starts, _ = episode_boundaries(episode_index)
    filled[starts] = np.where(np.isnan(filled[starts]), initial, filled[starts])
    # every episode start is now known, so carrying the last known index never crosses episodes
    known = np.where(np.isnan(filled), 0, np.arange(filled.shape[0]))
    return filled[np.maximum.accumulate(known)]


# --- reward terms: each (N,) float64 ---------------------------------------------------------------


def outcome_reward(outcome: np.ndarray, is_last: np.ndarray, weight: float = 1.0) -> np.ndarray:
    """Sparse outcome: `r_t = weight * outcome(episode)` on an episode's last step, 0 elsewhere.

    outcome: (N,) float, the step's episode outcome broadcast to its rows (NaN = unknown -> 0).
    is_last: (N,) bool.
    """
    outcome = np.nan_to_num(np.asarray(outcome, dtype=np.float64), nan=0.0)
    return np.where(is_last, weight * outcome, 0.0)


def subgoal_reward(sub_goals_done: np.ndarray, episode_index: np.ndarray, weight: float = 1.0) -> np.ndarray:
    """Dense sub-goal credit: `r_t = weight * (done_t - done_{t-1})`, with `done_{-1} = 0`.

    sub_goals_done: (N,) float, the count after step t's action (a step's `info`); NaN where the
    log did not say, read as "unchanged since the last known count".
    """
    done = forward_fill_in_episode(sub_goals_done, episode_index, initial=0.0)
    return weight * (done - previous_in_episode(done, episode_index, first=0.0))


def step_reward(n_steps: int, cost: float) -> np.ndarray:
    """Per-step efficiency term: `r_t = cost` on every step (a negative cost is a penalty)."""
    return np.full(n_steps, float(cost))


def potential_shaping(potential: np.ndarray, is_last: np.ndarray, gamma: float) -> np.ndarray:
    """Potential-based shaping (Ng, Harada & Russell 1999): `F_t = gamma * Phi(s_{t+1}) - Phi(s_t)`.

    potential: (N,) float, Phi(s_t) of the state each step acted in.
    is_last: (N,) bool; the state after an episode's last step counts as terminal, Phi = 0.
    Phi(terminal) = 0 makes the shaped discounted return differ from the original by
    -Phi(s_0) only, a constant per start state, so the optimal policy is unchanged.
    """
    potential = np.asarray(potential, dtype=np.float64)
    next_potential = np.zeros_like(potential)
    next_potential[:-1] = potential[1:]
    next_potential[is_last] = 0.0
    return gamma * next_potential - potential


def subgoal_potential(
    sub_goals_done: np.ndarray, sub_goals_total: np.ndarray, episode_index: np.ndarray
) -> np.ndarray:
    """Built-in potential: the fraction of sub-goals done *before* step t, `Phi(s_t) = done_{t-1} / total`.

    sub_goals_done, sub_goals_total: (N,) float from each step's `info` (after its action; NaN = unknown).
    `total` is the episode's largest known total; an episode with no known total has Phi = 0.
    """
    done = forward_fill_in_episode(sub_goals_done, episode_index, initial=0.0)
    before = previous_in_episode(done, episode_index, first=0.0)
    starts, lengths = episode_boundaries(episode_index)
    totals = np.nan_to_num(np.asarray(sub_goals_total, dtype=np.float64), nan=0.0)
    total = np.repeat(np.maximum.reduceat(totals, starts), lengths) if starts.size else totals
    return np.divide(before, total, out=np.zeros_like(before), where=total > 0)


# --- annealing the shaping term over training ------------------------------------------------------

SCHEDULES = ("linear", "cosine", "constant")


def shaping_weight(step: int, total: int, schedule: str = "linear") -> float:
    """Weight of the shaping term at training step `step` of `total`: 1 at the start, 0 at the end.

    linear: `1 - u`; cosine: `(1 + cos(pi * u)) / 2`; constant: 1; with `u = clip(step / total, 0, 1)`.
    Any weight w keeps shaping potential-based (w * Phi is a potential), so the optimal policy is
    the same at every point of the schedule; annealing only removes the shaping's bias on values.
    """
    if total <= 0:
        raise ValueError(f"total must be > 0 training steps, got {total}")
    u = min(max(step / total, 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - u
    if schedule == "cosine":
        return 0.5 * (1.0 + float(np.cos(np.pi * u)))
    if schedule == "constant":
        return 1.0
    raise ValueError(f"unknown shaping schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


# --- reward specs ----------------------------------------------------------------------------------

VALID_TERMS = (
    "outcome[:W], subgoal[:W], step:C, shaping:subgoals, shaping:module:function, current[:W]"
    " joined with '+' (e.g. 'outcome+subgoal:0.1+step:-0.01')"
)
WEIGHTED_TERMS = ("outcome", "subgoal", "current")
BUILTIN_POTENTIALS = ("subgoals",)
# split on '+' only before a term name, so that '1e+3' or 'step:+0.5' stay numbers
_TERM_SEPARATOR = re.compile(r"\+(?=\s*[A-Za-z_])")
_CALLABLE_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

Potential = Callable[[dict[str, Any]], float]


@dataclass(frozen=True)
class RewardTerm:
    """One term of a spec: `name` with its weight (outcome, subgoal, current), cost (step) or potential."""

    name: str
    weight: float = 1.0
    potential: str | None = None

    def __str__(self) -> str:
        if self.name == "shaping":
            return f"shaping:{self.potential}"
        if self.name == "step" or self.weight != 1.0:
            return f"{self.name}:{self.weight!r}"
        return self.name


@dataclass(frozen=True)
class RewardSpec:
    """A parsed reward spec: the reward of a step is the sum of its terms."""

    terms: tuple[RewardTerm, ...]

    def __str__(self) -> str:
        return "+".join(str(t) for t in self.terms)

    def term(self, name: str) -> RewardTerm | None:
        return next((t for t in self.terms if t.name == name), None)


def _spec_error(spec: str, what: str) -> UserError:
    return UserError(f"bad reward spec {spec!r}: {what}; valid terms: {VALID_TERMS}")


def parse_reward_spec(spec: str) -> RewardSpec:
    """Parse a reward spec string.

    Grammar (terms joined by '+', each name at most once, order kept):
      outcome[:W]        W * the episode's outcome on its last step (W = 1)
      subgoal[:W]        W * the increase of info.sub_goals_done at each step (W = 1)
      step:C             C on every step (C < 0: an efficiency penalty)
      current[:W]        W * the dataset's current `reward` column (e.g. the log's own step rewards)
      shaping:subgoals   potential-based shaping with Phi = fraction of sub-goals done
      shaping:mod:fn     potential-based shaping with Phi = mod.fn(step_row) -> float
    A user potential is imported here, so a spec that names a missing one fails before any work.
    """
    if not spec or not spec.strip():
        raise _spec_error(spec, "it is empty")
    terms: list[RewardTerm] = []
    for raw in _TERM_SEPARATOR.split(spec.strip()):
        name, has_arg, arg = raw.strip().partition(":")
        name, arg = name.strip(), arg.strip()
        if any(t.name == name for t in terms):
            raise _spec_error(spec, f"term {name!r} appears twice")
        if name in WEIGHTED_TERMS:
            terms.append(RewardTerm(name, _parse_number(spec, name, arg) if has_arg else 1.0))
        elif name == "step":
            if not has_arg:
                raise _spec_error(spec, "'step' needs a per-step value, e.g. step:-0.01")
            terms.append(RewardTerm("step", _parse_number(spec, name, arg)))
        elif name == "shaping":
            if arg not in BUILTIN_POTENTIALS and not _CALLABLE_REF.match(arg):
                raise _spec_error(
                    spec, f"shaping potential {arg!r} is neither 'subgoals' nor module:function"
                )
            if arg not in BUILTIN_POTENTIALS:
                load_potential(arg)
            terms.append(RewardTerm("shaping", potential=arg))
        else:
            raise _spec_error(spec, f"unknown term {raw.strip()!r}")
    return RewardSpec(tuple(terms))


def _parse_number(spec: str, name: str, arg: str) -> float:
    try:
        value = float(arg)
    except ValueError:
        raise _spec_error(spec, f"{name!r} takes a number, got {arg!r}") from None
    if not np.isfinite(value):
        raise _spec_error(spec, f"{name!r} takes a finite number, got {arg!r}")
    return value


def load_potential(ref: str) -> Potential:
    """Import a user potential `module.path:function`; it is called with one step row (a dict)."""
    module_name, _, function_name = ref.rpartition(":")
    return load_user_function(module_name, function_name, f"the shaping potential {ref!r}")


# --- composing a spec over a steps table -----------------------------------------------------------


@dataclass(frozen=True)
class RewardParts:
    """The reward of each step under a spec, split so that shaping can be annealed.

    base: (N,) float64, the sum of the non-shaping terms; shaping: (N,) float64, F_t (zeros if none);
    terms: each term's (N,) contribution by name.
    """

    base: np.ndarray
    shaping: np.ndarray
    terms: dict[str, np.ndarray] = field(default_factory=dict)

    def total(self, shaping_weight: float = 1.0) -> np.ndarray:
        """`r_t = base_t + shaping_weight * F_t` (see `shaping_weight()` for annealing schedules)."""
        return self.base + shaping_weight * self.shaping


def info_number(info: pa.Array | pa.ChunkedArray, key: str) -> np.ndarray:
    """(N,) float64: the number at `key` of each row's `info` JSON; NaN where absent, null or not JSON."""
    import polars as pl

    series = pl.from_arrow(info)
    assert isinstance(series, pl.Series)
    return series.str.json_path_match(f"$.{key}").cast(pl.Float64, strict=False).to_numpy().astype(np.float64)


def _require_info(values: np.ndarray, key: str, term: str) -> None:
    if values.size and np.isnan(values).all():
        raise UserError(
            f"reward term {term!r} reads info.{key} from the steps, and no step of this dataset has it; "
            f"choose another term ({VALID_TERMS})"
        )


def _episode_codes(steps: pa.Table) -> np.ndarray:
    # integer codes compare and sort much faster than Python strings
    ids = steps.column("episode_id").combine_chunks()
    return ids.dictionary_encode().indices.to_numpy(zero_copy_only=False)


def _outcome_per_step(steps: pa.Table, episodes: pa.Table) -> np.ndarray:
    import pyarrow.compute as pc  # here: ingest workers import this module, and pyarrow.compute costs 20 ms

    row = pc.index_in(steps.column("episode_id"), value_set=episodes.column("episode_id").combine_chunks())
    if row.null_count:
        missing = steps.column("episode_id").filter(pc.is_null(row))[0]
        raise UserError(f"step of episode {missing.as_py()!r} has no row in episodes; the dataset is damaged")
    outcome = pc.fill_null(episodes.column("outcome").cast(pa.float64()), float("nan"))
    return pc.take(outcome, row).to_numpy(zero_copy_only=False).astype(np.float64)


def _user_potential(steps: pa.Table, potential: Potential, ref: str) -> np.ndarray:
    values = np.empty(steps.num_rows, dtype=np.float64)
    for i, row in enumerate(steps.to_pylist()):
        try:
            row["info"] = json.loads(row["info"]) if row.get("info") else {}
        except json.JSONDecodeError:
            row["info"] = {}
        try:
            values[i] = float(potential(row))
        except (TypeError, ValueError) as exc:
            raise UserError(
                f"shaping potential {ref} failed on episode {row['episode_id']!r} step {row['step']}: {exc}; "
                "it must return a float for every step row"
            ) from None
    if not np.isfinite(values).all():
        bad = int(np.flatnonzero(~np.isfinite(values))[0])
        raise UserError(f"shaping potential {ref} returned {values[bad]} on row {bad}; it must be finite")
    return values


def compute_rewards(steps: pa.Table, episodes: pa.Table, spec: RewardSpec | str, gamma: float) -> RewardParts:
    """The reward of every step of `steps` (sorted by episode_id, step) under `spec`.

    Needs the steps columns episode_id, step, reward, info (and all of them for a user potential)
    and the episodes columns episode_id, outcome.
    """
    spec = parse_reward_spec(spec) if isinstance(spec, str) else spec
    n = steps.num_rows
    episode_index = _episode_codes(steps)
    is_last = last_step_mask(episode_index)
    terms: dict[str, np.ndarray] = {}
    done = total = np.full(n, np.nan)
    shaping_term = spec.term("shaping")
    if spec.term("subgoal") or (shaping_term is not None and shaping_term.potential == "subgoals"):
        done = info_number(steps.column("info"), "sub_goals_done")
        total = info_number(steps.column("info"), "sub_goals_total")
    shaping = np.zeros(n)
    for term in spec.terms:
        if term.name == "outcome":
            terms["outcome"] = outcome_reward(_outcome_per_step(steps, episodes), is_last, term.weight)
        elif term.name == "subgoal":
            _require_info(done, "sub_goals_done", "subgoal")
            terms["subgoal"] = subgoal_reward(done, episode_index, term.weight)
        elif term.name == "step":
            terms["step"] = step_reward(n, term.weight)
        elif term.name == "current":
            terms["current"] = term.weight * steps.column("reward").to_numpy().astype(np.float64)
        elif term.name == "shaping":
            if term.potential == "subgoals":
                _require_info(done, "sub_goals_done", "shaping:subgoals")
                _require_info(total, "sub_goals_total", "shaping:subgoals")
                phi = subgoal_potential(done, total, episode_index)
            else:
                phi = _user_potential(steps, load_potential(term.potential), term.potential)
            shaping = potential_shaping(phi, is_last, gamma)
            terms["shaping"] = shaping
    base = np.zeros(n)
    for name, values in terms.items():
        if name != "shaping":
            base = base + values
    return RewardParts(base=base, shaping=shaping, terms=terms)


# --- relabel a dataset -----------------------------------------------------------------------------


def relabel(
    dataset: str | Path,
    spec: str,
    out: str | Path,
    *,
    gamma: float | None = None,
    overwrite: bool = False,
) -> TrajectoryDataset:
    """Write a copy of `dataset` at `out` whose rewards follow `spec`; the input is never modified.

    Recomputes steps.reward, steps.return_to_go (discounted with the dataset's gamma, or `gamma`)
    and episodes.return (undiscounted sum). dataset.json of the new dataset records `reward` = the
    record {"mode": "relabel", "spec": spec, ...the parent's other reward fields} and `lineage` =
    {"parent": {"path", "fingerprint"}, "reward_spec": spec}.
    """
    from offline_agent.dataset import TrajectoryDataset, write_dataset

    parent = TrajectoryDataset.open(dataset)
    if Path(out).resolve() == parent.path.resolve():
        raise UserError(
            f"--out {out} is the input dataset; relabel writes a new dataset, choose another --out"
        )
    gamma = parent.gamma if gamma is None else gamma
    if not 0.0 <= gamma <= 1.0:
        raise UserError(f"gamma must be in [0, 1], got {gamma}")
    parsed = parse_reward_spec(spec)
    steps, episodes = parent.steps_table(), parent.episodes_table()

    reward = compute_rewards(steps, episodes, parsed, gamma).total()
    episode_index = _episode_codes(steps)
    return_to_go = discounted_returns(reward, episode_index, gamma)
    steps = _replace_column(steps, "reward", pa.array(reward, pa.float32()))
    steps = _replace_column(steps, "return_to_go", pa.array(return_to_go, pa.float32()))
    episodes = _replace_column(episodes, "return", _episode_returns(steps, episodes, reward, episode_index))

    meta = {k: v for k, v in parent.meta.items() if k not in ("counts", "fingerprint")}
    lineage: dict[str, Any] = {"path": str(parent.path), "fingerprint": parent.meta.get("fingerprint")}
    if "lineage" in parent.meta:
        lineage["lineage"] = parent.meta["lineage"]
    # keep the ingest's reward record (success threshold, ...) and say how the rewards now come about
    parent_reward = parent.meta.get("reward")
    reward_record = {**(parent_reward if isinstance(parent_reward, dict) else {}), "mode": "relabel"}
    meta.update(
        name=Path(out).name,
        reward={**reward_record, "spec": str(parsed)},
        gamma=gamma,
        lineage={"parent": lineage, "reward_spec": str(parsed)},
    )
    return write_dataset(out, steps, episodes, parent.quarantine_table(), meta, overwrite=overwrite)


def _replace_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, values)


def _episode_returns(
    steps: pa.Table, episodes: pa.Table, reward: np.ndarray, episode_index: np.ndarray
) -> pa.Array:
    """(E,) float32 undiscounted return of each row of `episodes` (0 for an episode without steps)."""
    import pyarrow.compute as pc  # see _outcome_per_step

    returns = np.zeros(episodes.num_rows)
    if steps.num_rows:
        starts, _ = episode_boundaries(episode_index)
        sums = np.add.reduceat(reward, starts)
        ids = pc.take(steps.column("episode_id"), pa.array(starts))
        row = pc.index_in(ids, value_set=episodes.column("episode_id").combine_chunks())
        known = pc.is_valid(row).to_numpy(zero_copy_only=False)
        returns[row.to_numpy(zero_copy_only=False)[known].astype(np.int64)] = sums[known]
    return pa.array(returns, pa.float32())
