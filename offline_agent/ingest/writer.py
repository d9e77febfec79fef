"""From canonical episodes to Parquet: `EpisodeRows` builds Arrow row groups, `StreamingWriter` writes them.

Rewards are fixed here, from the `--reward` choice: `outcome` puts the
episode's outcome on its last step, `per-step` keeps the log's step rewards,
`score-delta` turns the log's running scores into increments. Return-to-go is
computed with the dataset's gamma when a row group is built (an episode never
spans two groups). Row groups are built either in this process or in worker
processes (see `offline_agent.ingest.parallel`); either way memory is bounded
by a few row groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from offline_agent.actions import TOOL_CALL, parse_action
from offline_agent.dataset import episode_digest, split_of
from offline_agent.rewards import discounted_returns
from offline_agent.schema import (
    EPISODES_SCHEMA,
    QUARANTINE_SCHEMA,
    STEPS_SCHEMA,
    ColumnarEpisode,
    Episode,
    Quarantined,
    Step,
)

REWARD_MODES = ("outcome", "per-step", "score-delta")
ROWS_PER_GROUP = 65_536
#: Step columns whose row-group min/max are written. Not the free texts (observation, action, arguments,
#: info): rows are grouped by episode, so their min and max span nearly every value and prune nothing,
#: and computing them was 1% of ingestion.
STEP_STATISTICS = [name for name in STEPS_SCHEMA.names if name not in ("observation", "action", "tool_args", "info")]


def step_rewards(episode: Episode | ColumnarEpisode, mode: str) -> list[float]:
    """The dataset reward of each step of an episode under a reward mode (see module docstring)."""
    n = episode.n_steps
    if mode == "outcome":
        return [0.0] * (n - 1) + [float(episode.outcome or 0.0)]
    if isinstance(episode, ColumnarEpisode) and mode in REWARD_MODES:
        return [0.0] * n  # its steps carry no log rewards or scores
    if mode == "per-step":
        return [float(s.reward or 0.0) for s in episode.steps]
    if mode == "score-delta":
        rewards, previous = [], 0.0
        for s in episode.steps:
            score = previous if s.score is None else s.score
            rewards.append(score - previous)
            previous = score
        return rewards
    raise ValueError(f"unknown reward mode {mode!r}; expected one of {REWARD_MODES}")


#: Step columns in the order `_extend_columns` takes their lists (then the episode index).
COLUMN_ORDER = ("episode_id", "step", "observation", "action", "action_kind", "tool_name", "tool_args", "reward",
                "terminated", "truncated", "is_error", "candidates", "info")


def _extend_columns_python(
    lists: tuple[list, ...], episode_id: str, observations: list, actions: list, kinds: list, tool_names: list,
    tool_args: list, is_error: list, infos: list, rewards: list, truncated: bool, index: int, to_json,
) -> None:
    """Append one columnar episode's steps to the lists of COLUMN_ORDER and the episode index
    (`_speedups.extend_columns` is this function compiled; the tests hold them to the same result)."""
    (episode_ids, steps, observation, action, action_kind, tool_name, tool_arg, reward, terminated, truncateds,
     errors, candidates, info, episode_index) = lists
    n = len(actions)
    nones = [None] * n
    ends = [False] * n
    episode_ids += [episode_id] * n
    steps += range(n)
    observation += observations
    action += actions
    action_kind += kinds
    tool_name += tool_names
    tool_arg += tool_args
    reward += rewards
    ends[-1] = not truncated
    terminated += ends
    ends[-1] = truncated
    truncateds += ends
    errors += is_error
    candidates += nones
    # An info that is None or empty is written as null (`_json`), so most episodes need no call at all.
    info += [to_json(i) for i in infos] if any(infos) else nones
    episode_index += [index] * n


try:  # compiled where a C compiler was there at install time (see setup.py)
    from offline_agent._speedups import extend_columns as _extend_columns
except ImportError:
    _extend_columns = _extend_columns_python


def _json(value: Any) -> str | None:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode() if value else None


@dataclass(frozen=True)
class RowSettings:
    """What turns an episode into rows: the dataset's reward mode, gamma, split rule and success threshold."""

    reward_mode: str
    gamma: float
    split: dict[str, float]
    success_threshold: float


