"""Ingesting one large JSONL file with several worker processes.

Parsing and adapting records is pure-Python work bound to one core, so a large
JSONL file is cut into byte ranges at line boundaries, each range is turned
into an Arrow row group by a worker process, and the main process writes the
groups in file order. Line numbers are counted up front, so locations and the
episode ids derived from them are identical to a single-process ingest. At
most two ranges per worker are in flight, which bounds memory.
"""

from __future__ import annotations

import ctypes
import hashlib
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
BLOCK_BYTES = 4 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
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


def plan_chunks(path: Path, chunk_bytes: int | None = None) -> list[Chunk]:
    """Byte ranges of about `chunk_bytes`, each starting at a line start, with that line's number."""
    return scan(path, chunk_bytes)[1]


def scan(path: Path, chunk_bytes: int | None = None) -> tuple[str, list[Chunk]]:
    """(sha256, chunks) of a file in one read: a range ends after the first newline at or past its size."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES  # read at call time, so tests can make chunks small
    digest = hashlib.sha256()
    chunks: list[Chunk] = []
    start, lineno = 0, 1
    offset, newlines_before = 0, 0  # of the current block
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            digest.update(block)
            cut = block.find(b"\n", max(0, start + chunk_bytes - offset))
            while cut >= 0:
                end = offset + cut + 1
                chunks.append(Chunk(start, end, lineno))
                start, lineno = end, newlines_before + block.count(b"\n", 0, cut + 1) + 1
                cut = block.find(b"\n", max(cut + 1, start + chunk_bytes - offset))
            offset += len(block)
            newlines_before += block.count(b"\n")
    if start < offset:
        chunks.append(Chunk(start, offset, lineno))
    return digest.hexdigest(), chunks


def process_chunk(
    path: Path, chunk: Chunk, fmt: str, opts: SourceOptions, settings: RowSettings, fast: bool = True
) -> ChunkResult:
    """Worker side: one byte range through the adapter into a row group (duplicates within it dropped)."""
    from offline_agent.ingest.registry import FAST_FORMATS, FORMATS

    adapter = FAST_FORMATS.get(fmt, FORMATS[fmt]) if fast else FORMATS[fmt]
    rows = EpisodeRows(settings)
    quarantined: list[Quarantined] = []
    seen: set[str] = set()
    read = duplicates = 0
    for item in adapter(read_jsonl_range(path, chunk.start, chunk.end, chunk.first_lineno), opts):
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


def start_pool(workers: int) -> ProcessPoolExecutor:
    """Worker processes, started now so that they import while this process is still reading the file."""
    # spawn, not fork: the parent may hold Arrow/DuckDB thread pools, which do not survive a fork.
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_warm_up
    )
    for _ in range(workers):  # processes start on demand: ask for all of them now
        pool.submit(int)
    return pool


def _warm_up() -> None:
    """Worker start: imports, once, and a malloc setting for a process that does nothing but this."""
    _keep_freed_memory()
    import offline_agent.ingest.registry  # noqa: F401  (the adapters and pyarrow, imported once per worker)


def _keep_freed_memory(limit: int = 256 << 20) -> None:
    """Have glibc's malloc keep up to `limit` bytes of freed memory instead of handing it back to the kernel.

    Each chunk allocates and frees a few hundred MB of small objects and Arrow buffers; by default big blocks
    are mmap-ed and munmap-ed every time, and the page faults of mapping them anew were 15% of a worker's
    CPU time (0.77 of 5.5 s on the 1M-step benchmark; 0.37 s with this). Not glibc: nothing to do.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_TRIM_THRESHOLD, limit)
        libc.mallopt(M_MMAP_THRESHOLD, limit)
    except (OSError, AttributeError):
        pass


def parallel_chunks(
    pool: ProcessPoolExecutor, workers: int, path: Path, chunks: list[Chunk], fmt: str, opts: SourceOptions,
    settings: RowSettings, fast: bool = True,
) -> Iterator[ChunkResult]:
    """Chunk results in file order, computed by the pool's `workers` processes, two chunks each in flight."""
    in_flight: list[Future[ChunkResult]] = []
    queue = iter(chunks)
    for chunk in queue:
        in_flight.append(pool.submit(process_chunk, path, chunk, fmt, opts, settings, fast))
        if len(in_flight) >= 2 * workers:
            break
    while in_flight:
        result = in_flight.pop(0).result()
        next_chunk = next(queue, None)
        if next_chunk is not None:
            in_flight.append(pool.submit(process_chunk, path, next_chunk, fmt, opts, settings, fast))
        yield result
