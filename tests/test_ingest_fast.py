"""The fast OpenAI-chat path gives exactly the dataset of the reference adapter, record shape by record shape."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
from typer.testing import CliRunner

from offline_agent import ingest as ingest_module
from offline_agent.cli import app
from offline_agent.dataset import TrajectoryDataset, episode_digest
from offline_agent.ingest import ingest
from offline_agent.ingest import parallel as parallel_module
from offline_agent.ingest.builder import looks_like_error
from offline_agent.ingest.openai_chat import plain_episode
from offline_agent.ingest.options import SourceOptions
from offline_agent.ingest.parallel import scan
from offline_agent.ingest.readers import Record
from tests.helpers import call, chat_record

DATASETS = "pipeline", "logistics", "support"


def _tool_turn(cid: str, name: str, arguments, result: str | None, text=None) -> list[dict]:
    turn = [{"role": "assistant", "content": text,
             "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}]}]
    if result is not None:
        turn.append({"role": "tool", "tool_call_id": cid, "content": result})
    return turn


def _records() -> list:
    """Plain records of every shape the fast path takes, and records it must leave to the adapter."""
    plain = [
        chat_record(),
        chat_record(reward=None, episode_id=7, agent="gpt-x", task="a task field"),
        chat_record(reward=0.5, n_calls=3, score=1.0, success=True, model="m", trial=2, info={"k": [1, None]}),
        chat_record(reward=True, truncated=True),
        {"messages": [{"role": "developer", "content": "rules"}, {"role": "system", "content": None},
                      {"role": "user", "content": "héllo \u2028 \U0001f600"},
                      *_tool_turn("a", "lookup", '{"b": 1, "a": [2.50, {"z": null, "y": 1e5}]}', "Error: none"),
                      *_tool_turn("b", "größe", {"é": 1}, "  traceback here", text="let me look"),
                      *_tool_turn("c", "noargs", "", "\u3000ERROR spaced"),
                      *_tool_turn("d", "nullargs", None, "fine"),
                      {"role": "user", "content": ""},
                      {"role": "user", "content": "try again"},
                      {"role": "assistant", "content": ""},
                      {"role": "assistant", "content": "thinking aloud", "tool_calls": []},
                      {"role": "assistant", "content": "two at once",
                       "tool_calls": [call("e", "one", {"x": 1}), call("f", "two", {"y": 2})]},
                      {"role": "tool", "tool_call_id": "f", "content": "second first"},
                      {"role": "tool", "tool_call_id": "e", "content": "failed: first"},
                      {"role": "assistant", "content": "all done"},
                      {"role": "user", "content": "thanks"}],
         "reward": 0, "outcome": 1, "": "empty key"},
        {"messages": [{"role": "user", "content": "q"}, *_tool_turn("x", "t", "{}", "ok"),
                      {"role": "user", "content": "after"}], "score": -0.0},
        {"episode_id": "dup", "messages": [{"role": "user", "content": "1st"}, {"role": "assistant", "content": "a"}]},
        {"episode_id": "dup", "messages": [{"role": "user", "content": "2nd"}, {"role": "assistant", "content": "b"}]},
    ]
    left_to_adapter = [
        {"traj": chat_record()["messages"], "reward": 1},  # τ-bench's field name
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]},
                      {"role": "assistant", "content": "ok"}]},
        {"messages": [*_tool_turn("r", "t", "{}", "x"), *_tool_turn("r", "t", "{}", "y")],
         "reward": 1},  # a reused id, answered in between: still plain
        {"messages": [*_tool_turn("r", "t", "{}", None), *_tool_turn("r", "u", "{}", "one"),
                      {"role": "tool", "tool_call_id": "r", "content": "two"}]},  # reused while open
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "zz", "content": "orphan"}]},
        {"messages": [{"role": "critic", "content": "?"}]},
        {"messages": [{"role": "user", "content": "q"}, *_tool_turn("i", "t", "{}", None),
                      {"role": "tool", "tool_call_id": "i", "content": "x", "is_error": True, "reward": 0.5}]},
        {"messages": [{"role": "user", "content": "q", "reward": None}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "assistant", "content": '{"name":"t","arguments":{}}'}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": "oops"}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": 3, "function": {"name": "t"}}]}]},
        {"messages": [*_tool_turn("a", "t", "[1, 2]", "not an object")]},
        {"messages": [*_tool_turn("a", "", "{}", "empty name")]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "assistant", "content": "a"}], "reward": "high"},
        {"messages": "not a list"},
        [1, 2, 3],
    ]
    return plain + left_to_adapter + ["{broken json", "", "   "]


def _write(path, records) -> None:
    with open(path, "wb") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)).encode() + b"\n")
        f.write(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n')
        f.write(b'{"messages": [{"role": "assistant", "content": "cut off"')


def _tables(path) -> tuple:
    ds = TrajectoryDataset.open(path)
    return ds.steps_table(), ds.episodes_table(), ds.quarantine_table(), ds.meta["fingerprint"], ds.meta["counts"]


def _same_datasets(a, b) -> None:
    for x, y, name in zip(_tables(a), _tables(b), ("steps", "episodes", "quarantine", "fingerprint", "counts"),
                          strict=True):
        if hasattr(x, "equals"):
            assert x.schema == y.schema, name
            for column in x.column_names:
                assert x[column].to_pylist() == y[column].to_pylist(), f"{name}.{column}"
        else:
            assert x == y, name


@pytest.mark.parametrize("reward", ["outcome", "per-step", "score-delta"])
def test_every_record_shape_gives_the_reference_adapters_rows(tmp_path, reward):
    src = tmp_path / "logs.jsonl"
    _write(src, _records())
    fast = ingest([src], tmp_path / "fast", reward=reward, gamma=0.9)
    reference = ingest([src], tmp_path / "ref", reward=reward, gamma=0.9, engine="python")
    assert [vars(s) for s in fast.sources] == [vars(s) for s in reference.sources]
    assert fast.total("quarantined") == 12 and fast.total("duplicates") == 1 and fast.reconciles
    _same_datasets(tmp_path / "fast", tmp_path / "ref")


def test_plain_records_do_take_the_fast_path():
    opts = SourceOptions("s", "s", "0" * 64)
    records = _records()
    taken = [plain_episode(Record(f"line {i}", r), opts, {}) is not None for i, r in enumerate(records)]
    assert taken == [True] * 8 + [True, False, True] + [False] * 17


def test_worker_processes_with_the_fast_path_give_the_same_dataset(tmp_path, monkeypatch):
    src = tmp_path / "logs.jsonl"
    _write(src, _records() * 30)
    ingest([src], tmp_path / "ref", engine="python", workers=1)
    monkeypatch.setattr(ingest_module, "MIN_PARALLEL_BYTES", 0)
    monkeypatch.setattr(parallel_module, "CHUNK_BYTES", 8192)
    assert len(scan(src)[1]) > 3
    summary = ingest([src], tmp_path / "fast", workers=2)
    assert summary.total("duplicates") == 29 + 59 and summary.reconciles  # ids 7 and "dup" repeat in every copy
    _same_datasets(tmp_path / "fast", tmp_path / "ref")


@pytest.mark.parametrize("name", DATASETS)
def test_bundled_sample_logs_give_the_same_dataset(tmp_path, name):
    src = ingest_module.Path(__file__).parents[1] / "datasets" / name / "logs.jsonl"
    ingest([src], tmp_path / "fast")
    ingest([src], tmp_path / "ref", engine="python")
    _same_datasets(tmp_path / "fast", tmp_path / "ref")


def test_tau_bench_gives_the_same_dataset(real_data, tmp_path):
    src = real_data / "tau_bench_airline" / "gpt-4o-airline.json"
    ingest([src], tmp_path / "fast")
    ingest([src], tmp_path / "ref", engine="python")
    _same_datasets(tmp_path / "fast", tmp_path / "ref")


def test_an_unknown_engine_is_a_one_line_error(tmp_path):
    src = tmp_path / "logs.jsonl"
    _write(src, [chat_record()])
    result = CliRunner().invoke(app, ["ingest", str(src), "--out", str(tmp_path / "ds"), "--engine", "rust"])
    assert result.exit_code == 2 and "unknown --engine 'rust': use one of auto, python" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "ds").exists()


def test_scan_hashes_the_file_and_cuts_it_after_newlines(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel_module, "BLOCK_BYTES", 7)  # cuts must also be found across block edges
    data = b"".join(b"x" * (i % 11) + b"\n" for i in range(60)) + b"tail without newline"
    path = tmp_path / "f"
    path.write_bytes(data)
    sha, chunks = scan(path, chunk_bytes=20)
    assert sha == hashlib.sha256(data).hexdigest()
    assert chunks[0].start == 0 and chunks[-1].end == len(data)
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.end == b.start and data[b.start - 1 : b.start] == b"\n" and b.start - a.start >= 20
        assert data[a.start + 20 - 1 : b.start - 1].count(b"\n") == 0  # the first newline at or past the size
        assert b.first_lineno == data[: b.start].count(b"\n") + 1


def test_episode_digest_is_the_documented_byte_stream():
    actions, observations, rewards = ["a", '{"name":"t"}'], ["", "ö \ud800 x"], [0.0, 1.5]
    expected = hashlib.sha256(
        b"e" + b"\x00a\x01\x020" + b'\x00{"name":"t"}\x01' + "ö \ud800 x".encode(errors="surrogatepass")
        + b"\x021.5"
    ).hexdigest()
    assert episode_digest("e", actions, observations, rewards) == expected
    with pytest.raises(ValueError, match="one entry per step"):
        episode_digest("e", ["a"], [], [])


def test_the_error_check_settles_texts_by_their_first_character_exactly():
    # Its shortcut: a text can look like an error only if it starts with a space or a character
    # that lowercases to e, f or t, and those are exactly e, f, t, E, F, T.
    for code in range(sys.maxunicode + 1):
        c = chr(code)
        could_start_a_word = c.isspace() or c.lower()[:1] in ("e", "f", "t")
        assert could_start_a_word == (c in "eEfFtT" or c.isspace()), hex(code)
    for text in ("", "Error: x", "  error", "\u3000ERROR", "\xa0failed", "TRACEBACK (most", "exception", "e",
                 "stage ok", "İ", "\u212aelvin"):
        assert looks_like_error(text) == text.lstrip()[:40].lower().startswith(
            ("error", "exception", "traceback", "failed")
        ), text
