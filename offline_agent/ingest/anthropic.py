"""Adapter for Anthropic Messages logs: content blocks of type `text`, `tool_use` and `tool_result`.

An assistant `tool_use` block is one step; an assistant turn with only text is a
message step. `tool_result` blocks in the following user turn answer calls by
`tool_use_id`; their `is_error` flag is kept.
"""

from __future__ import annotations

from offline_agent.actions import ActionError, canonical_action
from offline_agent.ingest.builder import EpisodeBuilder, RecordError, as_float, looks_like_error, text_of
from offline_agent.ingest.openai_chat import OUTCOME, _agent
from offline_agent.ingest.options import SourceOptions, other_fields, require_dict, require_list
from offline_agent.ingest.readers import Record
from offline_agent.schema import Episode


def adapt_record(record: Record, opts: SourceOptions) -> Episode:
    r = require_dict(record.value)
    messages = require_list(opts.lookup(r, "messages", ("messages",), required=True), "messages")
    builder = EpisodeBuilder()
    first_user: str | None = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise RecordError(f"message {i} must be an object with role 'user' or 'assistant'")
        blocks = message.get("content")
        if isinstance(blocks, str) or blocks is None:
            blocks = [{"type": "text", "text": blocks or ""}]
        try:
            for block in require_list(blocks, "content"):
                if message["role"] == "user":
                    first_user = _user_block(builder, block, first_user)
                else:
                    _assistant_block(builder, block, blocks)
        except (RecordError, ActionError) as exc:
            raise RecordError(f"message {i} ({message['role']}): {exc}") from None
    task = opts.lookup(r, "task", ("task",))
    system = r.get("system")
    metadata = other_fields(r, (opts.mapping.get("messages", "messages"),))
    return Episode(
        episode_id=opts.episode_id(r, record.location),
        steps=builder.finish(),
        task=task if isinstance(task, str) else first_user,
        agent=_agent(r),
        outcome=as_float(opts.lookup(r, "reward", OUTCOME), opts.mapping.get("reward", "reward")),
        success=r.get("success") if isinstance(r.get("success"), bool) else None,
        truncated=bool(r.get("truncated", False)),
        metadata={**metadata, **({"system": text_of(system)} if system else {})},
    )


def _user_block(builder: EpisodeBuilder, block: dict, first_user: str | None) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
        text = block.get("text") or ""
        builder.observe(text)
        return text if first_user is None else first_user
    if kind == "tool_result":
        text = text_of(block.get("content"))
        flagged = block.get("is_error")
        builder.result(block.get("tool_use_id"), text, bool(flagged) if flagged is not None else looks_like_error(text))
        return first_user
    if kind in ("image", "document"):
        builder.observe(f"[{kind}]")
        return first_user
    raise RecordError(f"unsupported user content block {kind!r} (expected text or tool_result)")


def _assistant_block(builder: EpisodeBuilder, block: dict, blocks: list) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    has_tool_use = any(isinstance(b, dict) and b.get("type") == "tool_use" for b in blocks)
    if kind == "text":
        # Text beside a tool call is the model's commentary on it, not an action of its own.
        if not has_tool_use and block.get("text"):
            builder.act(block["text"])
    elif kind == "tool_use":
        text = "\n".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
        builder.act(
            canonical_action(block),
            call_id=block.get("id"),
            info={"assistant_text": text} if text else None,
            expects_result=True,
        )
    elif kind in ("thinking", "redacted_thinking"):
        return
    else:
        raise RecordError(f"unsupported assistant content block {kind!r} (expected text or tool_use)")
