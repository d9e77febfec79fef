"""Bad input: every kind is quarantined with where and why, ingestion goes on, and the counts reconcile."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from offline_agent.cli import app
from offline_agent.dataset import TrajectoryDataset
from offline_agent.errors import UserError
from offline_agent.ingest import ingest
from tests.helpers import chat_record, write_jsonl

GOOD = json.dumps(chat_record())


def _quarantine(tmp_path, name: str, content: bytes, **kwargs):
    src = tmp_path / name
    src.write_bytes(content)
    summary = ingest([src], tmp_path / "ds", **kwargs)
    assert summary.reconciles
    ds = TrajectoryDataset.open(tmp_path / "ds")
    return summary, ds.quarantine_table().to_pylist(), ds


def test_malformed_json_line(tmp_path):
    content = f'{GOOD}\n{{"messages": [\n{GOOD}\n'.encode()
    summary, rows, ds = _quarantine(tmp_path, "a.jsonl", content)
    assert (summary.total("records_read"), summary.total("episodes"), summary.total("quarantined")) == (3, 2, 1)
    assert rows == [
        {
            "source": str(tmp_path / "a.jsonl"),
            "location": "line 2",
            "reason": rows[0]["reason"],
            "raw": '{"messages": [',
        }
    ]
    assert rows[0]["reason"].startswith("malformed JSON")
    assert ds.meta["counts"]["quarantined"] == 1


def test_missing_messages_field_names_the_map_flag(tmp_path):
    _, rows, _ = _quarantine(
        tmp_path, "a.jsonl", f'{GOOD}\n{{"messages": [], "reward": 1}}\n{{"turns": []}}\n'.encode(), fmt="openai-chat"
    )
    assert [r["location"] for r in rows] == ["line 2", "line 3"]
    assert "no agent actions" in rows[0]["reason"]
    assert "missing field 'messages' or 'traj'; name the field with --map messages=FIELD" == rows[1]["reason"]


def test_mistyped_fields(tmp_path):
    bad_reward = chat_record(reward=None) | {"reward": "high"}
    bad_messages = {"messages": "hello"}
    _, rows, _ = _quarantine(
        tmp_path,
        "a.jsonl",
        "\n".join(map(json.dumps, [bad_reward, bad_messages, chat_record()])).encode(),
        fmt="openai-chat",
    )
    assert [r["reason"] for r in rows] == [
        "field 'reward' must be a number, got str 'high'",
        "field 'messages' must be a list, got str",
    ]
    assert json.loads(rows[0]["raw"]) == bad_reward


def test_tool_result_with_no_call(tmp_path):
    record = chat_record()
    record["messages"].insert(2, {"role": "tool", "tool_call_id": "ghost", "content": "??"})
    _, rows, _ = _quarantine(tmp_path, "a.jsonl", (json.dumps(record) + "\n" + GOOD + "\n").encode())
    assert rows[0]["location"] == "line 1"
    assert rows[0]["reason"].startswith("message 2 (tool): a tool result (tool_call_id='ghost') has no matching")


def test_bytes_that_are_not_utf8(tmp_path):
    content = GOOD.encode() + b"\n" + b'{"messages": "caf\xe9"}\n'
    _, rows, _ = _quarantine(tmp_path, "a.jsonl", content)
    assert rows[0]["location"] == "line 2" and "not UTF-8 at byte 17" in rows[0]["reason"]
    assert rows[0]["raw"] == '{"messages": "caf\ufffd"}'


def test_empty_file_among_good_ones(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    good = write_jsonl(tmp_path / "good.jsonl", [chat_record()])
    summary = ingest([empty, good], tmp_path / "ds")
    assert [(s.records_read, s.episodes, s.quarantined) for s in summary.sources] == [(1, 0, 1), (1, 1, 0)]
    rows = TrajectoryDataset.open(tmp_path / "ds").quarantine_table().to_pylist()
    assert rows[0]["source"] == str(empty) and rows[0]["reason"].startswith("empty file")


def test_truncated_jsonl_and_truncated_json_document(tmp_path):
    _, rows, _ = _quarantine(tmp_path, "a.jsonl", f"{GOOD}\n{GOOD[:50]}".encode())
    assert rows[0]["location"] == "line 2" and rows[0]["reason"].startswith("truncated JSON on the last line")
    doc = json.dumps([chat_record(), chat_record()], indent=1)
    src = tmp_path / "b.json"
    src.write_text(doc[: len(doc) // 2])
    summary = ingest([src], tmp_path / "ds2")
    row = TrajectoryDataset.open(tmp_path / "ds2").quarantine_table().to_pylist()[0]
    assert (row["location"], summary.total("episodes")) == ("file", 0)
    assert row["reason"].startswith("invalid or truncated JSON document") and row["raw"] == doc[: len(doc) // 2]


def test_strict_turns_any_quarantine_into_an_error_and_writes_nothing(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text(f"{GOOD}\nnot json\n")
    with pytest.raises(UserError, match=r"--strict: 1 record\(s\) could not be read, nothing was written.*line 2"):
        ingest([src], tmp_path / "ds", strict=True)
    assert not (tmp_path / "ds").exists()


def test_cli_reports_bad_input_in_one_line_without_traceback(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["ingest", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "ds")])
    assert missing.exit_code == 2 and "no such file or folder" in missing.output
    assert "Traceback" not in missing.output
    src = tmp_path / "a.jsonl"
    src.write_text(f"{GOOD}\nnot json\n")
    result = runner.invoke(app, ["ingest", str(src), "--out", str(tmp_path / "ds")])
    assert result.exit_code == 0, result.output
    assert "records read 2 = ingested 1 + quarantined 1 + duplicates 0: reconciled" in result.output
    assert "line 2: malformed JSON" in result.output


def test_cli_main_turns_user_errors_into_exit_code_2(tmp_path, monkeypatch, capsys):
    from offline_agent import cli

    monkeypatch.setattr("sys.argv", ["offline-agent", "info", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "is not a dataset" in err and "Traceback" not in err
