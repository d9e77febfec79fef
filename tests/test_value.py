"""The logs' value network (`learn/value.py`): its loss by hand, that it learns the logged returns of ColorLock,
that a run saves it and every reader finds it (advise, evaluate --dataset, a fine-tuned run), and that a run
without one still reads."""

from __future__ import annotations

import math
import shutil

import learn_data
import pytest
import torch

from offline_agent.errors import UserError
from offline_agent.learn.policy import VALUE_FILE, load_checkpoint, load_value_network
from offline_agent.learn.value import ValueConfig, logged_values, predicted_returns, train_value, value_loss


def test_the_loss_is_the_mean_squared_error_to_the_return():
    predicted, returns = torch.tensor([0.5, 1.0, -1.0]), torch.tensor([0.0, 1.0, 1.0])
    assert value_loss(predicted, returns).item() == pytest.approx((0.25 + 0.0 + 4.0) / 3)


def test_bad_settings_name_the_fix():
    with pytest.raises(UserError, match="hidden width must be >= 1"):
        ValueConfig(hidden=0)
    with pytest.raises(UserError, match="steps must be >= 1"):
        ValueConfig(steps=0)


@pytest.fixture(scope="module")
def color_lock_value():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        features = learn_data.color_lock_features()
        network, history = train_value(features, ValueConfig(steps=600, batch_size=64, gamma=features.gamma))
    finally:
        torch.set_num_threads(threads)
    return features, network, history


def test_it_learns_a_return_that_the_action_decides():
    import dataclasses

    features = learn_data.color_lock_features()
    # Returns set by hand: 1 where the logged action's id is even, else 0; the vectors are the real ones.
    returns = (features.action_id % 2 == 0).float()
    features = dataclasses.replace(features, return_to_go=returns)
    torch.manual_seed(0)
    network, _ = train_value(features, ValueConfig(steps=300, batch_size=64, gamma=features.gamma))
    test = features.rows("test")
    assert (predicted_returns(network, features, test) - returns[test]).abs().max() < 0.2


def test_on_the_logged_returns_it_beats_the_mean(color_lock_value):
    features, network, history = color_lock_value
    test = features.rows("test")
    predicted, returns = predicted_returns(network, features, test), features.return_to_go[test]
    constant = (returns - features.return_to_go[features.rows("train")].mean()).pow(2).mean()
    # The noisy expert's future slips make most of a return unpredictable: the train split's mean return
    # misses the held-out steps by 0.240 in mean square, the network by 0.208.
    assert (predicted - returns).pow(2).mean() < 0.9 * constant
    assert history[-1]["value/loss"] < 0.8 * history[0]["value/loss"]
    assert [r["step"] for r in history][-1] == 600


def test_scores_come_in_chunks_as_in_one_batch(color_lock_value):
    features, network, _ = color_lock_value
    rows = torch.arange(50)
    with torch.no_grad():
        whole = logged_values(network, features.state_emb[rows], features.action_emb[features.action_id[rows]])
    torch.testing.assert_close(predicted_returns(network, features, rows, chunk=7), whole)


def test_a_run_saves_it_and_reads_it_back(one_torch_thread):
    run = learn_data.pipeline_run()["run"]
    rng = torch.get_rng_state()
    network = load_value_network(run)
    assert network is not None and network.n_heads == 1
    assert torch.equal(torch.get_rng_state(), rng)  # reading it draws nothing: a resumed fine-tune stays exact
    _, meta = load_checkpoint(run)
    assert meta["value_network"] == network.config()
    import polars as pl

    metrics = pl.read_parquet(run / "metrics.parquet")
    assert {"loss/td", "value/loss"} <= set(metrics.columns) and metrics["value/loss"].null_count() == 0


def test_a_run_without_one_reads_as_none_and_a_lost_file_is_named(tmp_path, one_torch_thread):
    from offline_agent.learn.train import train

    data = learn_data.pipeline_run()["data"]
    run = tmp_path / "run"
    train(data, "bc", run, steps=5, batch_size=8, encoder=learn_data.encoder(), value_head=False)
    assert not (run / VALUE_FILE).exists() and load_value_network(run) is None
    copy = tmp_path / "copy"
    shutil.copytree(learn_data.pipeline_run()["run"], copy)
    (copy / VALUE_FILE).unlink()
    with pytest.raises(UserError, match=f"{VALUE_FILE} is missing.*copy the whole run folder"):
        load_value_network(copy)


def test_advise_reports_each_situations_mean_predicted_return(one_torch_thread):
    from offline_agent.advise import advise
    from offline_agent.learn.features import build_features
    from offline_agent.learn.policy import Policy

    paths = learn_data.pipeline_run()
    advice = advise(paths["data"], paths["run"])
    policy = Policy.load(paths["run"], encoder=learn_data.encoder())
    features = build_features(paths["data"], policy.encoder, policy.state_settings)
    predicted = predicted_returns(load_value_network(paths["run"]), features, features.rows()).numpy()
    # The first-step situations' steps are the episodes' first rows: their mean is the group's figure.
    first = features.first_rows().numpy()
    tool_of_first = {a.tool for a in advice if a.situation == "first step"}
    assert sum(a.steps for a in advice if a.situation == "first step") == len(first)
    weighted = sum(a.predicted_return * a.steps for a in advice if a.situation == "first step") / len(first)
    assert weighted == pytest.approx(float(predicted[first].mean()), abs=1e-5)
    assert tool_of_first and all(math.isfinite(a.predicted_return) for a in advice)


def test_evaluate_scores_its_auc_for_the_held_out_episodes(color_lock_value):
    from offline_agent.evaluate import value_auc_on
    from offline_agent.learn.confidence import roc_auc

    features, network, _ = color_lock_value
    first = features.first_rows("test")
    success = features.episode_success[features.episode_index[first]].numpy() > 0.5
    auc = value_auc_on(network, features, "test")
    assert auc.first_step == roc_auc(predicted_returns(network, features, first).numpy(), success)
    # ColorLock's episodes start alike and the noisy expert's slips decide them later: the first step tells
    # nothing (AUC 0.46 [0.18, 0.76] on 20 test episodes), the later steps do.
    assert auc.ci95[0] < 0.5 < auc.ci95[1] and auc.ci95[0] <= auc.first_step <= auc.ci95[1]
    assert auc.per_step > 0.65
