"""The info and query verbs, end to end through the command line."""

from __future__ import annotations

import json

import polars as pl
import pytest
from typer.testing import CliRunner

from offline_agent.cli import app
from offline_agent.ingest import ingest
from tests.helpers import chat_record, write_jsonl

runner = CliRunner()


@pytest.fixture
def dataset(tmp_path):
    records = [chat_record(reward=1.0, n_calls=2), chat_record(reward=0.0, n_calls=3), chat_record(reward=1.0)]
    records[1]["messages"][3]["content"] = "Error: boom"
    ingest([write_jsonl(tmp_path / "logs.jsonl", records)], tmp_path / "ds")
    return tmp_path / "ds"


def test_info_json(dataset):
    result = runner.invoke(app, ["info", str(dataset), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert (info["episodes"], info["steps"], info["quarantined"]) == (3, 10, 0)
    assert info["success_rate"] == pytest.approx(2 / 3)
    assert info["top_tools"] == [{"tool": "retry", "calls": 7, "error_rate": pytest.approx(1 / 7)}]
    assert info["return"]["median"] == 1.0


def test_info_table(dataset):
    result = runner.invoke(app, ["info", str(dataset)])
    assert result.exit_code == 0 and "success rate 0.667" in result.output and "retry" in result.output


@pytest.mark.parametrize("fmt", ["csv", "json", "table"])
def test_query_formats(dataset, fmt):
    sql = "SELECT success, count(*) AS n FROM episodes GROUP BY 1 ORDER BY 1"
    result = runner.invoke(app, ["query", str(dataset), sql, "--format", fmt])
    assert result.exit_code == 0, result.output
    if fmt == "csv":
        assert result.output.splitlines() == ["success,n", "false,1", "true,2"]
    elif fmt == "json":
        assert [json.loads(line) for line in result.output.splitlines()] == [
            {"success": False, "n": 1},
            {"success": True, "n": 2},
        ]
    else:
        assert "true" in result.output and "│" in result.output


def test_query_to_parquet_file(dataset, tmp_path):
    out = tmp_path / "errors.parquet"
    result = runner.invoke(app, ["query", str(dataset), "SELECT * FROM steps WHERE is_error", "-f", "parquet",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    # is_error marks the step whose action produced the error (the error text is the next observation)
    assert pl.read_parquet(out).select("step", "action").rows() == [(0, '{"name":"retry","arguments":{"stage":0}}')]


def test_bad_query_gets_duckdbs_message_and_exit_2(dataset):
    result = runner.invoke(app, ["query", str(dataset), "SELECT nope FROM episodes"])
    assert result.exit_code == 2
    assert 'query failed: Binder Error: Referenced column "nope" not found' in result.output
    assert "Traceback" not in result.output


def test_parquet_format_needs_an_output_file(dataset):
    result = runner.invoke(app, ["query", str(dataset), "SELECT 1", "--format", "parquet"])
    assert result.exit_code == 2 and "--format parquet needs --output FILE" in result.output
