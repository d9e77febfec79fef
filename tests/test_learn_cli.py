"""The `train` and `evaluate` verbs end to end, their errors, and evaluate's pure functions."""

from __future__ import annotations

import json

import learn_data
import polars as pl
import pytest
from learn_envs import SPEC
from typer.testing import CliRunner

from offline_agent.cli import app
from offline_agent.evaluate import recovery_lengths, summarize, wilson_interval
from offline_agent.learn.grounding import GROUNDING_FEATURES
from offline_agent.learn.policy import Policy
from offline_agent.online.play import EpisodeOutcome

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return learn_data.fresh_copy(tmp_path_factory.mktemp("cli") / "color_lock")


# --- pure functions ------------------------------------------------------------------------------------


def test_wilson_interval_exact_values():
    assert wilson_interval(8, 10) == pytest.approx((0.4901568467, 0.9433190520), abs=1e-9)
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.1611301255), abs=1e-9)
    assert wilson_interval(50, 100) == pytest.approx((0.4038298286, 0.5961701714), abs=1e-9)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    # all or none: the rate is an end of its own interval, exactly (rounding once gave 6/6 a top of 1 - 1e-16)
    assert [wilson_interval(n, n)[1] for n in range(1, 60)] == [1.0] * 59
    assert [wilson_interval(0, n)[0] for n in range(1, 60)] == [0.0] * 59


def test_recovery_lengths_count_steps_from_an_error_to_the_next_clean_step():
    assert recovery_lengths([False, True, False]) == ([1], 0)
    assert recovery_lengths([True, True, False, True, False, True]) == ([2, 1], 1)
    assert recovery_lengths([]) == ([], 0)


def test_summarize_reports_rates_intervals_and_recovery():
    outcomes = [
        EpisodeOutcome(0, True, 1.0, 0.98, 3, (False, True, False)),
        EpisodeOutcome(1, False, 0.0, 0.0, 2, (True, True)),
    ]
    report = summarize(outcomes, "p", "e", 0.99)
    assert report.success_rate == 0.5 and report.ci95 == wilson_interval(1, 2)
    assert report.mean_steps == 2.5 and report.error_rate == 3 / 5
    assert (report.recoveries, report.unrecovered, report.mean_retries_to_recover) == (1, 1, 1.0)
    assert json.loads(json.dumps(report.to_dict()))["ci95"] == list(report.ci95)


