import json
import math
import sys

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from scipy import stats

from offline_agent.cli import main
from offline_agent.dataset import write_dataset
from offline_agent.drift import (
    DriftConfig,
    bin_proportions,
    chi_square_test,
    compare_datasets,
    compare_frames,
    ks_test,
    psi,
    psi_from_proportions,
    reference_bin_edges,
    two_proportion_test,
)
from offline_agent.errors import UserError
from offline_agent.schema import EPISODES_SCHEMA, STEPS_SCHEMA

# --- pure statistics: exact values -----------------------------------------------------------------


def test_psi_from_proportions_exact():
    got = psi_from_proportions(np.array([0.5, 0.3, 0.2]), np.array([0.4, 0.4, 0.2]))
    expected = (0.4 - 0.5) * math.log(0.4 / 0.5) + (0.4 - 0.3) * math.log(0.4 / 0.3) + 0.0
    assert got == pytest.approx(expected, abs=1e-15)
    assert got == pytest.approx(0.0510825624, abs=1e-10)


def test_psi_empty_bins_count_as_epsilon():
    got = psi_from_proportions(np.array([0.5, 0.5, 0.0]), np.array([0.5, 0.25, 0.25]), epsilon=1e-4)
    expected = 0.0 + (0.25 - 0.5) * math.log(0.25 / 0.5) + (0.25 - 1e-4) * math.log(0.25 / 1e-4)
    assert got == pytest.approx(expected, abs=1e-15)


def test_reference_bins_and_psi_of_a_sample():
    reference = np.arange(1.0, 11.0)
    edges = reference_bin_edges(reference, bins=5)
    np.testing.assert_array_equal(edges, [2, 4, 6, 8])  # bins (-inf,2] (2,4] (4,6] (6,8] (8,inf)
    np.testing.assert_array_equal(bin_proportions(reference, edges), [0.2] * 5)
    new = np.array([1, 1, 1, 1, 1, 6, 7, 8, 9, 10.0])
    np.testing.assert_array_equal(bin_proportions(new, edges), [0.5, 0.0, 0.1, 0.2, 0.2])
    expected = 0.3 * math.log(0.5 / 0.2) + (1e-4 - 0.2) * math.log(1e-4 / 0.2) + (-0.1) * math.log(0.1 / 0.2)
    assert psi(reference, new, bins=5) == pytest.approx(expected, abs=1e-12)
    assert psi(reference, reference, bins=5) == 0.0


def test_discrete_reference_gets_one_bin_per_value():
    reference = np.array([0.0] * 90 + [1.0] * 10)
    edges = reference_bin_edges(reference, bins=10)
    np.testing.assert_array_equal(edges, [0.0])
    np.testing.assert_array_equal(bin_proportions(np.array([0.0, 1.0, 1.0, 1.0]), edges), [0.25, 0.75])


def test_two_proportion_test_exact_and_equal_to_chi_square():
    z, p = two_proportion_test(30, 100, 50, 100)
    assert z == pytest.approx(0.2 / math.sqrt(0.4 * 0.6 * (1 / 100 + 1 / 100)), abs=1e-12)
    assert z == pytest.approx(2.8867513459, abs=1e-9)
    assert p == pytest.approx(2 * stats.norm.sf(z), abs=1e-15)
    chi2 = stats.chi2_contingency([[30, 70], [50, 50]], correction=False)
    assert p == pytest.approx(chi2.pvalue, rel=1e-9)
    assert two_proportion_test(0, 10, 0, 20) == (0.0, 1.0)


def test_ks_and_chi_square_on_identical_samples():
    assert ks_test(np.array([0.0, 1.0, 2.0]), np.array([0.0, 1.0, 2.0])) == (0.0, 1.0)
    statistic, p = chi_square_test(np.array([10, 20]), np.array([10, 20]))
    assert statistic == 0.0 and p == pytest.approx(1.0)
    assert chi_square_test(np.array([5, 0]), np.array([7, 0])) == (0.0, 1.0)  # one category: nothing to test


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"psi_threshold": 0}, "--psi-threshold must be > 0, got 0"),
        ({"p_threshold": 1.5}, "--p-threshold must be in \\(0, 1\\), got 1.5"),
        ({"bins": 1}, "--bins must be >= 2"),
        ({"min_count": 0}, "--min-count must be >= 1"),
    ],
)
def test_bad_config_messages(kwargs, message):
    with pytest.raises(UserError, match=message):
        DriftConfig(**kwargs)


# --- checks over two datasets ----------------------------------------------------------------------


def make_log(n_episodes=200, seed=0, reward_shift=0.0, fix_error_rate=0.1):
    """Steps and episodes tables: each episode calls `search` then `fix`; `fix` can fail."""
    rng = np.random.default_rng(seed)
    n = 2 * n_episodes
    episode_ids = np.repeat([f"ep{i:04d}" for i in range(n_episodes)], 2)
    reward = rng.normal(reward_shift, 1.0, size=n).astype(np.float32)
    search_errors = np.arange(n_episodes) % 5 == 0  # the same in every log: 20%
    fix_errors = rng.random(n_episodes) < fix_error_rate
    is_error = np.column_stack([search_errors, fix_errors]).ravel()
    steps = pa.table(
        {
            "episode_id": episode_ids,
            "step": pa.array(np.tile([0, 1], n_episodes), pa.int32()),
            "observation": ["obs"] * n,
            "action": ["call"] * n,
            "action_kind": ["tool_call"] * n,
            "tool_name": ["search", "fix"] * n_episodes,
            "tool_args": ["{}"] * n,
            "reward": reward,
            "return_to_go": np.zeros(n, np.float32),
            "terminated": np.tile([False, True], n_episodes),
            "truncated": [False] * n,
            "is_error": is_error,
            "candidates": pa.array([None] * n, pa.list_(pa.string())),
            "info": [None] * n,
        },
        schema=STEPS_SCHEMA,
    )
    returns = reward.reshape(n_episodes, 2).sum(axis=1)
    outcome = (returns > 0).astype(np.float64)
    episodes = pa.table(
        {
            "episode_id": episode_ids[::2],
            "source": ["log.jsonl"] * n_episodes,
            "task": ["t"] * n_episodes,
            "agent": [None] * n_episodes,
            "n_steps": pa.array([2] * n_episodes, pa.int32()),
            "return": returns,
            "success": outcome > 0,
            "outcome": outcome,
            "split": ["train"] * n_episodes,
            "metadata": [None] * n_episodes,
        },
        schema=EPISODES_SCHEMA,
    )
    return steps, episodes


