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

import orjson

from offline_agent.actions import FINAL, MESSAGE, TOOL_CALL, ActionError, canonical_action, tool_call_text
from offline_agent.ingest.builder import EpisodeBuilder, RecordError, as_float, looks_like_error, text_of
from offline_agent.ingest.options import SourceOptions, other_fields, require_dict, require_list
from offline_agent.ingest.readers import Record
from offline_agent.schema import ColumnarEpisode, Episode

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
    return Episode(steps=steps, **_episode_fields(r, record, opts, system, first_user))


def _episode_fields(
    r: dict, record: Record, opts: SourceOptions, system: list[str], first_user: str | None
) -> dict[str, Any]:
    """What an episode takes from the record around its messages (both paths below use it); a mistyped
    outcome raises RecordError."""
    task, success = opts.lookup(r, "task", ("task",)), r.get("success")
    metadata = other_fields(r, (opts.mapping.get("messages", ""), *MESSAGES))
    if system:
        metadata["system"] = "\n".join(system)
    return dict(
        episode_id=opts.episode_id(r, record.location),
        task=task if isinstance(task, str) else first_user,
        agent=_agent(r),
        outcome=as_float(opts.lookup(r, "reward", OUTCOME), opts.mapping.get("reward", "reward")),
        success=success if isinstance(success, bool) else None,
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


# --- The hot path ---------------------------------------------------------------------------------
#
# `adapt_record` builds a `Step` per decision and canonicalises every call afresh: about 10 µs a
# step, 15x the cost of parsing the line. Most records of a large log have the plain shape below,
# so `plain_episode` builds those straight into columns, with canonical actions cached by (name,
# arguments string), and hands every other record to `adapt_record`. "Plain": string (or null)
# contents, roles among ROLES, tool calls `{"id": str, "function": {...}}` whose ids are not
# reused while open, every result answering an open call, and none of the extras
# (`is_error`, `reward`, `score`, `info`, `candidates`) on any message. For such a record both
# functions give the same rows; tests check it column by column on every bundled and real log.

EXTRAS = frozenset({*RESULT_EXTRAS, "candidates"})
#: The canonical-call memo is `{name: {arguments string: (action, arguments JSON)}}`: two string lookups
#: and no key tuple to build, hash and compare per call. Bounds on the names and on the arguments kept
#: per name keep memory flat.
MAX_CACHED_NAMES = 1_000
MAX_CACHED_CALLS = 100_000


def plain_episode(record: Record, opts: SourceOptions, calls: dict) -> ColumnarEpisode | None:
    """The episode of a plain record (see above) in columns, or None when the record is not plain."""
    r = record.value
    if type(r) is not dict:
        return None
    if len(calls) > MAX_CACHED_NAMES:
        calls.clear()
    messages = opts.lookup(r, "messages", MESSAGES)
    if type(messages) is not list:
        return None
    walked = walk(messages, calls)
    if walked is None:
        return None
    observations, actions, kinds, tool_names, tool_args, is_error, infos, pending, system, first_user = walked
    if not actions:
        return None
    try:
        fields = _episode_fields(r, record, opts, system, first_user)
    except RecordError:
        return None
    if pending:  # text after the last action, as `EpisodeBuilder.finish` keeps it
        infos[-1] = {**(infos[-1] or {}), "final_observation": "\n".join(filter(None, pending))}
    if kinds[-1] == MESSAGE:
        kinds[-1] = FINAL
    return ColumnarEpisode(
        observations=observations,
        actions=actions,
        action_kinds=kinds,
        tool_names=tool_names,
        tool_args=tool_args,
        is_error=is_error,
        infos=infos,
        **fields,
    )


def walk_messages(messages: list, calls: dict) -> tuple | None:
    """The step columns of a plain message list, or None at the first sign that it is not plain.

    Returns (observations, actions, kinds, tool_names, tool_args, is_error, infos, pending, system,
    first_user): seven step columns, the texts after the last action, the system texts, the first
    user text. One function with local lists, not an `EpisodeBuilder`: on this path a method call
    per step costs as much as the work. The bookkeeping is `EpisodeBuilder`'s: an observation is
    what arrived since the previous action, a result marks the call it answers. `_speedups.c` is
    this function compiled; change both together.
    """
    observations: list[str] = []
    actions: list[str] = []
    kinds: list[str] = []
    tool_names: list[str | None] = []
    tool_args: list[str | None] = []
    is_error: list[bool] = []
    infos: list[dict | None] = []
    pending: list[str] = []
    open_calls: dict[str, int] = {}  # call id -> its step, until its result arrives
    system: list[str] = []
    first_user: str | None = None
    for message in messages:
        if type(message) is not dict or not EXTRAS.isdisjoint(message):
            return None
        role, text = message.get("role"), message.get("content")
        if text is None:
            text = ""
        elif type(text) is not str:
            return None
        if role == "assistant":
            tool_calls = message.get("tool_calls")
            if not tool_calls:  # `message.get("tool_calls") or []`: any falsy value means none
                if text.startswith('{"name":'):  # parse_action might call it a tool call: the adapter decides
                    return None
                if text:
                    observations.append("\n".join(filter(None, pending)))
                    pending = []
                    actions.append(text)
                    kinds.append(MESSAGE)
                    tool_names.append(None)
                    tool_args.append(None)
                    is_error.append(False)
                    infos.append(None)
                continue
            if type(tool_calls) is not list:
                return None
            for k, call in enumerate(tool_calls):
                if type(call) is not dict:
                    return None
                function, call_id = call.get("function"), call.get("id")
                if type(function) is not dict or type(call_id) is not str or call_id in open_calls:
                    return None
                name, arguments = function.get("name"), function.get("arguments")
                by_arguments = calls.get(name) if type(name) is str and type(arguments) is str else None
                canonical = by_arguments.get(arguments) if by_arguments is not None else None
                if canonical is None and (canonical := _canonical_call(name, arguments, calls)) is None:
                    return None
                open_calls[call_id] = len(actions)
                observations.append("\n".join(filter(None, pending)))
                pending = []
                actions.append(canonical[0])
                kinds.append(TOOL_CALL)
                tool_names.append(name)
                tool_args.append(canonical[1])
                is_error.append(False)
                infos.append({"assistant_text": text} if text and k == 0 else None)
        elif role == "user":
            first_user = text if first_user is None else first_user
            pending.append(text)
        elif role == "tool" or role == "function":
            call_id = message.get("tool_call_id")
            index = open_calls.pop(call_id, None) if type(call_id) is str else None
            if index is None:
                return None
            is_error[index] = looks_like_error(text)  # its only result: the call left open_calls
            pending.append(text)
        elif role == "system" or role == "developer":
            system.append(text)
        else:
            return None
    return observations, actions, kinds, tool_names, tool_args, is_error, infos, pending, system, first_user


def _canonical_call(name: Any, arguments: Any, calls: dict) -> tuple[str, str] | None:
    """(canonical action, sorted-key arguments JSON) of a call, memoised by name and arguments string."""
    cacheable = type(name) is str and type(arguments) is str
    if cacheable and arguments in calls.get(name, ()):
        return calls[name][arguments]
    try:
        action = tool_call_text(name, arguments)
    except ActionError:
        return None
    # tool_call_text writes `{"name":<name>,"arguments":<sorted args>}`: the arguments are its tail.
    canonical = (action, action[len('{"name":') + len(orjson.dumps(name).decode()) + len(',"arguments":'):-1])
    if cacheable:
        by_arguments = calls.setdefault(name, {})
        if len(by_arguments) >= MAX_CACHED_CALLS:
            by_arguments.clear()
        by_arguments[arguments] = canonical
    return canonical


try:  # the compiled walk, built at install time where a C compiler was there (see setup.py)
    from offline_agent import _speedups
except ImportError:
    walk = walk_messages
else:
    _speedups.configure(_canonical_call, looks_like_error, TOOL_CALL, MESSAGE)
    walk = _speedups.walk
