"""`--backend ray` on the command line: ingest and embed through a real local Ray, and the one-line error
where Ray is not installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from offline_agent.cli import app

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / "datasets" / "pipeline" / "logs.jsonl"
runner = CliRunner()


@pytest.mark.ray
def test_ingest_then_embed_on_ray_write_the_local_dataset_and_cache(local_ray, tmp_path, one_torch_thread):
    logs = tmp_path / "logs.jsonl"
    logs.write_text("".join(LOGS.read_text().splitlines(keepends=True)[:5]))
    for backend in ("local", "ray"):
        result = runner.invoke(app, ["ingest", str(logs), "--out", str(tmp_path / backend), "--backend", backend])
        assert result.exit_code == 0, result.output
    for table in ("steps", "episodes"):
        local, on_ray = (pq.read_table(tmp_path / b / table) for b in ("local", "ray"))
        assert on_ray.equals(local)
    result = runner.invoke(app, ["embed", str(tmp_path / "ray"), "--backend", "ray"])
    assert result.exit_code == 0, result.output
    assert "0 cached" in result.output
    again = runner.invoke(app, ["embed", str(tmp_path / "ray")])  # the local backend finds every vector
    assert again.exit_code == 0 and "0 new texts encoded" in again.output


@pytest.mark.parametrize("verb", ["ingest", "embed", "evaluate", "finetune"])
def test_backend_ray_without_ray_is_one_line_naming_the_install(verb, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` does where the extra is not installed
    run = tmp_path / "run"
    args = {
        "ingest": [str(LOGS), "--out", str(tmp_path / "data")],
        "embed": [str(tmp_path / "data")],
        "evaluate": [str(run), "--env", "offline_agent/PipelineRepair-v0"],
        "finetune": [str(run), "--env", "offline_agent/PipelineRepair-v0", "--out", str(tmp_path / "ft")],
    }[verb]
    result = runner.invoke(app, [verb, *args, "--backend", "ray"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: --backend ray needs Ray, which is not installed: pip install 'offline-agent[ray]'"
    ]
    assert not (tmp_path / "data").exists() and not (tmp_path / "ft").exists()