@dataclass
class RowGroup:
    """A built row group: Arrow tables of steps and episodes, and each episode's content digest."""

    steps: pa.Table
    episodes: pa.Table
    digests: dict[str, str]

    def without(self, episode_ids: set[str]) -> RowGroup:
        """The same group minus some episodes (duplicates found after the group was built)."""
        if not episode_ids:
            return self
        import pyarrow.compute as pc  # here: a worker process rarely needs it, and importing it costs 20 ms

        drop = pa.array(sorted(episode_ids), pa.string())
        return RowGroup(
            self.steps.filter(pc.invert(pc.is_in(self.steps["episode_id"], value_set=drop))),
            self.episodes.filter(pc.invert(pc.is_in(self.episodes["episode_id"], value_set=drop))),
            {k: v for k, v in self.digests.items() if k not in episode_ids},
        )


class EpisodeRows:
    """Accumulates episodes as columns; `build()` turns them into a `RowGroup` and starts afresh."""

    def __init__(self, settings: RowSettings):
        self.settings = settings
        self._reset()

    def _reset(self) -> None:
        self._steps: dict[str, list] = {name: [] for name in STEPS_SCHEMA.names if name != "return_to_go"}
        self._episodes: dict[str, list] = {name: [] for name in EPISODES_SCHEMA.names}
        self._episode_index: list[int] = []
        self._digests: dict[str, str] = {}
        # The lists `_extend_columns` appends to, in its order.
        self._lists = (*(self._steps[name] for name in COLUMN_ORDER), self._episode_index)

    @property
    def n_steps(self) -> int:
        return len(self._steps["step"])

    def add(self, episode: Episode | ColumnarEpisode, source: str) -> None:
        if isinstance(episode, ColumnarEpisode):
            self._add_columns(episode, source)
            return
        settings = self.settings
        rewards = step_rewards(episode, settings.reward_mode)
        n = len(episode.steps)
        cols = self._steps
        index = len(self._episodes["episode_id"])
        for i, (s, r) in enumerate(zip(episode.steps, rewards, strict=True)):
            parsed = parse_action(s.action)
            last = i == n - 1
            is_call = parsed.kind == TOOL_CALL
            cols["episode_id"].append(episode.episode_id)
            cols["step"].append(i)
            cols["observation"].append(s.observation)
            cols["action"].append(s.action)
            cols["action_kind"].append(parsed.kind if (is_call or not last) else "final")
            cols["tool_name"].append(parsed.tool_name)
            cols["tool_args"].append(
                orjson.dumps(parsed.tool_args, option=orjson.OPT_SORT_KEYS).decode() if is_call else None
            )
            cols["reward"].append(r)
            cols["terminated"].append(last and not episode.truncated)
            cols["truncated"].append(last and episode.truncated)
            cols["is_error"].append(s.is_error)
            cols["candidates"].append(s.candidates)
            cols["info"].append(_json(self._step_info(s, r)))
            self._episode_index.append(index)
        self._add_episode(episode, source, rewards, [s.action for s in episode.steps],
                          [s.observation for s in episode.steps])

    def _add_columns(self, episode: ColumnarEpisode, source: str) -> None:
        """`add` for an episode already in columns: whole columns are extended, nothing is parsed again."""
        rewards = step_rewards(episode, self.settings.reward_mode)
        e = episode
        _extend_columns(
            self._lists, e.episode_id, e.observations, e.actions, e.action_kinds, e.tool_names, e.tool_args,
            e.is_error, e.infos, rewards, e.truncated, len(self._episodes["episode_id"]), _json,
        )
        self._add_episode(episode, source, rewards, episode.actions, episode.observations)

    def _add_episode(self, episode: Episode | ColumnarEpisode, source: str, rewards: list[float],
                     actions: list[str], observations: list[str]) -> None:
        settings = self.settings
        n = episode.n_steps
        outcome = episode.outcome
        if episode.success is not None:
            success = episode.success
        else:
            success = None if outcome is None else outcome >= settings.success_threshold
        e = self._episodes
        e["episode_id"].append(episode.episode_id)
        e["source"].append(source)
        e["task"].append(episode.task)
        e["agent"].append(episode.agent)
        e["n_steps"].append(n)
        e["return"].append(float(sum(rewards)))
        e["success"].append(success)
        e["outcome"].append(outcome)
        e["split"].append(split_of(episode.episode_id, settings.split))
        e["metadata"].append(_json(episode.metadata))
        self._digests[episode.episode_id] = episode_digest(episode.episode_id, actions, observations, rewards)

    def _step_info(self, s: Step, reward: float) -> dict[str, Any]:
        # The log's own numbers are kept even when the dataset's reward is something else,
        # so a later relabel can use them.
        info = dict(s.info)
        if s.score is not None:
            info["score"] = s.score
        if s.reward is not None and (self.settings.reward_mode != "per-step" or s.reward != reward):
            info["log_reward"] = s.reward
        return info

    def build(self) -> RowGroup:
        rewards = np.asarray(self._steps["reward"], dtype=np.float64)
        returns = discounted_returns(rewards, np.asarray(self._episode_index, dtype=np.int64), self.settings.gamma)
        # Converted straight to the schema's types (no inference, then a cast, of a million values).
        steps = pa.table({**self._steps, "return_to_go": returns.astype(np.float32)}, schema=STEPS_SCHEMA)
        group = RowGroup(steps, pa.table(self._episodes, schema=EPISODES_SCHEMA), dict(self._digests))
        self._reset()
        return group


