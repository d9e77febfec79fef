"""Each log format, the reward modes, splits, append/dedup, atomic writes, custom adapters."""

from __future__ import annotations

import json
import textwrap

import duckdb
import pytest

from offline_agent.dataset import TrajectoryDataset, split_of
from offline_agent.errors import UserError
from offline_agent.ingest import ingest
from offline_agent.ingest import writer as writer_module
from tests.helpers import call, chat_record, write_jsonl


def test_openai_chat_steps_observations_and_final_message(tmp_path):
    src = write_jsonl(tmp_path / "logs.jsonl", [chat_record(reward=1.0)])
    ingest([src], tmp_path / "ds")
    steps = TrajectoryDataset.open(tmp_path / "ds").steps_table().to_pylist()
    assert [s["action"] for s in steps] == [
        '{"name":"retry","arguments":{"stage":0}}',
        '{"name":"retry","arguments":{"stage":1}}',
        "done",
    ]
    assert [s["observation"] for s in steps] == ["fix it", "result 0", "result 1"]
    assert [s["action_kind"] for s in steps] == ["tool_call", "tool_call", "final"]
    assert [s["tool_name"] for s in steps] == ["retry", "retry", None]
    assert steps[0]["tool_args"] == '{"stage":0}'
    assert [s["terminated"] for s in steps] == [False, False, True]


def test_repeated_tool_call_ids_match_results_by_position(tmp_path):
    record = chat_record(call_id="same", n_calls=3)
    record["messages"][-2]["content"] = "Error: stage 2 timed out"
    src = write_jsonl(tmp_path / "logs.jsonl", [record])
    ingest([src], tmp_path / "ds")
    steps = TrajectoryDataset.open(tmp_path / "ds").steps_table().to_pylist()
    assert [s["observation"] for s in steps] == ["fix it", "result 0", "result 1", "Error: stage 2 timed out"]
    assert [s["is_error"] for s in steps] == [False, False, True, False]


def test_parallel_tool_calls_in_one_message(tmp_path):
    record = {
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [call("a", "f", {}), call("b", "g", {"x": 1})]},
            {"role": "tool", "tool_call_id": "b", "content": "B"},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "assistant", "content": "ok"},
        ],
        "reward": 0,
    }
    ingest([write_jsonl(tmp_path / "l.jsonl", [record])], tmp_path / "ds")
    steps = TrajectoryDataset.open(tmp_path / "ds").steps_table().to_pylist()
    assert [s["tool_name"] for s in steps] == ["f", "g", None]
    assert steps[2]["observation"] == "B\nA"


def test_json_array_with_traj_field_and_map_flags(tmp_path):
    records = [{"traj": chat_record()["messages"], "score": 0.5, "rid": "ep-7"}]
    src = tmp_path / "logs.json"
    src.write_text(json.dumps(records, indent=2))
    ingest([src], tmp_path / "ds", mapping={"reward": "score", "episode_id": "rid"}, success_threshold=0.5)
    episodes = TrajectoryDataset.open(tmp_path / "ds").episodes_table().to_pylist()
    assert episodes[0]["episode_id"] == "ep-7"
    assert (episodes[0]["outcome"], episodes[0]["success"], episodes[0]["return"]) == (0.5, True, 0.5)
    assert episodes[0]["task"] == "fix it"
    assert json.loads(episodes[0]["metadata"])["system"] == "You are a helpful agent."


def test_anthropic_blocks(tmp_path):
    record = {
        "system": "be careful",
        "messages": [
            {"role": "user", "content": "restart the job"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "I will check the logs."},
                    {"type": "tool_use", "id": "tu1", "name": "read_logs", "input": {"lines": 10}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": "timeout", "is_error": True}],
            },
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu2", "name": "restart", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "tu2", "content": [{"type": "text", "text": "restarted"}]}
                ],
            },
            {"role": "assistant", "content": "Done."},
        ],
        "reward": 1,
    }
    summary = ingest([write_jsonl(tmp_path / "a.jsonl", [record])], tmp_path / "ds")
    assert summary.sources[0].format == "anthropic"
    steps = TrajectoryDataset.open(tmp_path / "ds").steps_table().to_pylist()
    assert [s["action"] for s in steps] == [
        '{"name":"read_logs","arguments":{"lines":10}}',
        '{"name":"restart","arguments":{}}',
        "Done.",
    ]
    assert [s["observation"] for s in steps] == ["restart the job", "timeout", "restarted"]
    assert [s["is_error"] for s in steps] == [True, False, False]
    assert json.loads(steps[0]["info"])["assistant_text"] == "I will check the logs."


