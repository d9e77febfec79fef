"""`simulate` and `rollout`: the logs a behaviour policy leaves, in the OpenAI chat format, and the CLI verb."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from offline_agent.actions import canonical_action
from offline_agent.cli import app
from offline_agent.envs import make_env, make_policy
from offline_agent.errors import UserError
from offline_agent.simulate import episode_seed, rollout, simulate, wilson_interval

RECORD_KEYS = {"episode_id", "env", "policy", "seed", "task", "messages", "reward", "success", "n_steps", "truncated"}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_record(record: dict) -> None:
    """One log line follows the documented OpenAI chat format, and its outcome adds up."""
    assert RECORD_KEYS <= set(record)
    messages = record["messages"]
    assert messages[0] == {"role": "system", "content": record["task"]}
    assert messages[1]["role"] == "user" and isinstance(messages[1]["content"], str)
    turns = messages[2:]
    assert len(turns) == 2 * record["n_steps"]
    total = 0.0
    for k, (action, result) in enumerate(zip(turns[0::2], turns[1::2], strict=True)):
        assert action["role"] == "assistant" and all(isinstance(c, str) for c in action["candidates"])
        if action.get("tool_calls"):
            assert action["content"] is None
            (tool_call,) = action["tool_calls"]
            assert tool_call["id"] == f"call_{k}" and tool_call["type"] == "function"
            assert isinstance(json.loads(tool_call["function"]["arguments"]), dict)
            assert canonical_action(tool_call) in action["candidates"]
            assert result["role"] == "tool" and result["tool_call_id"] == tool_call["id"]
            assert result["name"] == tool_call["function"]["name"]
        else:
            assert action["content"] in action["candidates"] and result["role"] == "user"
        assert isinstance(result["content"], str) and isinstance(result["is_error"], bool)
        assert {"sub_goals_done", "sub_goals_total"} <= set(result["info"])
        total += result["reward"]
    assert record["reward"] == total == (1.0 if record["success"] else 0.0)


@pytest.mark.parametrize(
    "env_id", ["offline_agent/PipelineRepair-v0", "offline_agent/Logistics-v0", "offline_agent/CustomerSupport-v0"]
)
def test_simulate_writes_one_valid_chat_record_per_episode(tmp_path, env_id):
    out = tmp_path / "logs" / "sim.jsonl"
    summary = simulate(env_id, 12, "noisy:0.5", 7, out)
    records = read_jsonl(out)
    assert len(records) == summary.episodes == 12
    assert [r["episode_id"] for r in records] == [f"{env_id}-7-{i}" for i in range(12)]
    assert {(r["env"], r["policy"], r["seed"]) for r in records} == {(env_id, "noisy:0.5", 7)}
    for record in records:
        check_record(record)
    assert summary.successes == sum(r["success"] for r in records)
    assert summary.steps == sum(r["n_steps"] for r in records)
    assert list(tmp_path.joinpath("logs").iterdir()) == [out]  # no temporary file left behind


def test_support_logs_hold_messages_answered_by_the_user(tmp_path):
    out = tmp_path / "support.jsonl"
    simulate("offline_agent/CustomerSupport-v0", 3, "expert", 0, out)
    record = read_jsonl(out)[0]
    first_action, answer = record["messages"][2:4]
    assert first_action["role"] == "assistant" and "email address" in first_action["content"]
    assert "tool_calls" not in first_action
    assert answer["role"] == "user" and answer["content"].startswith("Customer: It's ")


def test_same_seed_same_file(tmp_path):
    a, b, c = (tmp_path / f"{n}.jsonl" for n in "abc")
    simulate("offline_agent/Logistics-v0", 5, "llm-like", 3, a)
    simulate("offline_agent/Logistics-v0", 5, "llm-like", 3, b)
    simulate("offline_agent/Logistics-v0", 5, "llm-like", 4, c)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_runs_with_different_seeds_do_not_share_episodes():
    seeds = {episode_seed(s, i) for s in range(3) for i in range(1000)}
    assert len(seeds) == 3000


def test_a_failed_run_leaves_no_file(tmp_path):
    out = tmp_path / "crash.jsonl"
    with pytest.raises(RuntimeError, match="simulator crashed"):
        simulate("user_envs:make_count_to", 5, "random", 0, out, explode_after_resets=3)
    assert list(tmp_path.iterdir()) == []


def test_simulate_rejects_bad_input(tmp_path):
    with pytest.raises(UserError, match="--episodes must be at least 1"):
        simulate("offline_agent/Logistics-v0", 0, "random", 0, tmp_path / "x.jsonl")
    with pytest.raises(UserError, match="unknown policy"):
        simulate("offline_agent/Logistics-v0", 1, "greedy", 0, tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()


def test_rollout_counts_retries_and_recoveries_for_user_environments():
    env = make_env("user_envs:make_count_to", target=1)
    # "done" too early fails, the repeated "done" still fails (a retry), "up" then "done" recovers
    script = iter([1, 1, 0, 1])
    (result,) = rollout(env, lambda env, observation: next(script), episodes=1)
    assert result.success and result.n_steps == 4 and result.n_errors == 2
    assert result.retries == 1 and result.recoveries == 1
    assert result.messages is None


def test_wilson_interval():
    low, high = wilson_interval(30, 100)
    assert low == pytest.approx(0.2189, abs=1e-4) and high == pytest.approx(0.3958, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


def test_cli_simulate_prints_the_success_rate(tmp_path):
    out = tmp_path / "logs.jsonl"
    args = ["simulate", "offline_agent/PipelineRepair-v0", "--episodes", "6", "--policy", "expert", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "wrote 6 episodes" in result.output
    assert "policy expert on offline_agent/PipelineRepair-v0: success rate 1.000 (95% CI 0.610-1.000)" in result.output
    assert len(read_jsonl(out)) == 6


def test_cli_simulate_bad_environment_is_a_one_line_error(tmp_path):
    command = [sys.executable, "-m", "offline_agent.cli", "simulate", "NoSuchEnv-v9", "--out", str(tmp_path / "x")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("error: unknown environment 'NoSuchEnv-v9'") and "Traceback" not in done.stderr


def test_policies_are_reproducible_from_their_seed():
    env = make_env("offline_agent/CustomerSupport-v0")
    first = [r.n_steps for r in rollout(env, make_policy("noisy:0.5", 1), 10, seed=2)]
    again = [r.n_steps for r in rollout(env, make_policy("noisy:0.5", 1), 10, seed=2)]
    assert first == again


def test_simulated_logs_ingest_without_loss(tmp_path):
    from offline_agent.dataset import TrajectoryDataset
    from offline_agent.ingest import ingest

    pipeline, support = tmp_path / "pipeline.jsonl", tmp_path / "support.jsonl"
    simulate("offline_agent/PipelineRepair-v0", 8, "llm-like", 0, pipeline)
    simulate("offline_agent/CustomerSupport-v0", 8, "noisy:0.5", 0, support)
    records = read_jsonl(pipeline) + read_jsonl(support)
    summary = ingest([pipeline, support], tmp_path / "dataset")
    assert summary.reconciles and summary.total("quarantined") == 0
    steps = TrajectoryDataset.open(tmp_path / "dataset").sql(
        "SELECT action_kind, is_error, len(candidates) AS n_candidates FROM steps"
    )
    assert steps.height == sum(r["n_steps"] for r in records)
    assert steps["n_candidates"].min() == 8
    errors = sum(m.get("is_error", False) for r in records for m in r["messages"])
    assert steps["is_error"].sum() == errors
    assert set(steps["action_kind"]) >= {"tool_call", "message"}