def write_part(folder: Path, part: str, group: RowGroup) -> None:
    """A whole part in one go: `folder/steps/{part}.parquet` and `folder/episodes/{part}.parquet`."""
    pq.write_table(group.steps, folder / "steps" / f"{part}.parquet", row_group_size=ROWS_PER_GROUP * 2,
                   write_statistics=STEP_STATISTICS)
    pq.write_table(group.episodes, folder / "episodes" / f"{part}.parquet")


def drop_from_part(folder: Path, part: str, episode_ids: set[str]) -> tuple[int, int]:
    """Rewrite a part without some episodes (duplicates found after it was written); returns the
    (steps, episodes) left. A part left empty is removed."""
    steps_file, episodes_file = folder / "steps" / f"{part}.parquet", folder / "episodes" / f"{part}.parquet"
    group = RowGroup(pq.read_table(steps_file), pq.read_table(episodes_file), {}).without(episode_ids)
    if group.episodes.num_rows == 0:
        steps_file.unlink()
        episodes_file.unlink()
    else:
        write_part(folder, part, group)
    return group.steps.num_rows, group.episodes.num_rows


@dataclass
class StreamingWriter:
    """Appends row groups to one part file of steps and one of episodes, and counts parts written beside it
    (`adopt`) by worker processes."""

    folder: Path
    part: str
    digests: dict[str, str] = field(default_factory=dict)
    n_steps: int = 0
    n_episodes: int = 0

    def __post_init__(self) -> None:
        (self.folder / "steps").mkdir(exist_ok=True)
        (self.folder / "episodes").mkdir(exist_ok=True)
        self._steps_out = pq.ParquetWriter(
            self.folder / "steps" / f"{self.part}.parquet", STEPS_SCHEMA, write_statistics=STEP_STATISTICS
        )
        self._episodes_out = pq.ParquetWriter(self.folder / "episodes" / f"{self.part}.parquet", EPISODES_SCHEMA)

    def write(self, group: RowGroup) -> None:
        if group.episodes.num_rows == 0:
            return
        self._steps_out.write_table(group.steps, row_group_size=ROWS_PER_GROUP * 2)
        self._episodes_out.write_table(group.episodes)
        self.digests.update(group.digests)
        self.n_steps += group.steps.num_rows
        self.n_episodes += group.episodes.num_rows

    def adopt(self, digests: dict[str, str], n_steps: int) -> None:
        """Count a part another process wrote into the same folder (its digests, its steps)."""
        self.digests.update(digests)
        self.n_steps += n_steps
        self.n_episodes += len(digests)

    def close(self) -> None:
        self._steps_out.close()
        self._episodes_out.close()


def quarantine_table(rows: list[tuple[str, Quarantined]]) -> pa.Table:
    columns = ([source for source, _ in rows], [q.location for _, q in rows], [q.reason for _, q in rows],
               [q.raw for _, q in rows])
    return pa.Table.from_arrays([string_array(c) for c in columns], schema=QUARANTINE_SCHEMA)


def string_array(values: list[str | None]) -> pa.Array:
    """`pa.array(values, pa.string())`, built from its buffers.

    Converting a Python list makes pyarrow import pandas, where installed, to ask whether the list is a
    pandas object: 0.15 s at the end of an ingest whose rows were all built by worker processes.
    """
    encoded = [b"" if v is None else v.encode() for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:  # more than a string array holds: let pyarrow say so
        return pa.array(values, pa.string())
    valid = np.array([v is not None for v in values], dtype=bool)
    validity = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.StringArray.from_buffers(
        len(values), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(encoded)), validity,
        int(len(values) - valid.sum()),
    )
