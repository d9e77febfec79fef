"""Adapter for OpenAI chat logs: records holding a list of messages with tool calls.

Each assistant tool call is one step; an assistant message without tool calls
is a message step. `tool` messages are results, matched to their call by
`tool_call_id` (by position where ids repeat). Optional extensions that our
simulators write and real logs may have: `candidates` on an assistant message
(the valid actions at that decision), and `is_error`, `reward`, `score`,
`info` on a tool or user message (what the previous action led to).
"""

from __future__ import annotations

from typing import Any

from offline_agent.actions import ActionError, canonical_action
from offline_agent.ingest.builder import EpisodeBuilder, RecordError, as_float, looks_like_error, text_of
from offline_agent.ingest.options import SourceOptions, other_fields, require_dict, require_list
from offline_agent.ingest.readers import Record
from offline_agent.schema import Episode

MESSAGES = ("messages", "traj")
OUTCOME = ("reward", "score", "outcome")
RESULT_EXTRAS = ("is_error", "reward", "score", "info")


def adapt_record(record: Record, opts: SourceOptions) -> Episode:
    r = require_dict(record.value)
    messages = require_list(opts.lookup(r, "messages", MESSAGES, required=True), "messages")
    builder = EpisodeBuilder()
    system: list[str] = []
    first_user: str | None = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RecordError(f"message {i} must be an object with a string 'role'")
        role = message["role"]
        try:
            if role in ("system", "developer"):
                system.append(text_of(message.get("content")))
            elif role == "user":
                text = text_of(message.get("content"))
                first_user = text if first_user is None else first_user
                if builder.steps and any(k in message for k in RESULT_EXTRAS):
                    builder.set_outcome(builder.steps[-1], *_result_extras(message, text))
                builder.observe(text)
            elif role == "assistant":
                _assistant(builder, message)
            elif role in ("tool", "function"):
                text = text_of(message.get("content"))
                is_error, reward, score, info = _result_extras(message, text)
                builder.result(message.get("tool_call_id"), text, is_error, reward, score, info)
            else:
                raise RecordError(f"unknown role {role!r} (expected system, user, assistant or tool)")
        except (RecordError, ActionError) as exc:
            raise RecordError(f"message {i} ({role}): {exc}") from None
    steps = builder.finish()
    task = opts.lookup(r, "task", ("task",))
    outcome = as_float(opts.lookup(r, "reward", OUTCOME), opts.mapping.get("reward", "reward"))
    success = r.get("success") if isinstance(r.get("success"), bool) else None
    metadata = other_fields(r, (opts.mapping.get("messages", ""), *MESSAGES))
    if system:
        metadata["system"] = "\n".join(system)
    return Episode(
        episode_id=opts.episode_id(r, record.location),
        steps=steps,
        task=task if isinstance(task, str) else first_user,
        agent=_agent(r),
        outcome=outcome,
        success=success,
        truncated=bool(r.get("truncated", False)),
        metadata=metadata,
    )


def _assistant(builder: EpisodeBuilder, message: dict) -> None:
    text = text_of(message.get("content"))
    candidates = message.get("candidates")
    if candidates is not None:
        candidates = [canonical_action(c) for c in require_list(candidates, "candidates")]
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise RecordError("'tool_calls' must be a list")
    if not tool_calls:
        if text:
            builder.act(text, candidates=candidates)
        return
    for k, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise RecordError(f"tool call {k} must be an object")
        info: dict[str, Any] = {"assistant_text": text} if text and k == 0 else {}
        builder.act(
            canonical_action(call),
            call_id=call.get("id"),
            candidates=candidates if k == 0 else None,
            info=info,
            expects_result=True,
        )


def _result_extras(message: dict, text: str) -> tuple[bool, float | None, float | None, dict | None]:
    flagged = message.get("is_error")
    is_error = bool(flagged) if flagged is not None else looks_like_error(text)
    info = message.get("info")
    if info is not None and not isinstance(info, dict):
        raise RecordError("'info' must be an object")
    return is_error, as_float(message.get("reward"), "reward"), as_float(message.get("score"), "score"), info


def _agent(r: dict) -> str | None:
    for key in ("agent", "model", "policy"):
        if isinstance(r.get(key), str):
            return r[key]
    return None