# --- the verbs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["cql", "bc", "filtered-bc", "d3rlpy-cql"])
def test_train_then_evaluate_every_algorithm(algo, dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written to the working directory
    run = tmp_path / "run"
    result = runner.invoke(
        app, ["train", str(dataset), "--algo", algo, "--out", str(run), "--steps", "20", "--batch-size", "16",
              "--seed", "1", "--k", "0"],
    )
    assert result.exit_code == 0, result.output
    assert f"trained {algo} for 20 steps" in result.output and ", 0 encoded)" in result.output
    assert (run / "curves.png").stat().st_size > 1000
    assert pl.read_parquet(run / "metrics.parquet")["step"].max() == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    result = runner.invoke(app, ["evaluate", str(run), "--env", SPEC, "--episodes", "6", "--seed", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["episodes"] == 6 and 0 <= report["ci95"][0] <= report["success_rate"] <= report["ci95"][1]
    assert {"mean_return", "mean_steps", "mean_retries_to_recover"} <= set(report)


def test_train_with_a_tuned_encoder_then_evaluate(dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    result = runner.invoke(
        app, ["train", str(dataset), "--algo", "bc", "--out", str(run), "--steps", "10", "--batch-size", "8",
              "--k", "0", "--tune-encoder-layers", "1", "--encoder-lora-rank", "2", "--encoder-action-gradient",
              "--encoder-lr", "1e-3"],
    )
    assert result.exit_code == 0, result.output
    tuning = json.loads((run / "train.json").read_text())["encoder_tuning"]
    assert (tuning["layers"], tuning["lora_rank"], tuning["action_gradient"]) == (1, 2, True)
    assert json.loads((run / "policy.json").read_text())["config"]["encoder_learning_rate"] == 1e-3
    assert (run / "encoder.safetensors").is_file()
    result = runner.invoke(app, ["evaluate", str(run), "--env", SPEC, "--episodes", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["episodes"] == 2


def test_train_a_grounded_policy_then_evaluate_it_with_fqe(dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    result = runner.invoke(
        app, ["train", str(dataset), "--out", str(run), "--steps", "20", "--batch-size", "16", "--k", "0",
              "--grounding", "--keep-opening"],
    )
    assert result.exit_code == 0, result.output
    policy = json.loads((run / "policy.json").read_text())
    assert policy["config"]["grounding"] is True and policy["network"]["pair_dim"] == len(GROUNDING_FEATURES)
    # The renderer's settings travel with the policy, so that it plays on the states it was trained on.
    assert (policy["k"], policy["keep_opening"]) == (0, True)
    assert Policy.load(run).state_settings.keep_opening is True
    result = runner.invoke(app, ["evaluate", str(run), "--env", SPEC, "--episodes", "2", "--json",
                                 "--dataset", str(dataset), "--fqe-steps", "10"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["episodes"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    result = runner.invoke(app, ["train", str(dataset), "--algo", "bc", "--out", str(tmp_path / "plain"), "--steps",
                                 "5", "--k", "0", "--no-grounding"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "plain" / "policy.json").read_text())["network"]["pair_dim"] == 0


def test_train_with_the_observation_view_then_evaluate_it_with_the_encoder_folder(dataset, tmp_path):
    from offline_agent.text.encoder import default_encoder_path

    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(dataset), "--out", str(run), "--steps", "10", "--k", "1",
                                 "--observation-view"])
    assert result.exit_code == 0, result.output
    wanted = json.loads((run / "policy.json").read_text())["encoder"]
    assert (wanted["observation_view"], wanted["dim"], wanted["id"].endswith("-obsview")) == (True, 768, True)
    policy = Policy.load(run)
    assert (policy.encoder.observation_view, policy.encoder.id) == (True, wanted["id"])
    # A model folder given by the user is loaded with the checkpoint's settings, the view included.
    result = runner.invoke(app, ["evaluate", str(run), "--env", SPEC, "--episodes", "2", "--json",
                                 "--encoder", default_encoder_path()])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["episodes"] == 2


def test_the_learner_bootstraps_at_its_own_discount_and_values_are_reported_at_the_logs(dataset, tmp_path):
    from offline_agent.dataset import TrajectoryDataset
    from offline_agent.evaluate import reported_gamma
    from offline_agent.learn.cql import DEFAULT_GAMMA
    from offline_agent.learn.train import SUMMARY_FILE

    logs_gamma = TrajectoryDataset.open(dataset).gamma
    assert logs_gamma not in (DEFAULT_GAMMA, 0.9)
    for args, learner_gamma in (([], DEFAULT_GAMMA), (["--gamma", "0.9"], 0.9)):
        run = tmp_path / f"run{learner_gamma}"
        result = runner.invoke(app, ["train", str(dataset), "--out", str(run), "--steps", "5", "--k", "0", *args])
        assert result.exit_code == 0, result.output
        meta = json.loads((run / "policy.json").read_text())
        assert (meta["config"]["gamma"], meta["dataset"]["gamma"]) == (learner_gamma, logs_gamma)
        # The logs' value network predicts the logs' own returns, whatever the policy's learner discounts with.
        summary = json.loads((run / SUMMARY_FILE).read_text())
        assert summary["value_network"]["config"]["gamma"] == logs_gamma
        assert reported_gamma(meta) == logs_gamma
    result = runner.invoke(app, ["evaluate", str(run), "--env", SPEC, "-n", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["gamma"] == logs_gamma
    # A checkpoint written before policy.json recorded the logs' discount trained at it: its config's.
    assert reported_gamma({"config": {"gamma": 0.97}, "dataset": {"name": "old"}}) == 0.97


def test_evaluate_prints_a_summary_and_estimates_fqe_on_held_out_logs(dataset, tmp_path):
    run = tmp_path / "run"
    assert runner.invoke(app, ["train", str(dataset), "--out", str(run), "--steps", "10", "--k", "0"]).exit_code == 0
    result = runner.invoke(app, ["evaluate", str(run), "--env", SPEC, "-n", "4", "--dataset", str(dataset),
                                 "--fqe-steps", "20"])
    assert result.exit_code == 0, result.output
    assert "cql" in result.stdout and "success rate" in result.stdout and "95% CI" in result.stdout
    assert "FQE on" in result.stdout and "held-out episodes" in result.stdout
    assert "3 refits" in result.stdout and "coverage" in result.stdout
    assert "The logs' value predicts these episodes' success with ROC AUC" in result.stdout
    assert "Whatever the policy does where the logs do not show its choice, its value lies in" in result.stdout
    result = runner.invoke(app, ["evaluate", str(run), "--dataset", str(dataset), "--fqe-steps", "20",
                                 "--fqe-runs", "2", "--json"])
    fqe = json.loads(result.stdout)["fqe"]
    low, high = fqe["fqe_ci95"]
    assert fqe["fqe_runs"] == 2 and low < fqe["fqe_value"] < high and 0.0 <= fqe["coverage"] <= 1.0
    # The value is the fit on the test split itself, not the mean of the refits on its resamples.
    from offline_agent.learn.features import build_features
    from offline_agent.learn.fqe import FQEConfig, fitted_q_evaluation
    from offline_agent.learn.policy import Policy

    policy = Policy.load(run)
    features = build_features(dataset, policy.encoder, policy.state_settings)
    fit = fitted_q_evaluation(features, policy.network, FQEConfig(steps=20, seed=0, tau=policy.tau))
    assert fqe["fqe_value"] == fit.value and fqe["fqe_grounding"] is False
    # --fqe-grounding: the same fit with a Q that reads each pair's grounding.
    grounded = json.loads(runner.invoke(app, ["evaluate", str(run), "--dataset", str(dataset), "--fqe-steps", "20",
                                              "--fqe-runs", "0", "--no-fqe-bounds", "--fqe-grounding",
                                              "--json"]).stdout)["fqe"]
    fit = fitted_q_evaluation(features, policy.network, FQEConfig(steps=20, seed=0, tau=policy.tau, grounding=True))
    assert grounded["fqe_grounding"] is True and grounded["fqe_value"] == fit.value != fqe["fqe_value"]
    bound_low, bound_high = fqe["fqe_bounds"]
    assert bound_low <= fqe["fqe_value"] <= bound_high
    returns = features.returns_to_go(features.gamma)
    assert fqe["logged_returns"] == [float(returns.min()), float(returns.max())]
    low, high = fqe["value_auc_ci95"]
    assert 0.0 <= low <= fqe["value_auc"] <= high <= 1.0 and 0.0 <= fqe["value_auc_per_step"] <= 1.0


def test_evaluate_a_behaviour_policy_spec():
    result = runner.invoke(app, ["evaluate", "behaviour:expert", "--env", SPEC, "-n", "5", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["success_rate"] == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "{ds}", "--out", "{tmp}/r", "--alpha", "-1"], "alpha must be >= 0, got -1.0"),
        (["train", "{ds}", "--out", "{tmp}/r", "--algo", "sac"], "unknown algorithm 'sac'"),
        (["train", "{tmp}/missing", "--out", "{tmp}/r"], "is not a dataset"),
        (["train", "{ds}", "--out", "{tmp}/r", "--algo", "bc", "--alpha", "1"], "drop --alpha"),
        (["train", "{ds}", "--out", "{tmp}/r", "--algo", "d3rlpy-cql", "--tune-encoder-layers", "1"],
         "has no setting tune_encoder_layers"),
        (["train", "{ds}", "--out", "{tmp}/r", "--algo", "d3rlpy-cql", "--no-grounding"], "has no setting grounding"),
        (["train", "{ds}", "--out", "{tmp}/r", "--tune-encoder-layers", "9"], "between 1 and the encoder's 6 layers"),
        (["train", "{ds}", "--out", "{tmp}/r", "--tune-encoder-layers", "1", "--observation-view"],
         "--tune-encoder-layers tunes the encoder over whole state texts: drop --observation-view"),
        (["evaluate", "{tmp}", "--env", SPEC], "holds no policy checkpoint"),
        (["evaluate", "{tmp}"], "evaluate needs --env ENV"),
        (["evaluate", "{tmp}", "--dataset", "{ds}", "--fqe-runs", "-1"], "--fqe-runs must be 0 or more, got -1"),
        (["evaluate", "behaviour:sometimes", "--env", SPEC], "unknown policy 'sometimes'"),
        (["evaluate", "behaviour:expert", "--env", "no_such_module:env"], "cannot import module"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, message, dataset, tmp_path):
    args = [a.format(ds=dataset, tmp=tmp_path) for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1


def test_the_fqe_summary_warns_on_low_coverage_and_on_a_small_test_split():
    from offline_agent.cli import _fqe_summary

    def summary(coverage, episodes):
        return _fqe_summary({"episodes": episodes, "dataset": "data/x", "split": "test", "fqe_value": 0.5,
                             "fqe_ci95": [0.4, 0.6], "fqe_runs": 3, "behaviour_value": 0.3, "gamma": 0.99,
                             "coverage": coverage, "coverage_k": 10})

    assert "Do not act" not in summary(0.85, 73) and "coverage 0.85 of the policy's choices" in summary(0.85, 73)
    low = summary(0.45, 73)
    assert low.endswith("Do not act on this value: coverage 0.45 < 0.5: FQE extrapolates to actions the logs "
                        "rarely show there")
    few = summary(0.81, 16)  # PipelineRepair from 150 logs: well covered, and 0.15 off the simulated value
    assert few.endswith("Do not act on this value: only 16 held-out episodes (< 50): too few to act on, "
                        "whatever the interval")
    # Never "0.50 < 0.5", nor "coverage 0.50 of the policy's choices" in the sentence before it.
    assert "coverage 0.497 of the policy's choices" in summary(0.497, 73)
    assert "coverage 0.497 < 0.5:" in summary(0.497, 73)
    assert "coverage 0.4999 < 0.5:" in summary(0.49993, 73) and "coverage 0.49 < 0.5:" in summary(0.494, 73)
    both = summary(0.34, 16)
    assert "coverage 0.34 < 0.5" in both and "; only 16 held-out episodes" in both


def test_the_fqe_summary_warns_when_the_value_lies_outside_the_logs_returns():
    from offline_agent.cli import _fqe_summary
    from offline_agent.evaluate import fqe_doubt_reasons, outside_logged_returns

    # tau-bench airline's returns lie in [0, 1]; a fit on int8 vectors claimed 32.3 (1.05 on fp32 ones).
    assert outside_logged_returns(32.307, (0.0, 1.0)) and outside_logged_returns(1.05, (0.0, 1.0))
    assert outside_logged_returns(-0.0101, (0.0, 1.0)) and outside_logged_returns(2.04, (-1.0, 2.0))
    assert outside_logged_returns(2.02, (-1.0, 2.0)) is False  # 1% of a width of 3
    # 1% of the range is noise, not a claim; an unknown range or value checks nothing.
    assert not any(outside_logged_returns(v, (0.0, 1.0)) for v in (0.0, 1.0, 1.01, -0.01, float("nan")))
    assert not outside_logged_returns(32.0, (float("nan"), float("nan")))
    assert fqe_doubt_reasons(0.9, 73, 32.307, (0.0, 1.0)) == [
        ("the value 32.307 lies outside the logs' discounted returns (0.000 to 1.000)",
         "the fit extrapolated past anything the logs hold")
    ]
    report = {"episodes": 73, "dataset": "data/x", "split": "test", "fqe_value": 32.307, "fqe_ci95": [8.1, 56.5],
              "fqe_runs": 3, "behaviour_value": 0.3, "gamma": 0.99, "coverage": 0.9, "coverage_k": 10,
              "logged_returns": [0.0, 1.0]}
    assert _fqe_summary(report).endswith(
        "Do not act on this value: the value 32.307 lies outside the logs' discounted returns (0.000 to 1.000): "
        "the fit extrapolated past anything the logs hold")
    del report["logged_returns"]  # a JSON written before evaluate recorded the range
    assert "Do not act" not in _fqe_summary(report)


def test_a_figure_below_a_line_gets_the_digits_that_show_it_and_one_above_keeps_two():
    from offline_agent.evaluate import digits_below

    assert [digits_below(v, 0.5) for v in (0.45, 0.497, 0.49993, 0.5, 0.81)] == ["0.45", "0.497", "0.4999", "0.50",
                                                                                  "0.81"]
