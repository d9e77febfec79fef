"""`advise`: where a trained policy disagrees with the logs, per tool and situation. The grouping on hand-built
steps, then the verb on the bundled PipelineRepair logs (OpenAI chat format) with a real CQL policy."""

from __future__ import annotations

import csv
import json
import math

import learn_data
import numpy as np
import pytest
from typer.testing import CliRunner

from offline_agent.advise import (
    AFTER_ERROR,
    AFTER_RESULT,
    FIRST,
    MESSAGE,
    action_kind,
    action_label,
    advice_candidates,
    advise,
    group_advice,
    most_frequent_actions,
    situations,
)
from offline_agent.cli import app

runner = CliRunner()


def test_actions_read_as_calls_or_messages():
    assert action_label('{"name":"retry","arguments":{"stage":2}}') == 'retry("stage":2)'
    assert action_label("All   fixed,\\nthanks.") == "say: All fixed,\\nthanks."
    assert action_label("x" * 100, width=10) == "say: xx..."


def test_steps_are_grouped_by_tool_or_by_the_first_word_of_a_text_action():
    assert action_kind("retry", '{"name":"retry","arguments":{}}') == "retry"
    assert action_kind(None, "SELECT name FROM t;") == "say select"
    assert action_kind(None, "'ls' -la") == "say ls"
    assert action_kind(None, "  ") == MESSAGE


def test_without_logged_candidates_the_most_frequent_actions_compete():
    assert most_frequent_actions(np.array([2, 0, 2, 1, 1, 3]), 5, 3).tolist() == [1, 2, 0]  # 1 and 2 tie: 1 first
    assert most_frequent_actions(np.array([4]), 5, 9).tolist() == [4, 0, 1, 2, 3]


def test_situations_come_from_the_step_index_and_the_previous_error():
    assert situations(np.array([0, 1, 2, 0]), np.array([True, True, False, True])) == [
        FIRST, AFTER_ERROR, AFTER_RESULT, FIRST
    ]


def test_groups_are_ranked_by_the_value_left_on_the_table():
    tools = ["retry", "retry", "retry", MESSAGE, "retry"]
    where = [AFTER_ERROR, AFTER_ERROR, AFTER_ERROR, AFTER_RESULT, FIRST]
    logged = np.array([0, 0, 0, 2, 0])
    chosen = np.array([1, 3, 1, 2, 0])
    gap = np.array([0.5, 0.25, 0.5, 0.0, 0.0])
    success = np.array([1.0, 0.0, np.nan, 1.0, 0.0])
    labels = ["retry()", "rollback()", "say: done", "inspect()"]
    first, second, third = group_advice(tools, where, logged, chosen, gap, success, labels)
    assert first.tool == "retry" and first.situation == AFTER_ERROR
    assert (first.steps, first.disagreements, first.value_gap, first.mean_gap) == (3, 3, 1.25, 1.25 / 3)
    assert (first.instead, first.instead_share, first.episode_success) == ("rollback()", 2 / 3, 0.5)
    # No gap in either: the larger group first, then by name.
    assert (second.tool, second.situation, second.disagreements, second.instead) == (MESSAGE, AFTER_RESULT, 0, "")
    assert (third.tool, third.situation, third.instead_share) == ("retry", FIRST, 0.0)


@pytest.fixture(scope="module")
def pipeline():
    return learn_data.pipeline_run()


def test_advice_on_logs_agrees_with_the_policy_step_by_step(pipeline, one_torch_thread):
    from offline_agent.dataset import TrajectoryDataset
    from offline_agent.learn.features import build_features
    from offline_agent.learn.policy import Policy

    advice = advise(pipeline["data"], pipeline["run"])
    assert advice == advise(pipeline["data"], pipeline["run"])  # stable: the same ranking every time
    steps = TrajectoryDataset.open(pipeline["data"]).steps_table()
    assert sum(a.steps for a in advice) == steps.num_rows
    assert [a.value_gap for a in advice] == sorted((a.value_gap for a in advice), reverse=True)
    # Each step's disagreement, recomputed from the policy's own scoring of the state text and candidates.
    policy = Policy.load(pipeline["run"])
    features = build_features(pipeline["data"], policy.encoder, policy.state_settings)
    ids, mask = advice_candidates(features, features.rows(), alternatives=256)
    actions = [features.vocab[i] for i in features.action_id.tolist()]
    episode = features.episode_index.tolist()
    disagree = 0
    for row in range(features.n_steps):
        candidates = [features.vocab[i] for i in ids[row][mask[row]].tolist()]
        taken = [actions[r] for r in range(row) if episode[r] == episode[row]]  # what grounding checks repeats of
        q = policy.score_batch([features.state_texts[row]], [candidates], [taken])[0]
        disagree += candidates[int(np.argmax(q))] != actions[row]
    assert sum(a.disagreements for a in advice) == disagree
    assert all(0 <= a.episode_success <= 1 or math.isnan(a.episode_success) for a in advice)


def test_advice_does_not_depend_on_the_order_of_the_steps_on_disk(pipeline, tmp_path, one_torch_thread):
    import pyarrow as pa

    from offline_agent.dataset import TrajectoryDataset, write_dataset

    ds = TrajectoryDataset.open(pipeline["data"])
    steps = ds.steps_table()
    meta = {k: v for k, v in ds.meta.items() if k not in ("counts", "fingerprint")}
    shuffled = tmp_path / "shuffled"  # the same steps, last first, as logs ingested unsorted are
    write_dataset(shuffled, steps.take(pa.array(range(steps.num_rows - 1, -1, -1))), ds.episodes_table(), None, meta)
    on_disk = TrajectoryDataset.open(shuffled)
    assert on_disk.steps_table(columns=["tool_name", "is_error"]) == steps.select(["tool_name", "is_error"])
    assert advise(shuffled, pipeline["run"]) == advise(pipeline["data"], pipeline["run"])


def test_cli_prints_the_table_and_writes_the_csv(pipeline, tmp_path, one_torch_thread):
    out = tmp_path / "advice.csv"
    args = [str(pipeline["data"]), str(pipeline["run"])]
    result = runner.invoke(app, ["advise", *args, "--top", "3", "--csv", str(out)])
    assert result.exit_code == 0, result.output
    assert "Where" in result.stdout and "value gap" in result.stdout
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert f"3 of {len(rows)} situations; all of them in {out}" in result.stdout
    listed = json.loads(runner.invoke(app, ["advise", *args, "--json"]).stdout)
    assert [(r["tool"], r["situation"], int(r["steps"])) for r in rows] == [
        (a["tool"], a["situation"], a["steps"]) for a in listed
    ]


@pytest.mark.parametrize("which", ["dataset", "run", "split"])
def test_bad_input_is_one_line(pipeline, tmp_path, which):
    args = [str(pipeline["data"]), str(pipeline["run"])]
    if which == "dataset":
        args[0] = str(tmp_path / "nope")
    elif which == "run":
        args[1] = str(tmp_path / "nope")
    else:
        args += ["--split", "holdout"]
    result = runner.invoke(app, ["advise", *args])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "nope" in result.stderr or "holdout" in result.stderr
