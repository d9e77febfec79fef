"""The streaming writer: canonical episodes in, Parquet row groups out, memory bounded by one row group.

Rewards are fixed here, from the `--reward` choice: `outcome` puts the
episode's outcome on its last step, `per-step` keeps the log's step rewards,
`score-delta` turns the log's running scores into increments. Return-to-go is
computed with the dataset's gamma per buffered row group (episodes never span
two groups).
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
from offline_agent.schema import EPISODES_SCHEMA, QUARANTINE_SCHEMA, STEPS_SCHEMA, Episode, Quarantined, Step

REWARD_MODES = ("outcome", "per-step", "score-delta")
ROWS_PER_GROUP = 65_536


def step_rewards(episode: Episode, mode: str) -> list[float]:
    """The dataset reward of each step of an episode under a reward mode (see module docstring)."""
    n = len(episode.steps)
    if mode == "outcome":
        return [0.0] * (n - 1) + [float(episode.outcome or 0.0)]
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


def _json(value: Any) -> str | None:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode() if value else None


@dataclass
class StreamingWriter:
    folder: Path
    part: str
    reward_mode: str
    gamma: float
    split: dict[str, float]
    success_threshold: float
    rows_per_group: int = ROWS_PER_GROUP
    digests: dict[str, str] = field(default_factory=dict)
    n_steps: int = 0
    n_episodes: int = 0

    def __post_init__(self) -> None:
        (self.folder / "steps").mkdir(exist_ok=True)
        (self.folder / "episodes").mkdir(exist_ok=True)
        self._steps_out = pq.ParquetWriter(self.folder / "steps" / f"{self.part}.parquet", STEPS_SCHEMA)
        self._episodes_out = pq.ParquetWriter(self.folder / "episodes" / f"{self.part}.parquet", EPISODES_SCHEMA)
        self._steps: dict[str, list] = {name: [] for name in STEPS_SCHEMA.names}
        self._episode_index: list[int] = []
        self._episodes: dict[str, list] = {name: [] for name in EPISODES_SCHEMA.names}

    def add(self, episode: Episode, source: str) -> None:
        rewards = step_rewards(episode, self.reward_mode)
        n = len(episode.steps)
        cols = self._steps
        for i, (s, r) in enumerate(zip(episode.steps, rewards, strict=True)):
            parsed = parse_action(s.action)
            last = i == n - 1
            cols["episode_id"].append(episode.episode_id)
            cols["step"].append(i)
            cols["observation"].append(s.observation)
            cols["action"].append(s.action)
            cols["action_kind"].append(parsed.kind if not (last and parsed.kind != TOOL_CALL) else "final")
            cols["tool_name"].append(parsed.tool_name)
            cols["tool_args"].append(
                orjson.dumps(parsed.tool_args, option=orjson.OPT_SORT_KEYS).decode()
                if parsed.kind == TOOL_CALL
                else None
            )
            cols["reward"].append(r)
            cols["terminated"].append(last and not episode.truncated)
            cols["truncated"].append(last and episode.truncated)
            cols["is_error"].append(s.is_error)
            cols["candidates"].append(s.candidates)
            cols["info"].append(_json(self._step_info(s, r)))
            self._episode_index.append(self.n_episodes)
        outcome = episode.outcome
        success = (
            episode.success
            if episode.success is not None
            else (None if outcome is None else outcome >= self.success_threshold)
        )
        e = self._episodes
        e["episode_id"].append(episode.episode_id)
        e["source"].append(source)
        e["task"].append(episode.task)
        e["agent"].append(episode.agent)
        e["n_steps"].append(n)
        e["return"].append(float(sum(rewards)))
        e["success"].append(success)
        e["outcome"].append(outcome)
        e["split"].append(split_of(episode.episode_id, self.split))
        e["metadata"].append(_json(episode.metadata))
        self.digests[episode.episode_id] = episode_digest(
            episode.episode_id, [s.action for s in episode.steps], [s.observation for s in episode.steps], rewards
        )
        self.n_steps += n
        self.n_episodes += 1
        if len(cols["step"]) >= self.rows_per_group:
            self.flush()

    def _step_info(self, s: Step, reward: float) -> dict[str, Any]:
        # The log's own numbers are kept even when the dataset's reward is something else,
        # so a later relabel can use them.
        info = dict(s.info)
        if s.score is not None:
            info["score"] = s.score
        if s.reward is not None and (self.reward_mode != "per-step" or s.reward != reward):
            info["log_reward"] = s.reward
        return info

    def flush(self) -> None:
        cols = self._steps
        if cols["step"]:
            rewards = np.asarray(cols["reward"], dtype=np.float64)
            cols["return_to_go"] = discounted_returns(rewards, np.asarray(self._episode_index), self.gamma).tolist()
            self._steps_out.write_table(pa.table(cols, schema=STEPS_SCHEMA))
            self._episodes_out.write_table(pa.table(self._episodes, schema=EPISODES_SCHEMA))
        self._steps = {name: [] for name in STEPS_SCHEMA.names}
        self._episodes = {name: [] for name in EPISODES_SCHEMA.names}
        self._episode_index = []

    def close(self) -> None:
        self.flush()
        self._steps_out.close()
        self._episodes_out.close()


def quarantine_table(rows: list[tuple[str, Quarantined]]) -> pa.Table:
    return pa.table(
        {
            "source": [source for source, _ in rows],
            "location": [q.location for _, q in rows],
            "reason": [q.reason for _, q in rows],
            "raw": [q.raw for _, q in rows],
        },
        schema=QUARANTINE_SCHEMA,
    )
