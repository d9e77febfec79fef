"""Ingestion: log files in any supported format -> one Parquet trajectory dataset, losing nothing.

`ingest` reads each source record by record through its adapter, streams
episodes into Parquet row groups, and sends every record that cannot be read
to the quarantine with its location and reason. The summary reconciles:
records read = records in the dataset + quarantined + skipped as duplicates.
The dataset appears in one rename at the end (see `atomic_dataset_dir`).
JSONL files in a built-in format may be cut into byte ranges read by worker
processes (`parallel`) or Ray tasks (`ray_ingest`); the dataset is the same.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from offline_agent import __version__
from offline_agent.dataset import (
    DEFAULT_SPLIT,
    TrajectoryDataset,
    atomic_dataset_dir,
    combine_digests,
    file_sha256,
    write_catalog,
    write_meta,
)
from offline_agent.errors import UserError
from offline_agent.ingest.options import SourceOptions
from offline_agent.ingest.parallel import (
    MIN_PARALLEL_BYTES,
    Chunk,
    ChunkResult,
    default_workers,
    in_order,
    process_chunk,
    scan,
    start_pool,
)
from offline_agent.ingest.readers import read_records, sniff_layout
from offline_agent.ingest.registry import FAST_FORMATS, FORMATS, Adapter, resolve_adapter, user_adapter_items
from offline_agent.ingest.writer import (
    REWARD_MODES,
    ROWS_PER_GROUP,
    EpisodeRows,
    RowSettings,
    StreamingWriter,
    drop_from_part,
    quarantine_table,
    string_array,
)
from offline_agent.ray_backend import check_backend, require_ray
from offline_agent.schema import QUARANTINE_SCHEMA, SCHEMA_VERSION, Episode, Quarantined

LOG_SUFFIXES = (".jsonl", ".json", ".ndjson")
ENGINES = ("auto", "python")


@dataclass
class SourceSummary:
    path: str
    sha256: str
    format: str
    records_read: int = 0
    records_ingested: int = 0
    episodes: int = 0
    steps: int = 0
    quarantined: int = 0
    duplicates: int = 0
    skipped: str | None = None

    @property
    def reconciles(self) -> bool:
        return self.records_read == self.records_ingested + self.quarantined + self.duplicates


@dataclass
class IngestSummary:
    dataset: str
    sources: list[SourceSummary] = field(default_factory=list)
    quarantine_examples: list[dict[str, str]] = field(default_factory=list)

    def total(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.sources)

    @property
    def reconciles(self) -> bool:
        return all(s.reconciles for s in self.sources)


def expand_sources(paths: list[str | Path]) -> list[Path]:
    """Files named directly, and log files (.jsonl/.json/.ndjson) found under folders, in a stable order."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in LOG_SUFFIXES)
            if not found:
                raise UserError(f"no log files ({', '.join(LOG_SUFFIXES)}) under folder {p}")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"no such file or folder: {p}")
    return files


