"""Small builders of log records for tests (real formats, written by hand)."""

from __future__ import annotations

import json
from pathlib import Path


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def chat_record(reward: float | None = 1.0, n_calls: int = 2, call_id: str | None = None, **extra) -> dict:
    """A user request, `n_calls` tool calls each answered, then a final assistant message."""
    messages = [{"role": "system", "content": "You are a helpful agent."}, {"role": "user", "content": "fix it"}]
    for i in range(n_calls):
        cid = call_id or f"c{i}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [call(cid, "retry", {"stage": i})]})
        messages.append({"role": "tool", "tool_call_id": cid, "name": "retry", "content": f"result {i}"})
    messages.append({"role": "assistant", "content": "done"})
    record = {"messages": messages, **extra}
    if reward is not None:
        record["reward"] = reward
    return record


def chat_lines_with_faults(n: int = 120) -> list[str]:
    """`n` chat records as JSONL lines, with a broken line every 37 and a record of episode id "dup" every 50:
    quarantined lines and duplicates that land in several byte ranges of a parallel ingest."""
    lines = []
    for i in range(n):
        lines.append(json.dumps(chat_record(reward=float(i % 2), n_calls=1 + i % 4)))
        if i % 37 == 5:
            lines.append("{broken")
        if i % 50 == 7:
            lines.append(json.dumps(chat_record(episode_id="dup")))
    return lines


def write_jsonl(path: Path, records: list) -> Path:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path