def test_parallel_lists_with_renamed_fields(tmp_path):
    record = {"goal": "count files", "acts": ["ls", "ls | wc -l"], "obs": ["a b", "2"], "scores": [0.2, 1.0]}
    src = write_jsonl(tmp_path / "p.jsonl", [record])
    mapping = {"actions": "acts", "observations": "obs", "rewards": "scores", "task": "goal", "reward": "scores"}
    with pytest.raises(UserError, match="cannot tell the log format"):
        ingest([src], tmp_path / "auto")
    ingest(
        [src],
        tmp_path / "ds",
        fmt="parallel-lists",
        mapping={**mapping, "reward": "none"},
        reward="score-delta",
        gamma=0.5,
    )
    ds = TrajectoryDataset.open(tmp_path / "ds")
    steps = ds.steps_table().to_pylist()
    assert [s["reward"] for s in steps] == pytest.approx([0.2, 0.8])
    assert [s["return_to_go"] for s in steps] == pytest.approx([0.2 + 0.5 * 0.8, 0.8])
    assert ds.episodes_table()["task"].to_pylist() == ["count files"]
    assert ds.episodes_table()["outcome"].to_pylist() == [1.0]  # max score when no outcome field


def test_steps_jsonl_groups_interleaved_episodes_and_truncates_open_ones(tmp_path):
    rows = [
        {"episode_id": "a", "step": 0, "observation": "o0", "action": "x", "reward": 0.0, "done": False},
        {
            "episode_id": "b",
            "step": 0,
            "observation": "p0",
            "action": {"name": "f", "arguments": {}},
            "reward": 1,
            "done": False,
        },
        {"episode_id": "a", "step": 1, "observation": "o1", "action": "y", "reward": 2.0, "done": True},
        {"episode_id": "b", "step": 1, "observation": "p1", "action": "z", "reward": 0, "done": False},
    ]
    summary = ingest([write_jsonl(tmp_path / "s.jsonl", rows)], tmp_path / "ds", reward="per-step", gamma=1.0)
    assert (summary.total("records_read"), summary.total("records_ingested"), summary.total("episodes")) == (4, 4, 2)
    ds = TrajectoryDataset.open(tmp_path / "ds")
    steps = ds.steps_table().to_pylist()
    assert [(s["episode_id"], s["action"], s["return_to_go"]) for s in steps] == [
        ("a", "x", 2.0),
        ("a", "y", 2.0),
        ("b", '{"name":"f","arguments":{}}', 1.0),
        ("b", "z", 0.0),
    ]
    assert [(s["terminated"], s["truncated"]) for s in steps if s["step"] == 1] == [(True, False), (False, True)]


def test_reward_modes_exact_values(tmp_path):
    rows = [
        {
            "episode_id": "e",
            "step": i,
            "observation": "o",
            "action": "a",
            "reward": r,
            "score": sc,
            "done": i == 2,
            "outcome": 3.0,
        }
        for i, (r, sc) in enumerate([(1.0, 0.5), (0.0, 0.25), (2.0, 1.0)])
    ]
    src = write_jsonl(tmp_path / "s.jsonl", rows)
    expected = {
        "outcome": ([0, 0, 3.0], [0.81 * 3, 0.9 * 3, 3.0]),
        "per-step": ([1.0, 0, 2.0], [1 + 0.81 * 2, 0.9 * 2, 2.0]),
        "score-delta": ([0.5, -0.25, 0.75], [0.5 - 0.9 * 0.25 + 0.81 * 0.75, -0.25 + 0.9 * 0.75, 0.75]),
    }
    for mode, (rewards, rtg) in expected.items():
        ingest([src], tmp_path / mode, reward=mode, gamma=0.9)
        steps = TrajectoryDataset.open(tmp_path / mode).steps_table()
        assert steps["reward"].to_pylist() == pytest.approx(rewards), mode
        assert steps["return_to_go"].to_pylist() == pytest.approx(rtg), mode


def test_splits_come_from_the_episode_id_hash(tmp_path):
    records = [chat_record(episode_id=f"ep{i}") for i in range(200)]
    ingest(
        [write_jsonl(tmp_path / "l.jsonl", records)], tmp_path / "ds", split={"train": 0.5, "valid": 0.25, "test": 0.25}
    )
    episodes = TrajectoryDataset.open(tmp_path / "ds").episodes_table().to_pylist()
    assert all(e["split"] == split_of(e["episode_id"], {"train": 0.5, "valid": 0.25}) for e in episodes)
    counts = {s: sum(e["split"] == s for e in episodes) for s in ("train", "valid", "test")}
    assert 70 < counts["train"] < 130 and counts["valid"] > 25 and counts["test"] > 25


