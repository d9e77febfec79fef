"""`ingest(backend="ray")` writes the local engine's dataset, survives a worker killed mid-task, and writes
nothing when a task fails."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from offline_agent import ingest as ingest_module
from offline_agent.dataset import TrajectoryDataset
from offline_agent.errors import UserError
from offline_agent.ingest import ingest
from offline_agent.ingest import parallel as parallel_module
from offline_agent.ingest.parallel import plan_chunks
from tests.helpers import chat_lines_with_faults, chat_record, ray_folder, write_jsonl
from tests.test_ingest_parallel import _tables

TIMESTAMPS = ("created_at", "updated_at", "ingested_at")


def _anthropic_record(episode_id: str, n_calls: int) -> dict:
    messages = [{"role": "user", "content": "restart the job"}]
    for i in range(n_calls):
        messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "restart",
                                                           "input": {"attempt": i}}]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                                      "content": f"attempt {i} failed"}]})
    return {"episode_id": episode_id, "system": "be careful", "messages": messages, "reward": 1}


def _logs(folder):
    """Files of every kind, in the order given: which of them Ray reads, and which the driver, is in the comments."""
    big = chat_lines_with_faults()
    steps = [{"episode_id": eid, "step": t, "observation": f"o{t}", "action": f"a{t}", "reward": 0.5, "done": t == 1}
             for eid in ("shared", "s2") for t in range(2)]
    anthropic = [_anthropic_record(f"an-{i}", 1 + i % 3) for i in range(8)] + [_anthropic_record("dup", 2)]
    files = [
        write_jsonl(folder / "a.jsonl", big),  # Ray: several chunks, broken lines, repeated ids
        write_jsonl(folder / "b.jsonl", [*anthropic[:5], "not json", *anthropic[5:]]),  # Ray: "dup" known from a
        write_jsonl(folder / "c.jsonl", steps),  # driver (steps-jsonl): "shared" read here first ...
        write_jsonl(folder / "d.jsonl", [chat_record(episode_id=e) for e in ("shared", "d1", "d2")]),  # ... not here
        folder / "e.json",  # driver: a JSON document, not JSONL
        folder / "empty.jsonl",  # driver: quarantined as empty
        folder / "b-again.jsonl",  # skipped: the same bytes as b.jsonl
    ]
    (folder / "e.json").write_text(json.dumps([chat_record(episode_id=f"e{i}") for i in range(3)]))
    (folder / "empty.jsonl").write_text("")
    (folder / "b-again.jsonl").write_bytes((folder / "b.jsonl").read_bytes())
    return files


def _meta(path) -> dict:
    meta = dict(TrajectoryDataset.open(path).meta)
    meta["sources"] = [{k: v for k, v in s.items() if k not in TIMESTAMPS} for s in meta["sources"]]
    return {k: v for k, v in meta.items() if k not in (*TIMESTAMPS, "name")}  # the name is the folder's


def assert_same_dataset(a, b) -> None:
    """Same tables (sorted as the dataset hands them out, sources included), quarantine rows in the same order,
    the same digests and the same dataset.json apart from its timestamps."""
    for x, y in zip(_tables(a)[:3], _tables(b)[:3], strict=True):
        assert x.equals(y)
    ds_a, ds_b = TrajectoryDataset.open(a), TrajectoryDataset.open(b)
    assert ds_a.episodes_table().equals(ds_b.episodes_table())
    assert ds_a.quarantine_table().equals(ds_b.quarantine_table())
    assert pq.read_table(a / "digests.parquet").equals(pq.read_table(b / "digests.parquet"))
    assert _meta(a) == _meta(b)


def _parts(path) -> dict[str, object]:
    return {f"{table}/{p.name}": pq.read_table(p) for table in ("steps", "episodes")
            for p in sorted((path / table).glob("*.parquet"))}


@pytest.mark.ray
def test_ray_ingest_writes_the_local_engines_dataset(tmp_path, monkeypatch, local_ray):
    files = _logs(tmp_path)
    monkeypatch.setattr(parallel_module, "CHUNK_BYTES", 4096)
    assert len(plan_chunks(files[0])) > 3

    local = ingest(files, tmp_path / "local")  # every file small: read in this process
    on_ray = ingest(files, tmp_path / "ray", backend="ray")

    assert [s.__dict__ for s in on_ray.sources] == [s.__dict__ for s in local.sources]
    assert on_ray.total("duplicates") == 4 and on_ray.total("quarantined") == 6 and on_ray.reconciles
    assert on_ray.sources[-1].skipped and on_ray.sources[-2].quarantined == 1
    assert_same_dataset(tmp_path / "local", tmp_path / "ray")
    shared = TrajectoryDataset.open(tmp_path / "ray").episodes_table().to_pylist()
    assert {e["episode_id"]: e["source"] for e in shared}["shared"] == str(files[2])  # the steps-jsonl copy

    # The local engine cutting every file into ranges too writes the very same part files.
    monkeypatch.setattr(ingest_module, "MIN_PARALLEL_BYTES", 0)
    ingest(files, tmp_path / "local-ranges", workers=2)
    local_parts, ray_parts = _parts(tmp_path / "local-ranges"), _parts(tmp_path / "ray")
    assert list(local_parts) == list(ray_parts) and len(ray_parts) > 10
    for name, table in ray_parts.items():
        assert table.equals(local_parts[name]), name


def _ray_logs_tail(ray_temp: Path, lines: int = 30) -> str:
    """The last lines of the logs of the raylet, the GCS and the driver of the Ray session under `ray_temp`,
    for a failure message: why Ray's own processes ended."""
    tails = []
    for log in sorted(ray_temp.glob("session_*/logs/*")):
        if log.is_file() and log.name.startswith(("raylet", "gcs_server", "python-core-driver")):
            tails.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(tails)


