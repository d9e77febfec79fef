"""Which adapter reads a file: the built-in formats, detection from content, and user adapters.

A format is a function from a source's raw items to episodes and quarantined
records. Built-in per-record formats wrap a `Record -> Episode` function; a
user adapter (`--format my.module:function`) is called as
`function(path: pathlib.Path, options: dict[str, str])` and yields
`offline_agent.schema.Episode` (or `Quarantined`) objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from offline_agent.actions import ActionError
from offline_agent.errors import UserError
from offline_agent.ingest import anthropic, openai_chat, parallel_lists, steps_jsonl
from offline_agent.ingest.builder import RecordError
from offline_agent.ingest.options import SourceOptions
from offline_agent.ingest.readers import Record, read_records
from offline_agent.plugins import load_user_function
from offline_agent.schema import ColumnarEpisode, Episode, Quarantined, Step

Adapter = Callable[[Iterable[Record | Quarantined], SourceOptions], Iterator[Episode | Quarantined]]


def per_record(adapt_record: Callable[[Record, SourceOptions], Episode]) -> Adapter:
    def adapt(items: Iterable[Record | Quarantined], opts: SourceOptions) -> Iterator[Episode | Quarantined]:
        for item in items:
            if isinstance(item, Quarantined):
                yield item
                continue
            try:
                yield adapt_record(item, opts)
            except (RecordError, ActionError) as exc:
                yield Quarantined(item.location, str(exc), item.raw_text())

    return adapt


FORMATS: dict[str, Adapter] = {
    "openai-chat": per_record(openai_chat.adapt_record),
    "anthropic": per_record(anthropic.adapt_record),
    "parallel-lists": per_record(parallel_lists.adapt_record),
    "steps-jsonl": steps_jsonl.adapt_stream,
}

def per_record_fast(
    build: Callable[[Record, SourceOptions, dict], ColumnarEpisode | None],
    adapt_record: Callable[[Record, SourceOptions], Episode],
) -> Adapter:
    """`per_record(adapt_record)`, except that records `build` can lay out in columns skip the adapter.

    `build(record, options, cache)` returns None for a record it does not vouch for; `cache` is its
    own memo (of what does not depend on the source), kept for the life of the process: a worker
    process reads many ranges, and starting each with an empty memo cost 5% of its time.
    """
    reference = per_record(adapt_record)
    cache: dict = {}

    def adapt(
        items: Iterable[Record | Quarantined], opts: SourceOptions
    ) -> Iterator[Episode | ColumnarEpisode | Quarantined]:
        for item in items:
            episode = None if isinstance(item, Quarantined) else build(item, opts, cache)
            if episode is None:
                yield from reference([item], opts)
            else:
                yield episode

    return adapt


#: Faster adapters with the same output, used by `ingest` unless it is asked for `engine="python"`.
FAST_FORMATS: dict[str, Adapter] = {"openai-chat": per_record_fast(openai_chat.plain_episode, openai_chat.adapt_record)}


UNREADABLE = "unreadable"


def detect_format(path: Path, mapping: dict[str, str]) -> str:
    """Guess the format from the first readable records; a clear error when they do not tell."""
    seen = 0
    readable = False
    for item in read_records(path):
        if isinstance(item, Quarantined):
            continue
        readable = True
        guess = _guess(item.value, mapping)
        if guess:
            return guess
        seen += 1
        if seen >= 20:
            break
    if not readable:
        # Nothing parses: any per-record adapter will pass the reader's quarantine rows through.
        return UNREADABLE
    raise UserError(
        f"cannot tell the log format of {path}: pass --format with one of {', '.join(FORMATS)} "
        "or my.module:function (and --map NAME=FIELD for renamed fields)"
    )


def _guess(record: object, mapping: dict[str, str]) -> str | None:
    if not isinstance(record, dict):
        return None
    messages = record.get(mapping.get("messages", "messages"), record.get("traj"))
    if isinstance(messages, list) and messages:
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result") for b in content
            ):
                return "anthropic"
            if isinstance(message, dict) and (message.get("role") == "tool" or "tool_calls" in message):
                return "openai-chat"
        if all(isinstance(m, dict) and m.get("role") in ("user", "assistant") for m in messages):
            return "anthropic" if "system" in record else "openai-chat"
        return "openai-chat"
    if "turn_history" in record or (isinstance(record.get("actions"), list) and "observations" in record):
        return "parallel-lists"
    if all(k in record for k in ("episode_id", "step", "action")):
        return "steps-jsonl"
    return None


def resolve_adapter(fmt: str, path: Path, mapping: dict[str, str]) -> tuple[str, Adapter | None]:
    """(format name, adapter); the adapter is None for a user adapter, which reads its path itself."""
    if fmt == "auto":
        fmt = detect_format(path, mapping)
    if fmt == UNREADABLE:
        return fmt, FORMATS["openai-chat"]
    if fmt in FORMATS:
        return fmt, FORMATS[fmt]
    if ":" in fmt:
        load_user_adapter(fmt)
        return fmt, None
    raise UserError(f"unknown --format {fmt!r}: use auto, {', '.join(FORMATS)}, or my.module:function")


def load_user_adapter(spec: str) -> Callable[[Path, dict[str, str]], Iterable[Episode | Quarantined]]:
    module_name, _, attr = spec.partition(":")
    return load_user_function(module_name, attr, f"adapter {spec!r}")


def user_adapter_items(spec: str, path: Path, opts: SourceOptions) -> Iterator[Episode | Quarantined]:
    """Run a user adapter, checking each item it yields, so its mistakes get a message, not a traceback."""
    fn = load_user_adapter(spec)
    count = 0
    try:
        for item in fn(path, dict(opts.mapping)):
            count += 1
            if isinstance(item, Quarantined):
                yield item
            elif isinstance(item, Episode):
                _check_episode(item, spec, count)
                yield item
            else:
                raise UserError(
                    f"adapter {spec!r} yielded {type(item).__name__} as item {count}; "
                    "it must yield offline_agent.schema.Episode or Quarantined"
                )
    except UserError:
        raise
    except Exception as exc:  # the user's code failed: say where, keep the traceback out of the terminal
        raise UserError(f"adapter {spec!r} raised {type(exc).__name__} after {count} items on {path}: {exc}") from exc


def _check_episode(episode: Episode, spec: str, index: int) -> None:
    where = f"adapter {spec!r}, episode {index} ({episode.episode_id!r})"
    if not isinstance(episode.episode_id, str) or not episode.episode_id:
        raise UserError(f"{where}: episode_id must be a non-empty string")
    if not episode.steps or not all(isinstance(s, Step) for s in episode.steps):
        raise UserError(f"{where}: steps must be a non-empty list of offline_agent.schema.Step")
    for s in episode.steps:
        if not isinstance(s.action, str) or not isinstance(s.observation, str):
            raise UserError(f"{where}: Step.action and Step.observation must be strings (use canonical_action)")
