"""Small builders for tests: log records (real formats, written by hand), and a real local Ray."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


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


def ray_folder() -> str:
    """A new folder for a Ray session's files: short, under /tmp (Ray's socket paths must stay under 108
    characters, which pytest's tmp paths can exceed). The caller removes it."""
    return tempfile.mkdtemp(prefix="ray", dir="/tmp")


def start_test_ray(folder: str, **options: Any) -> Any:
    """The `ray` module, with a real local Ray of 2 CPUs and a 200 MB object store started, its session files
    in `folder`; token auth and usage stats off, so that nothing is written to ~/.ray or sent anywhere.
    `options` go to `ray.init` (`address="local"` for a Ray of its own beside another, a `runtime_env`)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=folder, object_store_memory=200 << 20,
             configure_logging=False, **options)
    return ray
