"""A large JSONL file ingested by worker processes gives exactly what one process gives."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from offline_agent import ingest as ingest_module
from offline_agent.dataset import TrajectoryDataset
from offline_agent.ingest import ingest
from offline_agent.ingest import parallel as parallel_module
from offline_agent.ingest.parallel import plan_chunks
from offline_agent.ingest.writer import string_array
from tests.helpers import chat_lines_with_faults, chat_record


def _tables(path):
    ds = TrajectoryDataset.open(path)
    return ds.steps_table(), ds.episodes_table().drop(["source"]), ds.quarantine_table().drop(["source"]), ds


def test_chunks_start_at_line_starts_with_their_line_numbers(tmp_path):
    path = tmp_path / "x.jsonl"
    lines = [json.dumps({"i": i, "pad": "x" * (i % 7)}) + "\n" for i in range(100)]
    path.write_text("".join(lines))
    chunks = plan_chunks(path, chunk_bytes=100)
    data = path.read_bytes()
    assert chunks[0].start == 0 and chunks[-1].end == len(data)
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.end == b.start and data[b.start - 1 : b.start] == b"\n"
        assert b.first_lineno == data[: b.start].count(b"\n") + 1


def test_parallel_ingest_equals_sequential_ingest(tmp_path, monkeypatch):
    records = chat_lines_with_faults()
    src = tmp_path / "logs.jsonl"
    src.write_text("\n".join(records) + "\n")

    sequential = ingest([src], tmp_path / "seq", workers=1)
    monkeypatch.setattr(ingest_module, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(parallel_module, "CHUNK_BYTES", 4096)
    assert len(plan_chunks(src, 4096)) > 3
    parallel = ingest([src], tmp_path / "par", workers=2)

    for name in ("records_read", "episodes", "steps", "quarantined", "duplicates"):
        assert parallel.total(name) == sequential.total(name), name
    assert parallel.total("duplicates") == 2 and parallel.total("quarantined") == 4 and parallel.reconciles
    seq, par = _tables(tmp_path / "seq"), _tables(tmp_path / "par")
    for a, b in zip(seq[:3], par[:3], strict=True):
        assert a.equals(b)
    assert seq[3].fingerprint == par[3].fingerprint


def test_parallel_append_takes_known_episodes_out_of_the_workers_parts(tmp_path, monkeypatch):
    old = [json.dumps(chat_record(episode_id=f"old-{i}", n_calls=2)) for i in range(40)]
    new = old[:25] + [json.dumps(chat_record(episode_id=f"new-{i}", n_calls=3)) for i in range(15)]
    (tmp_path / "old.jsonl").write_text("\n".join(old) + "\n")
    (tmp_path / "new.jsonl").write_text("\n".join(new) + "\n")
    for name in ("seq", "par"):
        ingest([tmp_path / "old.jsonl"], tmp_path / name, workers=1)
    sequential = ingest([tmp_path / "new.jsonl"], tmp_path / "seq", append=True, workers=1)
    monkeypatch.setattr(ingest_module, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(parallel_module, "CHUNK_BYTES", 2048)  # several chunks hold known episodes only
    parallel = ingest([tmp_path / "new.jsonl"], tmp_path / "par", append=True, workers=2)

    assert parallel.total("duplicates") == sequential.total("duplicates") == 25
    assert parallel.total("episodes") == 15 and parallel.reconciles
    seq, par = _tables(tmp_path / "seq"), _tables(tmp_path / "par")
    for a, b in zip(seq[:3], par[:3], strict=True):
        assert a.equals(b)
    assert seq[3].fingerprint == par[3].fingerprint and par[3].meta["counts"]["episodes"] == 55
    steps_parts = sorted(p.name for p in (tmp_path / "par" / "steps").glob("*.parquet"))
    episodes_parts = sorted(p.name for p in (tmp_path / "par" / "episodes").glob("*.parquet"))
    assert steps_parts == episodes_parts and len(steps_parts) > 3  # worker parts beside the writer's own
    # A chunk whose episodes were all known leaves no part behind: every worker's part has rows.
    worker_parts = [p for p in steps_parts if p.startswith("part-00001-")]
    assert 0 < len(worker_parts) < len(plan_chunks(tmp_path / "new.jsonl", 2048))
    for part in worker_parts:
        assert pq.ParquetFile(tmp_path / "par" / "steps" / part).metadata.num_rows > 0, part


@pytest.mark.parametrize(
    "values", [[], ["a"], ["", "é", None, "x" * 1000, "\U0001f600", "nul\x00inside"], [None, None], ["only"] * 9]
)
def test_string_arrays_built_from_buffers_equal_pyarrows_own(values):
    built = string_array(values)
    built.validate(full=True)
    assert built.equals(pa.array(values, pa.string())) and built.to_pylist() == values


def _blas_threads() -> str | None:
    return os.environ.get("OPENBLAS_NUM_THREADS")


def test_workers_run_one_blas_thread_and_the_callers_environment_is_left_as_it_was(monkeypatch):
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    pool = parallel_module.start_pool(1)
    try:
        assert pool.submit(_blas_threads).result() == "1"
    finally:
        pool.shutdown()
    assert "OPENBLAS_NUM_THREADS" not in os.environ
