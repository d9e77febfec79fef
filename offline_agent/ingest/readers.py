"""Reading raw records out of log files, one at a time, without ever raising on bad bytes.

A JSONL file is streamed line by line (memory stays flat however long it is).
A JSON file (an array of records, or an object keyed by record id, as InterCode
writes them) is parsed whole, since JSON has no record boundaries to stream on.
Anything unreadable comes out as a `Quarantined` item with its location and raw
text instead of an exception, so the caller can count it and go on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from offline_agent.schema import Quarantined

#: Raw text kept in the quarantine is capped so one huge broken line cannot blow up the table.
MAX_RAW_CHARS = 1_000_000


@dataclass(slots=True)  # not frozen: a frozen dataclass costs 3x as much to create, once per record
class Record:
    """One raw record: where it was (`line 12`, `index 3`, `key "17"`) and its parsed JSON value."""

    location: str
    value: Any
    raw: bytes | None = None

    def raw_text(self) -> str:
        if self.raw is not None:
            return _text(self.raw)  # a JSONL line still has its newline: _text strips it
        return orjson.dumps(self.value, option=orjson.OPT_NON_STR_KEYS).decode()[:MAX_RAW_CHARS]


def _text(raw: bytes) -> str:
    return raw[:MAX_RAW_CHARS].rstrip(b"\r\n").decode("utf-8", errors="replace")


def sniff_layout(path: Path) -> str:
    """`jsonl` or `json`: JSONL when the first non-blank line is a complete JSON value on its own."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                stripped = line.strip()
                if stripped.startswith(b"["):
                    return "json"
                try:
                    first = orjson.loads(stripped)
                except orjson.JSONDecodeError:
                    return "json"
                # A single-line file holding one object whose values are all records (a keyed JSON
                # document written on one line) is a JSON document, not a one-record JSONL file.
                if _is_keyed_collection(first) and not any(rest.strip() for rest in f):
                    return "json"
                return "jsonl"
    return "jsonl"


def read_records(path: Path) -> Iterator[Record | Quarantined]:
    """Every record of a file, as `Record`, or `Quarantined` for what cannot be parsed."""
    if path.stat().st_size == 0:
        yield Quarantined("file", "empty file: no records to read", "")
        return
    if sniff_layout(path) == "jsonl":
        yield from _read_jsonl(path)
    else:
        yield from _read_json_document(path)


def _read_jsonl(path: Path) -> Iterator[Record | Quarantined]:
    saw_any = False
    for item in read_jsonl_range(path, 0, None, 1):
        saw_any = True
        yield item
    if not saw_any:
        yield Quarantined("file", "empty file: only blank lines", "")


def read_jsonl_range(path: Path, start: int, end: int | None, first_lineno: int) -> Iterator[Record | Quarantined]:
    """Records of the lines in bytes [start, end) of a JSONL file (`end` None: to the end of the file).

    `start` must be the first byte of a line and `first_lineno` its 1-based number, so that
    locations (and the episode ids derived from them) are the same however a file is split.
    """
    with open(path, "rb") as f:
        f.seek(start)
        position = start
        for lineno, line in enumerate(f, start=first_lineno):
            if end is not None and position >= end:
                break
            position += len(line)
            try:  # line_item's first step, inline: most lines parse
                value = orjson.loads(line)
            except orjson.JSONDecodeError:
                item = line_item(lineno, line)
                if item is not None:
                    yield item
                continue
            yield Record(f"line {lineno}", value, line)


def line_item(lineno: int, line: bytes) -> Record | Quarantined | None:
    """The record on one JSONL line (with its newline, if it had one), its quarantine entry, or None if blank."""
    try:
        # orjson checks UTF-8 itself: a line is decoded separately only to say why it failed.
        return Record(f"line {lineno}", orjson.loads(line), line)
    except orjson.JSONDecodeError as exc:
        error = exc
    if not line.strip():
        return None
    location = f"line {lineno}"
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Quarantined(
            location, f"bytes that are not UTF-8 at byte {exc.start}: re-encode the file as UTF-8", _text(line)
        )
    truncated = not line.endswith(b"\n")
    reason = (
        f"truncated JSON on the last line ({error}): the file was cut off while being written"
        if truncated
        else f"malformed JSON ({error}): fix or remove this line"
    )
    return Quarantined(location, reason, _text(line))


def _read_json_document(path: Path) -> Iterator[Record | Quarantined]:
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield Quarantined("file", f"bytes that are not UTF-8 at byte {exc.start}: re-encode as UTF-8", _text(data))
        return
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        yield Quarantined(
            "file", f"invalid or truncated JSON document ({exc}): the file may have been cut off", _text(data)
        )
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield Record(f"index {i}", item)
    elif _is_keyed_collection(value):
        for key, item in value.items():
            yield Record(f"key {key!r}", item)
    else:
        yield Record("document", value)


def _is_keyed_collection(value: Any) -> bool:
    """An object keyed by record id ({"0": {...}, "1": {...}}), as opposed to one record."""
    if not isinstance(value, dict) or not value or not all(isinstance(v, dict) for v in value.values()):
        return False
    return not any(k in value for k in ("messages", "traj", "turn_history", "episode_id", "actions", "info"))