def frames(steps, episodes):
    return pl.from_arrow(steps), pl.from_arrow(episodes)


def by_name(checks):
    return {(c.scope, c.metric): c for c in checks}


def test_identical_logs_show_no_drift():
    steps, episodes = frames(*make_log())
    checks = compare_frames(steps, episodes, steps, episodes)
    assert [(c.scope, c.metric) for c in checks] == [
        ("all", "reward"),
        ("all", "return"),
        ("all", "outcome"),
        ("all", "success_rate"),
        ("all", "error_rate"),
        ("all", "tool_mix"),
        ("tool:fix", "reward"),
        ("tool:fix", "error_rate"),
        ("tool:search", "reward"),
        ("tool:search", "error_rate"),
    ]
    assert not any(c.drift for c in checks)
    assert all(c.psi == 0.0 and c.p_value == pytest.approx(1.0) for c in checks)


def test_shifted_rewards_and_a_failing_tool_are_flagged():
    reference = frames(*make_log(seed=0))
    new = frames(*make_log(seed=1, reward_shift=1.0, fix_error_rate=0.5))
    checks = by_name(compare_frames(*reference, *new))
    for key in [("all", "reward"), ("all", "return"), ("tool:fix", "error_rate"), ("tool:fix", "reward")]:
        assert checks[key].drift, checks[key]
    assert checks[("all", "reward")].psi > 0.2 and checks[("all", "reward")].p_value < 1e-6
    assert "psi" in checks[("tool:fix", "error_rate")].reason
    assert not checks[("tool:search", "error_rate")].drift  # same errors in both logs
    assert not checks[("all", "tool_mix")].drift


def test_small_samples_are_reported_but_not_flagged():
    reference = frames(*make_log(n_episodes=9, seed=0))  # 18 steps, 9 episodes
    new = frames(*make_log(n_episodes=9, seed=1, reward_shift=5.0))
    check = by_name(compare_frames(*reference, *new, DriftConfig(min_count=20)))[("all", "reward")]
    assert not check.drift and check.reason == "too few samples (< 20)" and check.psi > 0.2


def test_a_tool_only_in_the_new_log_moves_the_tool_mix():
    reference_steps, episodes = frames(*make_log())
    new_steps = reference_steps.with_columns(
        pl.when(pl.col("tool_name") == "fix")
        .then(pl.lit("patch"))
        .otherwise(pl.col("tool_name"))
        .alias("tool_name")
    )
    checks = by_name(compare_frames(reference_steps, episodes, new_steps, episodes))
    assert checks[("all", "tool_mix")].drift
    assert checks[("tool:patch", "reward")].reason == "one side empty"
    assert checks[("tool:patch", "reward")].n_reference == 0


# --- the dataset-level function and the CLI verb ---------------------------------------------------


@pytest.fixture
def datasets(tmp_path):
    meta = {"gamma": 1.0, "reward": {"mode": "per-step"}, "sources": []}
    reference = write_dataset(tmp_path / "reference", *make_log(seed=0), None, meta)
    same = write_dataset(tmp_path / "same", *make_log(seed=0), None, meta)
    shifted = write_dataset(tmp_path / "shifted", *make_log(seed=1, reward_shift=1.0), None, meta)
    return reference.path, same.path, shifted.path


def run_cli(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["offline-agent", *map(str, args)])
    try:
        main()
    except SystemExit as exc:
        return exc.code
    return 0


def test_compare_datasets_reads_only_what_it_needs(datasets):
    reference, same, shifted = datasets
    assert not compare_datasets(reference, same).drift
    report = compare_datasets(reference, shifted)
    assert report.drift
    as_json = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert as_json["drift"] is True and as_json["config"]["psi_threshold"] == 0.2


def test_drift_cli_exit_codes_and_json(datasets, tmp_path, monkeypatch, capsys):
    reference, same, shifted = datasets
    assert run_cli(monkeypatch, "drift", reference, same) == 0
    assert "no drift (10 checks)" in capsys.readouterr().out

    assert run_cli(monkeypatch, "drift", reference, shifted, "--json") == 1
    out = capsys.readouterr().out
    report = json.loads(out)
    assert out.count("\n") == 1 and report["drift"] is True
    flagged = {(c["scope"], c["metric"]) for c in report["checks"] if c["drift"]}
    assert ("all", "reward") in flagged

    # a looser threshold on both tests lets the same shift pass
    assert (
        run_cli(monkeypatch, "drift", reference, shifted, "--psi-threshold", "100", "--p-threshold", "1e-300")
        == 0
    )
    capsys.readouterr()

    assert run_cli(monkeypatch, "drift", reference, tmp_path / "missing") == 2
    assert "is not a dataset" in capsys.readouterr().err
    assert run_cli(monkeypatch, "drift", reference, same, "--bins", "1") == 2
    assert "--bins must be >= 2" in capsys.readouterr().err
