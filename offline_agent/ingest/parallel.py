"""Ingesting one large JSONL file with several worker processes.

Parsing and adapting records is pure-Python work bound to one core, so a large
JSONL file is cut into byte ranges at line boundaries, each range is turned
into an Arrow row group by a worker process, and the main process writes the
groups in file order. Line numbers are counted up front, so locations and the
episode ids derived from them are identical to a single-process ingest. At
most two ranges per worker are in flight, which bounds memory.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from offline_agent.ingest.options import SourceOptions
from offline_agent.ingest.readers import read_jsonl_range
from offline_agent.ingest.writer import EpisodeRows, RowGroup, RowSettings
from offline_agent.schema import Quarantined

CHUNK_BYTES = 16 << 20
#: Below this size the start-up of worker processes costs more than it saves.
MIN_PARALLEL_BYTES = 48 << 20


def default_workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 8))


@dataclass(frozen=True)
class Chunk:
    start: int
    end: int
    first_lineno: int


@dataclass
class ChunkResult:
    group: RowGroup
    quarantined: list[Quarantined]
    records_read: int
    duplicates: int


def plan_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Byte ranges of about `chunk_bytes`, each starting at a line start, with that line's number."""
    chunks, start, lineno = [], 0, 1
    size = path.stat().st_size
    with open(path, "rb") as f:
        while start < size:
            f.seek(start + chunk_bytes)
            f.readline()  # move to the end of the line the cut fell in
            end = min(f.tell(), size) if start + chunk_bytes < size else size
            chunks.append(Chunk(start, end, lineno))
            f.seek(start)
            lineno += f.read(end - start).count(b"\n")
            start = end
    return chunks


def process_chunk(path: Path, chunk: Chunk, fmt: str, opts: SourceOptions, settings: RowSettings) -> ChunkResult:
    """Worker side: one byte range through the adapter into a row group (duplicates within it dropped)."""
    from offline_agent.ingest.registry import FORMATS

    rows = EpisodeRows(settings)
    quarantined: list[Quarantined] = []
    seen: set[str] = set()
    read = duplicates = 0
    for item in FORMATS[fmt](read_jsonl_range(path, chunk.start, chunk.end, chunk.first_lineno), opts):
        if isinstance(item, Quarantined):
            read += 1
            quarantined.append(item)
            continue
        read += item.records
        if item.episode_id in seen:
            duplicates += item.records
        else:
            seen.add(item.episode_id)
            rows.add(item, opts.source)
    return ChunkResult(rows.build(), quarantined, read, duplicates)


def parallel_chunks(
    path: Path, fmt: str, opts: SourceOptions, settings: RowSettings, workers: int
) -> Iterator[ChunkResult]:
    """Chunk results in file order, computed by `workers` processes."""
    chunks = plan_chunks(path)
    # spawn, not fork: the parent may hold Arrow/DuckDB thread pools, which do not survive a fork.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        in_flight: list[Future[ChunkResult]] = []
        queue = iter(chunks)
        for chunk in queue:
            in_flight.append(pool.submit(process_chunk, path, chunk, fmt, opts, settings))
            if len(in_flight) >= 2 * workers:
                break
        while in_flight:
            result = in_flight.pop(0).result()
            next_chunk = next(queue, None)
            if next_chunk is not None:
                in_flight.append(pool.submit(process_chunk, path, next_chunk, fmt, opts, settings))
            yield result
