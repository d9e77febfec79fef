"""Adapter for one-record-per-episode logs with parallel lists (InterCode's `turn_history` shape).

`actions[i]` is the agent's i-th action and `observations[i]` what it returned,
so the observation of step i is `observations[i-1]` (nothing before the first
action but the task) and the last observation is kept on the last step.
`rewards[i]` is read both as the step reward and as the running score, so
`--reward per-step` and `--reward score-delta` can each use it.
"""

from __future__ import annotations

from offline_agent.actions import ActionError, canonical_action
from offline_agent.ingest.builder import EpisodeBuilder, RecordError, as_float, looks_like_error, text_of
from offline_agent.ingest.options import SourceOptions, other_fields, require_dict, require_list
from offline_agent.ingest.readers import Record
from offline_agent.schema import Episode

FIELDS = {
    "actions": ("turn_history.actions", "actions"),
    "observations": ("turn_history.observations", "observations"),
    "rewards": ("turn_history.rewards", "rewards"),
    "valid": ("turn_history.valid_action", "valid_action"),
    "task": ("query", "task", "instruction"),
    "reward": ("summary.max_reward", "reward", "score", "outcome"),
}


def adapt_record(record: Record, opts: SourceOptions) -> Episode:
    r = require_dict(record.value)
    actions = require_list(opts.lookup(r, "actions", FIELDS["actions"], required=True), "actions")
    observations = require_list(opts.lookup(r, "observations", FIELDS["observations"], required=True), "observations")
    rewards = opts.lookup(r, "rewards", FIELDS["rewards"])
    valid = opts.lookup(r, "valid", FIELDS["valid"])
    lengths = {"actions": len(actions), "observations": len(observations)}
    if rewards is not None:
        lengths["rewards"] = len(require_list(rewards, "rewards"))
    if valid is not None:
        lengths["valid"] = len(require_list(valid, "valid"))
    if len(set(lengths.values())) != 1:
        raise RecordError(f"parallel lists differ in length {lengths}: each action needs one observation")
    builder = EpisodeBuilder()
    for i, action in enumerate(actions):
        try:
            text = canonical_action(action)
        except ActionError as exc:
            raise RecordError(f"action {i}: {exc}") from None
        builder.act(text, expects_result=True)
        observation = text_of(observations[i]) if not isinstance(observations[i], int | float) else str(observations[i])
        score = as_float(rewards[i], f"rewards[{i}]") if rewards is not None else None
        is_error = (not valid[i]) if valid is not None else looks_like_error(observation)
        builder.result(None, observation, bool(is_error), reward=score, score=score)
    task = opts.lookup(r, "task", FIELDS["task"])
    outcome = opts.lookup(r, "reward", FIELDS["reward"])
    if outcome is None and rewards:
        outcome = max(rewards)
    big = tuple(opts.mapping.get(k, FIELDS[k][0]) for k in ("actions", "observations", "rewards", "valid"))
    metadata = other_fields(r, big if "turn_history" in r else ("actions", "observations", "rewards"))
    return Episode(
        episode_id=opts.episode_id(r, record.location),
        steps=builder.finish(),
        task=task if isinstance(task, str) else None,
        agent=r.get("agent") if isinstance(r.get("agent"), str) else None,
        outcome=as_float(outcome, "reward"),
        metadata=metadata,
    )