@pytest.mark.ray
def test_a_worker_killed_mid_task_is_retried_and_the_dataset_is_unchanged(tmp_path, monkeypatch):
    # ~16 ranges of ~4,000 steps through the reference adapters (engine="python"): each keeps a worker busy
    # for a few tenths of a second, and the workers are busy from the first range to the last, so the
    # killer's first sighting of a `process_chunk` title is a task in progress. The Ray ingest runs in a
    # driver process of its own (see tests/ray_kill_driver.py), on a Ray of its own.
    pytest.importorskip("ray", reason="Ray tests need the extra: pip install 'offline-agent[ray]'")
    from benchmarks.ingest import generate

    src = tmp_path / "logs.jsonl"
    generate(src, steps=60_000)
    monkeypatch.setattr(parallel_module, "CHUNK_BYTES", 1 << 20)  # as the driver sets it
    assert len(plan_chunks(src)) >= 12
    ingest([src], tmp_path / "local", engine="python")

    ray_temp = Path(ray_folder())
    try:
        driver = subprocess.run(
            [sys.executable, "-m", "tests.ray_kill_driver", str(src), str(tmp_path / "ray"), str(ray_temp)],
            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
        )
        assert driver.returncode == 0, (
            f"the Ray driver exited with status {driver.returncode}\n{driver.stderr[-4000:]}\n"
            f"{_ray_logs_tail(ray_temp)}"
        )
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)
    result = json.loads(driver.stdout.strip().splitlines()[-1])
    assert len(result["killed"]) == 1, "no process_chunk task was seen running, so none was killed"
    assert result["reconciles"] and result["steps"] == 60_000
    assert_same_dataset(tmp_path / "local", tmp_path / "ray")


@pytest.mark.ray
def test_a_failing_task_leaves_no_dataset(tmp_path, monkeypatch, local_ray):
    # A split without "valid" fails in split_of, in the task, for the first episode hashed past "train":
    # an exception from the input, not a lost worker. It surfaces as it does locally, and nothing is written.
    src = write_jsonl(tmp_path / "logs.jsonl", [chat_record(episode_id=f"e{i}") for i in range(200)])
    monkeypatch.setattr(parallel_module, "CHUNK_BYTES", 2048)
    for backend in ("local", "ray"):
        with pytest.raises(KeyError, match="valid"):
            ingest([src], tmp_path / backend, split={"train": 0.5}, backend=backend)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.jsonl"]  # no dataset, no temporary folder


def test_backend_ray_without_ray_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "logs.jsonl", [chat_record()])
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where Ray is not installed
    with pytest.raises(UserError, match=r"pip install 'offline-agent\[ray\]'") as raised:
        ingest([src], tmp_path / "ds", backend="ray")
    assert "\n" not in str(raised.value)
    with pytest.raises(UserError, match="unknown --backend 'spark': use local or ray"):
        ingest([src], tmp_path / "ds", backend="spark")
    assert not (tmp_path / "ds").exists()
