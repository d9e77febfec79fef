"""A large JSONL file ingested by worker processes gives exactly what one process gives."""

from __future__ import annotations

import json

from offline_agent import ingest as ingest_module
from offline_agent.dataset import TrajectoryDataset
from offline_agent.ingest import ingest
from offline_agent.ingest import parallel as parallel_module
from offline_agent.ingest.parallel import plan_chunks
from tests.helpers import chat_record


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
    records = []
    for i in range(120):
        records.append(json.dumps(chat_record(reward=float(i % 2), n_calls=1 + i % 4)))
        if i % 37 == 5:
            records.append("{broken")
        if i % 50 == 7:
            records.append(json.dumps(chat_record(episode_id="dup")))  # the same id in several chunks
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
