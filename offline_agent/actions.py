"""Canonical action text: the one way a tool call or a message becomes a string.

Everything that compares, counts or embeds actions (ingestion, the simulators'
candidate lists, the learner's action vocabulary, the safety filter) goes
through `canonical_action`, so that the same call written two ways by two
logging stacks (arguments as a dict or as a JSON string, keys in any order)
is one action.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

#: The kinds of action a step can hold (the `action_kind` column).
TOOL_CALL = "tool_call"
MESSAGE = "message"
FINAL = "final"
ACTION_KINDS = (TOOL_CALL, MESSAGE, FINAL)


class ActionError(ValueError):
    """An action that cannot be turned into canonical text (the message says why)."""


@dataclass(frozen=True)
class ParsedAction:
    """What a canonical action text holds: its kind, and for a tool call its name and arguments."""

    kind: str
    tool_name: str | None
    tool_args: dict[str, Any] | None


def parse_arguments(arguments: Any) -> dict[str, Any]:
    """Tool-call arguments as a dict: accepts a dict, a JSON object string, or None/"" (no arguments)."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError as exc:
            raise ActionError(f"tool-call arguments are not valid JSON ({exc}): {arguments[:120]!r}") from None
        if not isinstance(parsed, dict):
            raise ActionError(f"tool-call arguments must be a JSON object, got {type(parsed).__name__}")
        return parsed
    raise ActionError(f"tool-call arguments must be a dict or a JSON string, got {type(arguments).__name__}")


def tool_call_text(name: str, arguments: Any = None) -> str:
    """Canonical text of a tool call: `{"name": ..., "arguments": {...sorted keys...}}`, compact JSON."""
    if not isinstance(name, str) or not name:
        raise ActionError(f"a tool call needs a non-empty string name, got {name!r}")
    # OPT_SORT_KEYS sorts nested objects too; the envelope is assembled by hand so that
    # "name" comes before "arguments", which reads better in logs, prompts and embeddings.
    args = orjson.dumps(parse_arguments(arguments), option=orjson.OPT_SORT_KEYS).decode()
    return '{"name":' + orjson.dumps(name).decode() + ',"arguments":' + args + "}"


def canonical_action(action: Any) -> str:
    """The canonical text of an action.

    - a string is a message (or a raw command, as InterCode logs them) and is kept as it is;
    - a dict `{"name": str, "arguments": dict | str}` is a tool call;
    - an OpenAI tool call `{"type": "function", "function": {"name", "arguments"}}` is a tool call;
    - an Anthropic `tool_use` block `{"type": "tool_use", "name", "input"}` is a tool call.
    """
    if isinstance(action, str):
        return action
    if isinstance(action, dict):
        if "function" in action and isinstance(action["function"], dict):
            fn = action["function"]
            return tool_call_text(fn.get("name"), fn.get("arguments"))
        if action.get("type") == "tool_use":
            return tool_call_text(action.get("name"), action.get("input"))
        if "name" in action:
            return tool_call_text(action["name"], action.get("arguments", action.get("input")))
    raise ActionError(
        f"an action must be a string or a tool call {{'name': ..., 'arguments': {{...}}}}, got {action!r:.120}"
    )


def parse_action(text: str) -> ParsedAction:
    """Inverse of `canonical_action` as far as the kind goes: a tool call's name and arguments, else a message."""
    if text.startswith('{"name":'):
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            return ParsedAction(MESSAGE, None, None)
        if isinstance(value, dict) and set(value) == {"name", "arguments"} and isinstance(value["arguments"], dict):
            return ParsedAction(TOOL_CALL, value["name"], value["arguments"])
    return ParsedAction(MESSAGE, None, None)