def test_append_adds_sources_and_never_duplicates(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat_record(episode_id=f"a{i}") for i in range(3)])
    b = write_jsonl(
        tmp_path / "b.jsonl", [chat_record(episode_id=f"b{i}") for i in range(2)] + [chat_record(episode_id="a0")]
    )
    ingest([a], tmp_path / "ds")
    first = TrajectoryDataset.open(tmp_path / "ds").fingerprint
    summary = ingest([a, b], tmp_path / "ds", append=True)
    assert summary.sources[0].skipped == "already ingested (same sha256)"
    assert summary.sources[1].duplicates == 1 and summary.sources[1].episodes == 2
    ds = TrajectoryDataset.open(tmp_path / "ds")
    assert ds.meta["counts"]["episodes"] == 5 and len(ds.episodes_table()) == 5
    assert ds.fingerprint != first and len(ds.meta["sources"]) == 2
    again = ingest([b], tmp_path / "ds", append=True)
    assert again.sources[0].skipped and TrajectoryDataset.open(tmp_path / "ds").fingerprint == ds.fingerprint


def test_fingerprint_depends_on_content_not_on_file_layout(tmp_path):
    records = [chat_record(episode_id=f"e{i}") for i in range(4)]
    one = write_jsonl(tmp_path / "one.jsonl", records)
    write_jsonl(tmp_path / "x.jsonl", records[:2])
    write_jsonl(tmp_path / "y.jsonl", records[2:])
    ingest([one], tmp_path / "d1")
    ingest([tmp_path / "x.jsonl"], tmp_path / "d2")
    ingest([tmp_path / "y.jsonl"], tmp_path / "d2", append=True)
    assert TrajectoryDataset.open(tmp_path / "d1").fingerprint == TrajectoryDataset.open(tmp_path / "d2").fingerprint


def test_a_crash_mid_ingest_leaves_the_previous_dataset(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", [chat_record(episode_id=f"a{i}") for i in range(5)])
    ingest([src], tmp_path / "ds")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ds").rglob("*.parquet")}
    other = write_jsonl(tmp_path / "b.jsonl", [chat_record(episode_id=f"b{i}") for i in range(5)])

    calls = {"n": 0}
    real_add = writer_module.EpisodeRows.add

    def crashing_add(self, episode, source):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as if the process were interrupted mid-write
        return real_add(self, episode, source)

    monkeypatch.setattr(writer_module.EpisodeRows, "add", crashing_add)
    with pytest.raises(KeyboardInterrupt):
        ingest([other], tmp_path / "ds", overwrite=True)
    after = {p.name: p.read_bytes() for p in (tmp_path / "ds").rglob("*.parquet")}
    assert after == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ds")] == []  # no temp folder left behind
    assert TrajectoryDataset.open(tmp_path / "ds").meta["counts"]["episodes"] == 5


def test_refuses_to_overwrite_without_asking(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [chat_record()])
    ingest([src], tmp_path / "ds")
    with pytest.raises(UserError, match="already exists.*--append"):
        ingest([src], tmp_path / "ds")


def test_custom_adapter(tmp_path, monkeypatch):
    (tmp_path / "my_adapter.py").write_text(
        textwrap.dedent("""
        from offline_agent.schema import Episode, Quarantined, Step

        def read(path, options):
            for n, line in enumerate(open(path)):
                parts = line.strip().split("|")
                if len(parts) != 3:
                    yield Quarantined(f"line {n + 1}", "expected task|action|result", line)
                    continue
                yield Episode(episode_id=f"x{n}", task=parts[0], outcome=1.0,
                              steps=[Step(observation="", action=parts[1], info={"result": parts[2]})])
    """)
    )
    (tmp_path / "log.txt").write_text("count|ls|3\nbroken line\n")
    monkeypatch.chdir(tmp_path)
    summary = ingest([tmp_path / "log.txt"], tmp_path / "ds", fmt="my_adapter:read")
    assert (summary.total("episodes"), summary.total("quarantined"), summary.reconciles) == (1, 1, True)
    assert TrajectoryDataset.open(tmp_path / "ds").steps_table()["action"].to_pylist() == ["ls"]
    with pytest.raises(UserError, match="has no function 'nope'"):
        ingest([tmp_path / "log.txt"], tmp_path / "ds2", fmt="my_adapter:nope")


def test_duckdb_catalog_file_opens_in_plain_duckdb(tmp_path):
    ingest([write_jsonl(tmp_path / "a.jsonl", [chat_record(), chat_record(reward=0.0)])], tmp_path / "ds")
    con = duckdb.connect(str(tmp_path / "ds" / "catalog.duckdb"), read_only=True)
    assert con.execute("SELECT count(*), sum(success::INT) FROM episodes").fetchone() == (2, 1)
    assert con.execute("SELECT count(*) FROM steps").fetchone() == (6,)


def test_polars_lazy_frames(tmp_path):
    import polars as pl

    ingest([write_jsonl(tmp_path / "a.jsonl", [chat_record(), chat_record(reward=0.0)])], tmp_path / "ds")
    steps, episodes = TrajectoryDataset.open(tmp_path / "ds").lazy()
    assert isinstance(steps, pl.LazyFrame)
    assert steps.filter(pl.col("tool_name") == "retry").select(pl.len()).collect().item() == 4
    assert episodes.select(pl.col("success").sum()).collect().item() == 1
