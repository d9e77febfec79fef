"""What an adapter is told about the source it reads: field mapping and how to name episodes."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from offline_agent.errors import UserError
from offline_agent.ingest.builder import RecordError


@dataclass(frozen=True)
class SourceOptions:
    """`mapping` holds the `--map NAME=FIELD` pairs (dotted paths into the record)."""

    source: str
    stem: str
    sha256: str
    mapping: dict[str, str] = field(default_factory=dict)

    def lookup(self, record: dict, name: str, defaults: tuple[str, ...], required: bool = False) -> Any:
        """The value of a logical field: the `--map`ped path if given, else the first default present."""
        paths = (self.mapping[name],) if name in self.mapping else defaults
        for path in paths:
            value = path_value(record, path)
            if value is not MISSING:
                return value
        if required:
            tried = " or ".join(repr(p) for p in paths)
            hint = f"; name the field with --map {name}=FIELD" if name not in self.mapping else ""
            raise RecordError(f"missing field {tried}{hint}")
        return None

    def episode_id(self, record: Any, location: str) -> str:
        """The record's own id (`--map episode_id=FIELD`, or an `episode_id` field) or one derived from
        the source's content hash and the record's place in it, which is stable across re-ingests."""
        if isinstance(record, dict):
            own = self.lookup(record, "episode_id", ("episode_id",))
            if isinstance(own, str | int) and not isinstance(own, bool):
                return str(own)
        place = re.sub(r"[^0-9A-Za-z]+", "", location.replace("line", "l").replace("index", "i").replace("key", "k"))
        return f"{self.stem}-{self.sha256[:8]}-{place}"


def parse_mapping(pairs: list[str]) -> dict[str, str]:
    mapping = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--map expects NAME=FIELD (e.g. --map messages=traj), got {pair!r}")
        mapping[name.strip()] = path.strip()
    return mapping


def require_dict(value: Any) -> dict:
    if not isinstance(value, dict):
        raise RecordError(f"a record must be a JSON object, got {type(value).__name__}")
    return value


def require_list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise RecordError(f"field {what!r} must be a list, got {type(value).__name__}")
    return value


def other_fields(record: dict, used: tuple[str, ...]) -> dict[str, Any]:
    """The record's fields that no column holds, kept as episode metadata so nothing is dropped."""
    top = _top_level(used)
    return {k: v for k, v in record.items() if k not in top}


@functools.lru_cache(maxsize=64)
def _top_level(used: tuple[str, ...]) -> frozenset[str]:
    return frozenset(u.split(".")[0] for u in used)


MISSING = object()


def path_value(record: Any, dotted: str) -> Any:
    """`get_path(record, dotted)`, or MISSING where a part is missing (no exception: this runs per record)."""
    if "." not in dotted:
        return record.get(dotted, MISSING) if isinstance(record, dict) else MISSING
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value
