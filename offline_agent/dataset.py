"""TrajectoryDataset: a folder of Parquet tables, opened lazily, written atomically.

Layout of a dataset folder (schema v1, see `offline_agent.schema`):

    dataset.json         name, schema version, sources (sha256, adapter), counts, reward spec, gamma,
                         split rule, fingerprint, lineage
    steps/*.parquet      one row per decision
    episodes/*.parquet   one row per episode
    quarantine.parquet   records that could not be read, with where and why
    catalog.duckdb       views `steps` and `episodes` for a plain `duckdb` user

Every write goes to a temporary sibling folder that is renamed into place
only once complete, so a crash leaves either no dataset or the previous one.
Reading hands out DuckDB relations and Polars lazy frames: nothing is loaded
until a result is asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from offline_agent.errors import UserError
from offline_agent.schema import EPISODES_SCHEMA, QUARANTINE_SCHEMA, SCHEMA_VERSION, STEPS_SCHEMA

if TYPE_CHECKING:  # imported where used: ingest worker processes need this module but neither engine
    import duckdb
    import polars as pl

META_FILE = "dataset.json"
CATALOG_FILE = "catalog.duckdb"
DEFAULT_SPLIT = {"rule": "sha256(episode_id) -> uniform [0,1)", "train": 0.8, "valid": 0.1, "test": 0.1}


def split_of(episode_id: str, fractions: dict[str, float]) -> str:
    """The split of an episode: a uniform number from the hash of its id, cut at the split fractions.

    Hashing (rather than a random draw) keeps an episode in the same split across
    re-ingests, appends and machines.
    """
    u = int.from_bytes(hashlib.sha256(episode_id.encode()).digest()[:8], "big") / 2**64
    if u < fractions["train"]:
        return "train"
    if u < fractions["train"] + fractions["valid"]:
        return "valid"
    return "test"


def validate_split_fractions(train: float, valid: float, test: float) -> dict[str, Any]:
    fractions = {"train": train, "valid": valid, "test": test}
    if any(f < 0 for f in fractions.values()) or abs(sum(fractions.values()) - 1.0) > 1e-6:
        raise UserError(f"split fractions must be >= 0 and sum to 1, got {fractions}; e.g. --split 0.8,0.1,0.1")
    return {**DEFAULT_SPLIT, **fractions}


def episode_digest(episode_id: str, actions: list[str], observations: list[str], rewards: list[float]) -> str:
    """Content hash of one episode; the dataset fingerprint combines these, so it does not depend on file layout."""
    if not len(actions) == len(observations) == len(rewards):
        raise ValueError("actions, observations and rewards must have one entry per step")
    return hashlib.sha256(_digest_bytes(episode_id, actions, observations, rewards)).hexdigest()


_STEP_DIGEST_FORMAT = "\x00{}\x01{}\x02{:.6g}".format


def _digest_bytes_python(episode_id: str, actions: list[str], observations: list[str], rewards: list[float]) -> bytes:
    # Per step: \x00 action \x01 observation \x02 reward (%.6g), encoded once as one string (the same
    # bytes as encoding each piece: the separators keep surrogates of different pieces apart).
    body = "".join(map(_STEP_DIGEST_FORMAT, actions, observations, rewards))
    return episode_id.encode() + body.encode(errors="surrogatepass")


try:  # the same bytes built in C, where the compiled module was built (see setup.py)
    from offline_agent._speedups import digest_bytes as _digest_bytes_compiled
except ImportError:
    _digest_bytes = _digest_bytes_python
else:

    def _digest_bytes(episode_id: str, actions: list[str], observations: list[str], rewards: list[float]) -> bytes:
        # The compiled copy answers None for texts with lone surrogates, which only Python's encoder handles.
        data = _digest_bytes_compiled(episode_id, actions, observations, rewards)
        return _digest_bytes_python(episode_id, actions, observations, rewards) if data is None else data


def combine_digests(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for episode_id in sorted(digests):
        h.update(digests[episode_id].encode())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def atomic_dataset_dir(path: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder next to `path`; on success it replaces `path` in one rename.

    On any exception the temporary folder is removed and `path` is untouched.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise UserError(f"a dataset already exists at {path}: delete it, choose another --out, or use --append")
    if path.exists() and not (path / META_FILE).exists():
        raise UserError(f"{path} exists and is not a dataset (no {META_FILE}); refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    tmp = folder / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, folder / META_FILE)


def write_catalog(path: Path) -> None:
    """A DuckDB file in a committed dataset whose views point at its Parquet files by absolute path.

    DuckDB resolves relative paths in views against the working directory, not the
    database file, and binds a view when it is created, so the catalog is written
    after the dataset is in place (a derived file: `offline-agent info` rewrites it
    after a dataset has moved). It is built under a temporary name and renamed.
    """
    root = Path(path).resolve()
    import duckdb

    tmp = root / f".{CATALOG_FILE}.tmp-{uuid.uuid4().hex[:8]}"
    con = duckdb.connect(str(tmp))
    try:
        for view, sql in _view_sql(root).items():
            con.execute(f"CREATE OR REPLACE VIEW {view} AS {sql}")
    finally:
        con.close()
    os.replace(tmp, root / CATALOG_FILE)


def _view_sql(root: Path) -> dict[str, str]:
    def q(p: Path) -> str:
        return "'" + str(p).replace("'", "''") + "'"

    return {
        "steps": f"SELECT * FROM read_parquet({q(root / 'steps' / '*.parquet')})",
        "episodes": f"SELECT * FROM read_parquet({q(root / 'episodes' / '*.parquet')})",
        "quarantine": f"SELECT * FROM read_parquet({q(root / 'quarantine.parquet')})",
    }


def write_dataset(
    path: str | Path,
    steps: pa.Table,
    episodes: pa.Table,
    quarantine: pa.Table | None,
    meta: dict[str, Any],
    overwrite: bool = False,
) -> TrajectoryDataset:
    """Write whole tables as a new dataset (atomically), filling in counts and the fingerprint.

    Used by relabel and other transforms; ingestion streams through `offline_agent.ingest.writer` instead.
    """
    path = Path(path)
    steps = steps.select(STEPS_SCHEMA.names).cast(STEPS_SCHEMA)
    episodes = episodes.select(EPISODES_SCHEMA.names).cast(EPISODES_SCHEMA)
    quarantine = (quarantine if quarantine is not None else QUARANTINE_SCHEMA.empty_table()).cast(QUARANTINE_SCHEMA)
    with atomic_dataset_dir(path, overwrite) as tmp:
        (tmp / "steps").mkdir()
        (tmp / "episodes").mkdir()
        pq.write_table(steps, tmp / "steps" / "part-00000.parquet", row_group_size=65536)
        pq.write_table(episodes, tmp / "episodes" / "part-00000.parquet")
        pq.write_table(quarantine, tmp / "quarantine.parquet")
        meta = {
            **meta,
            "schema_version": SCHEMA_VERSION,
            "counts": {**meta.get("counts", {}), **_table_counts(steps, episodes, quarantine)},
            "fingerprint": table_fingerprint(steps),
        }
        meta.setdefault("name", path.name)
        write_meta(tmp, meta)
    write_catalog(path)
    return TrajectoryDataset.open(path)


def _table_counts(steps: pa.Table, episodes: pa.Table, quarantine: pa.Table) -> dict[str, int]:
    return {"steps": steps.num_rows, "episodes": episodes.num_rows, "quarantined": quarantine.num_rows}


def table_fingerprint(steps: pa.Table) -> str:
    """Fingerprint of a steps table: the same value ingestion computes for the same content."""
    ordered = steps.sort_by([("episode_id", "ascending"), ("step", "ascending")])
    cols = ordered.select(["episode_id", "action", "observation", "reward"]).to_pydict()
    digests: dict[str, str] = {}
    start = 0
    ids = cols["episode_id"]
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            digests[ids[start]] = episode_digest(
                ids[start], cols["action"][start:i], cols["observation"][start:i], cols["reward"][start:i]
            )
            start = i
    return combine_digests(digests)


class TrajectoryDataset:
    """An opened dataset folder. Cheap to open: tables are read only when asked for."""

    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path = path
        self.meta = meta

    @classmethod
    def open(cls, path: str | Path) -> TrajectoryDataset:
        path = Path(path)
        meta_path = path / META_FILE
        if not meta_path.exists():
            raise UserError(
                f"{path} is not a dataset (no {META_FILE}); create one with `offline-agent ingest LOGS --out {path}`"
            )
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{meta_path} is not valid JSON ({exc}); the dataset is damaged, re-ingest it") from None
        if meta.get("schema_version") != SCHEMA_VERSION:
            raise UserError(
                f"{path} has schema version {meta.get('schema_version')!r}; this offline-agent reads version "
                f"{SCHEMA_VERSION}: re-ingest the logs with this version"
            )
        return cls(path, meta)

    # --- facts -------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.meta.get("name", self.path.name)

    @property
    def gamma(self) -> float:
        return float(self.meta.get("gamma", 1.0))

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def _files(self, table: str) -> list[str]:
        return sorted(str(p) for p in (self.path / table).glob("*.parquet"))

    # --- Arrow -------------------------------------------------------------------------------------
    def steps_table(self, columns: list[str] | None = None) -> pa.Table:
        """All steps as one Arrow table, sorted by (episode_id, step), whichever `columns` are asked for: row i
        is the same step in every read (and in `build_features`' tensors)."""
        keys = ["episode_id", "step"]
        read = None if columns is None else list(dict.fromkeys([*columns, *keys]))
        table = pq.read_table(self._files("steps"), schema=STEPS_SCHEMA, columns=read)
        table = table.sort_by([(k, "ascending") for k in keys])
        return table if columns is None else table.select(columns)

    def episodes_table(self) -> pa.Table:
        return pq.read_table(self._files("episodes"), schema=EPISODES_SCHEMA).sort_by("episode_id")

    def quarantine_table(self) -> pa.Table:
        return pq.read_table(self.path / "quarantine.parquet", schema=QUARANTINE_SCHEMA)

    # --- Polars ------------------------------------------------------------------------------------
    def lazy(self) -> tuple[pl.LazyFrame, pl.LazyFrame]:
        """Polars lazy frames of (steps, episodes)."""
        import polars as pl

        return pl.scan_parquet(self._files("steps")), pl.scan_parquet(self._files("episodes"))

    # --- DuckDB ------------------------------------------------------------------------------------
    def duckdb(self, connection: duckdb.DuckDBPyConnection | None = None) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection (in memory unless given) with views `steps`, `episodes` and `quarantine`."""
        import duckdb

        con = connection or duckdb.connect()
        for view, sql in _view_sql(self.path.resolve()).items():
            con.execute(f"CREATE OR REPLACE VIEW {view} AS {sql}")
        return con

    def sql(self, query: str) -> pl.DataFrame:
        """Run SQL over the views and return a Polars frame. DuckDB errors come back as UserError."""
        import duckdb

        con = self.duckdb()
        try:
            return con.sql(query).pl()
        except duckdb.Error as exc:
            raise UserError(f"query failed: {exc}") from None
        finally:
            con.close()

    def __repr__(self) -> str:
        c = self.meta.get("counts", {})
        return f"TrajectoryDataset({str(self.path)!r}, episodes={c.get('episodes')}, steps={c.get('steps')})"
