"""Ingestion of real agent logs written by other teams (../shared/data/real), checked against their sources."""

from __future__ import annotations

import json

import pytest

from offline_agent.actions import canonical_action
from offline_agent.dataset import TrajectoryDataset
from offline_agent.ingest import ingest


def _steps_of(ds: TrajectoryDataset, episode_id: str):
    return ds.sql(
        f"SELECT step, observation, action, info FROM steps WHERE episode_id = '{episode_id}' ORDER BY step"
    ).to_dicts()


def test_tau_bench_airline_200_episodes_84_successes(real_data, tmp_path):
    source = real_data / "tau_bench_airline" / "gpt-4o-airline.json"
    summary = ingest([source], tmp_path / "tau")
    ds = TrajectoryDataset.open(tmp_path / "tau")
    assert summary.sources[0].format == "openai-chat"
    assert summary.reconciles and summary.total("quarantined") == 0
    counts = ds.sql("SELECT count(*) AS n, count(*) FILTER (WHERE outcome = 1) AS wins FROM episodes").row(0)
    assert counts == (200, 84)

    # Round trip: every assistant tool call / message of a sample of episodes, in order, is a step.
    records = json.loads(source.read_text())
    episodes = ds.sql("SELECT episode_id, metadata FROM episodes").to_dicts()
    by_index = {json.loads(e["metadata"])["task_id"] * 10 + json.loads(e["metadata"])["trial"]: e for e in episodes}
    for record in records[::25]:
        expected = []
        for m in record["traj"]:
            if m["role"] == "assistant":
                if m.get("tool_calls"):
                    expected += [canonical_action(c) for c in m["tool_calls"]]
                elif m.get("content"):
                    expected.append(m["content"])
        episode = by_index[record["task_id"] * 10 + record["trial"]]
        steps = _steps_of(ds, episode["episode_id"])
        assert [s["action"] for s in steps] == expected
        tool_results = [m["content"] for m in record["traj"] if m["role"] == "tool"]
        seen = "\n".join(s["observation"] for s in steps)
        assert all(r in seen for r in tool_results)


def test_intercode_bash_200_episodes_1176_steps_with_round_trip(real_data, tmp_path):
    folder = real_data / "intercode" / "bash_gpt-4"
    summary = ingest([folder], tmp_path / "bash", reward="score-delta")
    ds = TrajectoryDataset.open(tmp_path / "bash")
    assert summary.total("episodes") == 200 and summary.total("steps") == 1176
    assert ds.meta["counts"] == {"episodes": 200, "steps": 1176, "quarantined": 0}
    assert summary.sources[0].format == "parallel-lists"

    source = sorted(folder.glob("*.json"))[0]
    records = json.loads(source.read_text())
    for key in list(records)[::15]:
        history = records[key]["turn_history"]
        eid = ds.sql(
            f"SELECT episode_id FROM episodes WHERE source = '{source}' AND json_extract(metadata, '$.task_id') = "
            f"{records[key]['task_id']}"
        ).item()
        steps = _steps_of(ds, eid)
        assert [s["action"] for s in steps] == history["actions"]
        # observation i is what action i-1 returned; the last one is kept on the last step
        assert [s["observation"] for s in steps[1:]] == history["observations"][:-1]
        assert json.loads(steps[-1]["info"])["final_observation"] == history["observations"][-1]


def test_intercode_score_delta_rewards_sum_to_the_final_score(real_data, tmp_path):
    ingest([real_data / "intercode" / "bash_gpt-4"], tmp_path / "bash", reward="score-delta", gamma=1.0)
    ds = TrajectoryDataset.open(tmp_path / "bash")
    mismatches = ds.sql(
        """SELECT count(*) FROM steps s JOIN episodes e USING (episode_id)
           WHERE s.step = 0 AND abs(s.return_to_go - e."return") > 1e-5"""
    ).item()
    assert mismatches == 0
    final_scores = ds.sql(
        """SELECT e."return", json_extract(s.info, '$.score')::DOUBLE AS score FROM episodes e
           JOIN steps s ON s.episode_id = e.episode_id AND s.step = e.n_steps - 1"""
    )
    assert (final_scores["return"] - final_scores["score"]).abs().max() < 1e-5


def test_intercode_sql_1034_episodes_5867_steps(real_data, tmp_path):
    summary = ingest([real_data / "intercode" / "sql_gpt-4"], tmp_path / "sql", reward="score-delta")
    assert (summary.total("episodes"), summary.total("steps"), summary.total("quarantined")) == (1034, 5867, 0)
    ds = TrajectoryDataset.open(tmp_path / "sql")
    errors = ds.sql("SELECT count(*) FILTER (WHERE is_error) AS e, count(*) AS n FROM steps").row(0)
    assert 0 < errors[0] < errors[1]  # invalid actions (valid_action false) are flagged


@pytest.mark.parametrize("reward", ["outcome", "per-step"])
def test_reward_modes_on_real_logs_keep_the_counts(real_data, tmp_path, reward):
    summary = ingest([real_data / "intercode" / "bash_gpt-4"], tmp_path / reward, reward=reward)
    assert summary.total("steps") == 1176 and summary.reconciles