def ingest(
    paths: list[str | Path],
    out: str | Path,
    fmt: str = "auto",
    mapping: dict[str, str] | None = None,
    reward: str = "outcome",
    gamma: float = 0.99,
    success_threshold: float = 1.0,
    split: dict[str, float] | None = None,
    strict: bool = False,
    append: bool = False,
    overwrite: bool = False,
    name: str | None = None,
    progress: bool = False,
    workers: int | None = None,
    engine: str = "auto",
    backend: str = "local",
    ray_address: str | None = None,
) -> IngestSummary:
    """Ingest log files into the dataset at `out` (see the module docstring); returns the reconciled summary.

    `engine`: "auto" takes the fast adapter where a format has one (OpenAI chat: plain records
    straight into columns); "python" takes the reference adapters only. Both give the same dataset.
    `backend`: "local" reads JSONL files of at least MIN_PARALLEL_BYTES with `workers` processes (default:
    one per core, at most 8) and smaller files in this process; "ray" reads every JSONL file in a built-in
    format other than steps-jsonl as Ray tasks on every CPU of the Ray at `ray_address` (see
    `offline_agent.ray_backend`: None starts a local one), whatever its size. Both give the same dataset.
    """
    if check_backend(backend) == "ray":
        require_ray()  # before any work: without Ray, one line saying how to install it
    if engine not in ENGINES:
        raise UserError(f"unknown --engine {engine!r}: use one of {', '.join(ENGINES)}")
    if reward not in REWARD_MODES:
        raise UserError(f"unknown --reward {reward!r}: use one of {', '.join(REWARD_MODES)}")
    if not 0.0 <= gamma <= 1.0:
        raise UserError(f"--gamma must be in [0, 1], got {gamma}")
    out = Path(out)
    files = expand_sources(paths)
    mapping = mapping or {}
    previous = TrajectoryDataset.open(out) if append and out.exists() else None
    if previous is not None:
        _check_append_settings(previous, reward, gamma)
        split = previous.meta["split"]
    split = split or DEFAULT_SPLIT
    summary = IngestSummary(dataset=str(out))
    with atomic_dataset_dir(out, overwrite=overwrite or previous is not None) as tmp:
        known_ids, known_digests, known_sha, part = _carry_over(previous, tmp)
        writer = StreamingWriter(tmp, f"part-{part:05d}")
        settings = RowSettings(reward, gamma, split, success_threshold)
        quarantined: list[tuple[str, Quarantined]] = []
        run = _SourceRun(
            writer, settings, known_ids, known_sha, quarantined, workers or default_workers(), engine == "auto",
            backend, ray_address,
        )
        try:
            with _progress(progress) as bar:
                summary.sources.extend(run.ingest(files, fmt, mapping, bar))
        except BaseException:
            run.close(wait=True)  # no worker may still be writing when the temporary folder is removed
            raise
        run.close(wait=False)
        writer.close()
        if strict and quarantined:
            first = "; ".join(f"{s} {q.location}: {q.reason}" for s, q in quarantined[:3])
            raise UserError(f"--strict: {len(quarantined)} record(s) could not be read, nothing was written. {first}")
        _write_quarantine(tmp, previous, quarantined)
        summary.quarantine_examples = [
            {"source": s, "location": q.location, "reason": q.reason} for s, q in quarantined[:5]
        ]
        meta = _meta(out, name, previous, summary, reward, gamma, success_threshold, split, mapping)
        meta["counts"] = {
            "episodes": len(known_digests) + writer.n_episodes,
            "steps": (previous.meta["counts"]["steps"] if previous else 0) + writer.n_steps,
            "quarantined": (previous.meta["counts"]["quarantined"] if previous else 0) + len(quarantined),
        }
        digests = {**known_digests, **writer.digests}
        meta["fingerprint"] = combine_digests(digests)
        meta["episode_digests_file"] = "digests.parquet"
        columns = [string_array(list(digests)), string_array(list(digests.values()))]
        pq.write_table(pa.Table.from_arrays(columns, names=["episode_id", "digest"]), tmp / "digests.parquet")
        write_meta(tmp, meta)
    write_catalog(out)
    return summary


def _check_append_settings(previous: TrajectoryDataset, reward: str, gamma: float) -> None:
    old = previous.meta
    if old["reward"]["mode"] != reward or abs(old["gamma"] - gamma) > 1e-12:
        raise UserError(
            f"--append to {previous.path}: it was ingested with --reward {old['reward']['mode']} "
            f"--gamma {old['gamma']}; use the same settings (or relabel it first)"
        )


def _carry_over(previous: TrajectoryDataset | None, tmp: Path) -> tuple[set[str], dict[str, str], set[str], int]:
    """Bring an existing dataset's parts into the new folder (hard links where possible)."""
    if previous is None:
        return set(), {}, set(), 0
    parts = 0
    for table in ("steps", "episodes"):
        (tmp / table).mkdir()
        for f in sorted((previous.path / table).glob("*.parquet")):
            _link_or_copy(f, tmp / table / f.name)
            parts += table == "steps"
    digests_table = pq.read_table(previous.path / "digests.parquet")
    digests = dict(zip(digests_table["episode_id"].to_pylist(), digests_table["digest"].to_pylist(), strict=True))
    known_sha = {s["sha256"] for s in previous.meta["sources"]}
    return set(digests), digests, known_sha, parts


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@dataclass
class _Plan:
    """One source as the driver plans it: byte ranges for the workers, or (no chunks) read here."""

    path: Path
    summary: SourceSummary
    adapter_name: str
    adapter: Adapter | None
    opts: SourceOptions | None  # None: skipped
    chunks: list[Chunk]
    prefix: str = ""  # of the part files its chunks write
    task: object = None  # its progress bar line


