"""Ingesting JSONL files with several worker processes (or Ray tasks, see `ray_ingest`).

Parsing and adapting records is pure-Python work bound to one core, so a large
JSONL file is cut into byte ranges at line boundaries, and each worker turns a
range into its own pair of Parquet part files (steps and episodes) in the
dataset's temporary folder, named so that the parts sort in file order. The
main process gets back only ids, digests and counts: shipping Arrow tables back
to be written by one process cost more CPU than the writing itself. Line
numbers are counted up front, so locations and the episode ids derived from
them are identical to a single-process ingest. Results are taken in file
order, ranges of later files starting while earlier ones finish; at most two
ranges per worker are in flight, which bounds memory.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import importlib.abc
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from offline_agent.ingest.options import SourceOptions
from offline_agent.ingest.readers import read_jsonl_range
from offline_agent.ingest.writer import EpisodeRows, RowSettings, write_part
from offline_agent.schema import Quarantined

CHUNK_BYTES = 16 << 20
BLOCK_BYTES = 4 << 20
HASH_BLOCKS_IN_FLIGHT = 4
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
#: Below this size the start-up of worker processes costs more than it saves.
MIN_PARALLEL_BYTES = 48 << 20

K = TypeVar("K")
R = TypeVar("R")


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
    """What a worker reports of the part it wrote (`part` None: the range held no episode)."""

    part: str | None
    episode_ids: list[str]
    digests: dict[str, str]
    n_steps: int
    quarantined: list[Quarantined]
    records_read: int
    duplicates: int


def plan_chunks(path: Path, chunk_bytes: int | None = None) -> list[Chunk]:
    """Byte ranges of about `chunk_bytes`, each starting at a line start, with that line's number."""
    return scan(path, chunk_bytes)[1]


def scan(path: Path, chunk_bytes: int | None = None) -> tuple[str, list[Chunk]]:
    """(sha256, chunks) of a file in one read: a range ends after the first newline at or past its size.

    The hash runs in a thread beside the newline count (hashlib lets go of the GIL on large blocks),
    so the pass takes as long as the slower of the two, not their sum; a few blocks are in flight.
    """
    chunk_bytes = chunk_bytes or CHUNK_BYTES  # read at call time, so tests can make chunks small
    digest = hashlib.sha256()
    chunks: list[Chunk] = []
    start, lineno = 0, 1
    offset, newlines_before = 0, 0  # of the current block
    hashing: list[Future[None]] = []
    with open(path, "rb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
        while block := f.read(BLOCK_BYTES):
            hashing.append(hasher.submit(digest.update, block))  # one thread: blocks are hashed in order
            if len(hashing) > HASH_BLOCKS_IN_FLIGHT:
                hashing.pop(0).result()
            cut = block.find(b"\n", max(0, start + chunk_bytes - offset))
            while cut >= 0:
                end = offset + cut + 1
                chunks.append(Chunk(start, end, lineno))
                start, lineno = end, newlines_before + block.count(b"\n", 0, cut + 1) + 1
                cut = block.find(b"\n", max(cut + 1, start + chunk_bytes - offset))
            offset += len(block)
            newlines_before += block.count(b"\n")
        for pending in hashing:
            pending.result()
    if start < offset:
        chunks.append(Chunk(start, offset, lineno))
    return digest.hexdigest(), chunks


def process_chunk(
    path: Path, chunk: Chunk, fmt: str, opts: SourceOptions, settings: RowSettings, folder: Path, part: str,
    fast: bool = True,
) -> ChunkResult:
    """Worker side: one byte range through the adapter into the part files `folder/{steps,episodes}/part.parquet`
    (duplicates within the range dropped)."""
    # A range allocates millions of small containers (the parsed JSON) that die young and form no cycles;
    # the cyclic collector's passes over them were 5% of a worker's CPU time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _process_chunk(path, chunk, fmt, opts, settings, folder, part, fast)
    finally:
        if collecting:
            gc.enable()


def _process_chunk(
    path: Path, chunk: Chunk, fmt: str, opts: SourceOptions, settings: RowSettings, folder: Path, part: str,
    fast: bool,
) -> ChunkResult:
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
    group = rows.build()
    if group.episodes.num_rows == 0:
        return ChunkResult(None, [], {}, 0, quarantined, read, duplicates)
    write_part(folder, part, group)
    ids = group.episodes["episode_id"].to_pylist()
    return ChunkResult(part, ids, group.digests, group.steps.num_rows, quarantined, read, duplicates)


def start_pool(workers: int) -> ProcessPoolExecutor:
    """Worker processes, started now so that they import while this process is still reading the file."""
    # spawn, not fork: the parent may hold Arrow/DuckDB thread pools, which do not survive a fork.
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_warm_up
    )
    # A worker runs one thread. OpenBLAS (numpy's) would start a thread per core in each worker at import,
    # spinning for a while: the environment a spawned process starts with is read when it is started.
    saved = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        for _ in range(workers):  # processes start on demand: ask for all of them now
            pool.submit(int)
    finally:
        if saved is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = saved
    return pool


def _warm_up() -> None:
    """Worker start: imports, once, and settings for a process that does nothing but this."""
    # pyarrow imports pandas, where installed, the first time it converts a list, only to ask whether the
    # list is a pandas object: 0.15 s of CPU per worker, whose lists never are.
    sys.meta_path.insert(0, _NoPandas())
    keep_freed_memory()
    import offline_agent.ingest.registry  # noqa: F401  (the adapters and pyarrow, imported once per worker)


class _NoPandas(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 (the finder protocol)
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError("pandas is not imported in ingest workers")
        return None


def keep_freed_memory(limit: int = 256 << 20) -> None:
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


def in_order(
    submit: Callable[..., Future[R]], window: int, jobs: Iterable[tuple[K, tuple | None]]
) -> Iterator[tuple[K, R | None]]:
    """(key, result) of each job in the order given, with up to `window` jobs started ahead of the one taken.

    A job is (key, call): `submit(*call)` starts the call on a pool (`Executor.submit` or `RayPool.submit`);
    a job whose call is None is work the caller does itself when its turn comes (result None). Jobs are
    drawn lazily, so whatever plans them (hashing the next file) runs while the pool works on earlier ones.
    """
    pending: deque[tuple[K, Future[R] | None]] = deque()
    jobs = iter(jobs)

    def fill() -> None:
        while len(pending) < window and (job := next(jobs, None)) is not None:
            key, call = job
            pending.append((key, None if call is None else submit(*call)))

    fill()
    while pending:
        key, future = pending.popleft()
        result = None if future is None else future.result()
        fill()
        yield key, result
