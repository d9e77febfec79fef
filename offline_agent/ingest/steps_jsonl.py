"""Adapter for per-step logs: one record per step, grouped into episodes by `episode_id`.

Steps of an episode may be interleaved with other episodes' steps; an episode is
emitted when its `done` step arrives, and episodes still open at the end of the
file are emitted as truncated. Memory holds only the open episodes.
Field names are set with `--map` (defaults: episode_id, step, observation,
action, reward, done, plus optional truncated, is_error, candidates, task,
info, outcome/success).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from offline_agent.actions import ActionError, canonical_action
from offline_agent.ingest.builder import RecordError, as_float
from offline_agent.ingest.options import SourceOptions, require_dict, require_list
from offline_agent.ingest.readers import Record
from offline_agent.schema import Episode, Quarantined, Step


@dataclass
class _OpenEpisode:
    steps: dict[int, Step] = field(default_factory=dict)
    task: str | None = None
    outcome: float | None = None
    success: bool | None = None


def adapt_stream(items: Iterable[Record | Quarantined], opts: SourceOptions) -> Iterator[Episode | Quarantined]:
    open_episodes: dict[str, _OpenEpisode] = {}
    for item in items:
        if isinstance(item, Quarantined):
            yield item
            continue
        try:
            episode_id, index, step, done, extras = _read_step(item.value, opts)
        except (RecordError, ActionError) as exc:
            yield Quarantined(item.location, str(exc), item.raw_text())
            continue
        episode = open_episodes.setdefault(episode_id, _OpenEpisode())
        if index in episode.steps:
            yield Quarantined(
                item.location,
                f"duplicate step {index} of episode {episode_id!r}: the first one was kept",
                item.raw_text(),
            )
            continue
        episode.steps[index] = step
        episode.task = extras.get("task") or episode.task
        episode.outcome = extras["outcome"] if extras.get("outcome") is not None else episode.outcome
        episode.success = extras["success"] if extras.get("success") is not None else episode.success
        if done:
            yield _close(episode_id, open_episodes.pop(episode_id), truncated=bool(extras.get("truncated")))
    for episode_id, episode in open_episodes.items():
        yield _close(episode_id, episode, truncated=True)


def _read_step(value, opts: SourceOptions):
    r = require_dict(value)
    episode_id = opts.lookup(r, "episode_id", ("episode_id",), required=True)
    index = opts.lookup(r, "step", ("step",), required=True)
    observation = opts.lookup(r, "observation", ("observation",), required=True)
    action = opts.lookup(r, "action", ("action",), required=True)
    if not isinstance(episode_id, str | int) or isinstance(episode_id, bool):
        raise RecordError(f"'episode_id' must be a string or integer, got {episode_id!r:.60}")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise RecordError(f"'step' must be a non-negative integer, got {index!r:.60}")
    if not isinstance(observation, str):
        raise RecordError(f"'observation' must be a string, got {type(observation).__name__}")
    candidates = opts.lookup(r, "candidates", ("candidates",))
    info = opts.lookup(r, "info", ("info",)) or {}
    if not isinstance(info, dict):
        raise RecordError("'info' must be an object")
    step = Step(
        observation=observation,
        action=canonical_action(action),
        reward=as_float(opts.lookup(r, "reward", ("reward",)), "reward"),
        score=as_float(opts.lookup(r, "score", ("score",)), "score"),
        is_error=bool(opts.lookup(r, "is_error", ("is_error",))),
        candidates=[canonical_action(c) for c in require_list(candidates, "candidates")] if candidates else None,
        info=dict(info),
    )
    success = opts.lookup(r, "success", ("success",))
    extras = {
        "task": opts.lookup(r, "task", ("task",)),
        "outcome": as_float(opts.lookup(r, "outcome", ("outcome",)), "outcome"),
        "success": success if isinstance(success, bool) else None,
        "truncated": opts.lookup(r, "truncated", ("truncated",)),
    }
    return str(episode_id), index, step, bool(opts.lookup(r, "done", ("done", "terminated"))), extras


def _close(episode_id: str, episode: _OpenEpisode, truncated: bool) -> Episode:
    steps = [episode.steps[i] for i in sorted(episode.steps)]
    return Episode(
        episode_id=episode_id,
        steps=steps,
        task=episode.task if isinstance(episode.task, str) else None,
        outcome=episode.outcome,
        success=episode.success,
        truncated=truncated,
        records=len(steps),
    )