@dataclass
class _SourceRun:
    """The state one ingest shares across its sources: the writer, what is already known, the quarantine."""

    writer: StreamingWriter
    settings: RowSettings
    known_ids: set[str]
    known_sha: set[str]
    quarantined: list[tuple[str, Quarantined]]
    workers: int
    fast: bool
    backend: str = "local"
    ray_address: str | None = None
    #: worker processes or Ray tasks (anything with `submit` and `shutdown`), started at the first source they
    #: read and shared by the rest (see `close`)
    _pool: object = None
    _parallel_sources: int = 0  # numbers the part files of each source read by the workers

    def ingest(self, files: list[Path], fmt: str, mapping: dict[str, str], bar) -> list[SourceSummary]:
        """Each source's summary, in file order.

        Sources are planned (hashed, cut into ranges) ahead, while the workers read earlier ones, but their
        results are taken strictly in file order: which copy of an episode is kept, and every count, are
        those of reading the files one after another.
        """
        if self.backend == "ray":
            self._start_pool()  # asked for Ray: started now, for its CPU count
        plans = (self._plan(path, fmt, mapping) for path in files)
        jobs = (((plan, i), call) for plan in plans for i, call in enumerate(self._calls(plan)))
        summaries = []
        for (plan, i), result in in_order(lambda *call: self._pool.submit(*call), 2 * self.workers, jobs):
            source = plan.summary
            if i == 0:
                summaries.append(source)
                if plan.opts is not None and bar:
                    plan.task = bar.add_task(f"ingest {plan.path.name}", total=None)
            if plan.opts is None:
                continue
            if result is None:
                self._ingest_sequentially(plan.path, plan.adapter_name, plan.adapter, plan.opts, source, bar,
                                          plan.task)
            else:
                self._take_chunk(result, source)
                if bar:
                    bar.update(plan.task, completed=source.records_read)
        return summaries

    def _plan(self, path: Path, fmt: str, mapping: dict[str, str]) -> _Plan:
        adapter_name, adapter = resolve_adapter(fmt, path, mapping) if path.stat().st_size else (fmt, None)
        if self.fast and adapter is not None:
            adapter = FAST_FORMATS.get(adapter_name, adapter)
        by_workers = self._read_by_workers(path, adapter_name, adapter)
        if by_workers and self._pool is None:
            self._start_pool()  # they import while this process hashes the file
        sha, chunks = scan(path) if by_workers else (file_sha256(path), [])
        plan = _Plan(path, SourceSummary(path=str(path), sha256=sha, format=adapter_name), adapter_name, adapter,
                     None, chunks)
        if sha in self.known_sha:
            plan.summary.skipped = "already ingested (same sha256)"
            plan.chunks = []
            return plan
        self.known_sha.add(sha)
        plan.opts = SourceOptions(source=str(path), stem=path.stem, sha256=sha, mapping=mapping)
        if chunks:
            self._parallel_sources += 1
            plan.prefix = f"{self.writer.part}-{self._parallel_sources:06d}"
        return plan

    def _read_by_workers(self, path: Path, adapter_name: str, adapter: Adapter | None) -> bool:
        if adapter is None or adapter_name not in FORMATS or adapter_name == "steps-jsonl":
            return False  # a user adapter reads its own file; steps-jsonl episodes span lines anywhere
        if self.backend == "local" and (self.workers <= 1 or path.stat().st_size < MIN_PARALLEL_BYTES):
            return False  # below this size, starting local processes costs more than it saves
        return sniff_layout(path) == "jsonl"

    def _calls(self, plan: _Plan) -> Iterable[tuple | None]:
        """The pool calls of a source's chunks (chunk i writes the part `{prefix}-{i:06d}`, so parts sort in
        file order), or one None: the source is read here (or skipped) when its turn comes."""
        if not plan.chunks:
            return [None]
        return (
            (process_chunk, plan.path, chunk, plan.adapter_name, plan.opts, self.settings, self.writer.folder,
             f"{plan.prefix}-{i:06d}", self.fast)
            for i, chunk in enumerate(plan.chunks)
        )

    def _start_pool(self) -> None:
        if self.backend == "ray":
            from offline_agent.ingest.ray_ingest import RayPool

            self._pool = RayPool(self.ray_address)
            self.workers = self._pool.workers
        else:
            self._pool = start_pool(self.workers)

    def close(self, wait: bool) -> None:
        """Stop the workers. After a complete run every part is written, so `wait=False` lets the idle
        workers exit on their own (the interpreter joins them at exit) while this process writes the rest."""
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None

    def _ingest_sequentially(self, path, adapter_name, adapter, opts, source, bar, task) -> None:
        rows = EpisodeRows(self.settings)
        for item in _items(path, adapter_name, adapter, opts):
            if isinstance(item, Quarantined):
                source.records_read += 1
                source.quarantined += 1
                self.quarantined.append((str(path), item))
            else:
                source.records_read += item.records
                if item.episode_id in self.known_ids:
                    source.duplicates += item.records
                else:
                    self.known_ids.add(item.episode_id)
                    rows.add(item, str(path))
                    source.records_ingested += item.records
                    source.episodes += 1
                    source.steps += item.n_steps
                    if rows.n_steps >= ROWS_PER_GROUP:
                        self.writer.write(rows.build())
            if bar and source.records_read % 1000 == 0:
                bar.update(task, completed=source.records_read)
        self.writer.write(rows.build())

    def _take_chunk(self, result: ChunkResult, source: SourceSummary) -> None:
        """Account for a part a worker wrote; episodes already known (earlier chunks, sources or the
        appended-to dataset) are taken out of it again."""
        repeated = {i for i in result.episode_ids if i in self.known_ids}
        n_steps = result.n_steps
        if repeated:
            n_steps, _ = drop_from_part(self.writer.folder, result.part, repeated)
        self.known_ids.update(result.episode_ids)
        digests = {k: v for k, v in result.digests.items() if k not in repeated}
        source.records_read += result.records_read
        source.quarantined += len(result.quarantined)
        source.duplicates += result.duplicates + len(repeated)  # per-record formats: one record per episode
        source.records_ingested += len(digests)
        source.episodes += len(digests)
        source.steps += n_steps
        self.quarantined.extend((source.path, q) for q in result.quarantined)
        self.writer.adopt(digests, n_steps)


def _items(path: Path, name: str, adapter, opts: SourceOptions) -> Iterator[Episode | Quarantined]:
    if path.stat().st_size == 0:
        yield Quarantined("file", "empty file: no records to read", "")
    elif adapter is None:
        yield from user_adapter_items(name, path, opts)
    else:
        yield from adapter(read_records(path), opts)


def _write_quarantine(tmp: Path, previous: TrajectoryDataset | None, rows: list[tuple[str, Quarantined]]) -> None:
    tables = [quarantine_table(rows)]
    if previous is not None:
        tables.insert(0, previous.quarantine_table())
    pq.write_table(pa.concat_tables(tables).cast(QUARANTINE_SCHEMA), tmp / "quarantine.parquet")


def _meta(out, name, previous, summary, reward, gamma, success_threshold, split, mapping) -> dict:
    sources = list(previous.meta["sources"]) if previous else []
    for s in summary.sources:
        if s.skipped is None:
            sources.append({**asdict(s), "mapping": mapping, "ingested_at": _now()})
    return {
        "name": name or (previous.meta["name"] if previous else Path(out).name),
        "schema_version": SCHEMA_VERSION,
        "created_by": f"offline-agent {__version__}",
        "created_at": previous.meta["created_at"] if previous else _now(),
        "updated_at": _now(),
        "sources": sources,
        "reward": {"mode": reward, "success_threshold": success_threshold},
        "gamma": gamma,
        "split": split,
    }


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(show: bool):
    if not show:
        return _NoProgress()
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.completed} records"),
        TimeElapsedColumn(),
        transient=True,
    )
