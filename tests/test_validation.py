"""Keeping a validated policy of a fine-tuning run (offline_agent/online/validation.py)."""

from __future__ import annotations

import json

import online_envs
import polars as pl
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from offline_agent.learn.policy import Policy, candidate_texts
from offline_agent.online.config import METRICS, PPOConfig
from offline_agent.online.finetune import finetune
from offline_agent.online.validation import PolicySelector, bar_to_keep, improves

WIDGET = "online_envs:make_widget"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    encoder = online_envs.tiny_encoder_folder(root / "encoder")
    run = online_envs.tiny_checkpoint(root / "run", encoder)
    return {"run": run, "reference": Policy.load(run)}


class Seeker(nn.Module):
    """A head that always picks the candidate whose embedding is nearest `target`'s: Q = -||a - target||^2."""

    pair_dim = 0

    def __init__(self, target: torch.Tensor):
        super().__init__()
        self.register_buffer("target", target)

    def q_values(self, state, cands, mask, pair=None):
        q = -((cands - self.target) ** 2).sum(-1)
        return q.masked_fill(~mask, float("-inf"))


def seeker(reference: Policy, action) -> Seeker:
    return Seeker(torch.from_numpy(reference.embed(candidate_texts([action]))[0]))


def test_a_policy_replaces_the_kept_one_when_it_does_at_least_as_well():
    assert improves(5, 4) and improves(5, 5)  # a tie goes to the later, more trained policy
    assert not improves(4, 5)


def test_the_bar_is_the_kept_policys_score_or_the_offline_policys():
    assert bar_to_keep("best", kept_successes=9, offline_successes=5) == 9
    assert bar_to_keep("guard", kept_successes=9, offline_successes=5) == 5
    for keep in ("best", "guard"):  # the offline policy itself, validated first, is kept whatever it scores
        assert bar_to_keep(keep, kept_successes=-1, offline_successes=None) == -1


@pytest.mark.parametrize(("keep", "kept"), [("best", 1), ("guard", 2)])
def test_best_keeps_the_top_score_and_guard_the_latest_that_matches_the_offline_one(tiny, keep, kept):
    reference = tiny["reference"]
    selector = PolicySelector(reference, WIDGET, episodes=4, keep=keep)
    # The offline policy drops the table (0 of 4), the first iteration repairs (4 of 4), the second drops again.
    for iteration, action in enumerate((online_envs.DROP, online_envs.REPAIR, online_envs.DROP)):
        selector.consider(iteration, seeker(reference, action))
    assert [s for _, s in selector.history] == [0, 4, 0]
    assert selector.kept_iteration == kept and selector.describe()["keep"] == keep
    # guard keeps the second iteration's drop: it does as well as the offline policy, which is all it asks.
    kept_action = {1: online_envs.REPAIR, 2: online_envs.DROP}[kept]
    assert torch.equal(selector.kept_head.target, seeker(reference, kept_action).target)


def test_an_unknown_rule_is_refused(tiny):
    with pytest.raises(ValueError, match="keep must be one of best, guard, got 'worst'"):
        PolicySelector(tiny["reference"], WIDGET, episodes=4, keep="worst")


def test_a_worse_policy_is_validated_but_not_kept(tiny):
    reference = tiny["reference"]
    repairer, dropper = seeker(reference, online_envs.REPAIR), seeker(reference, online_envs.DROP)
    selector = PolicySelector(reference, WIDGET, episodes=6)

    first = selector.consider(0, repairer)  # repair ends every episode at once, with success
    assert first == {
        "validation/success_rate": 1.0, "validation/kept_iteration": 0.0, "validation/kept_success_rate": 1.0,
        "validation/env_steps": 6.0,
    }
    second = selector.consider(1, dropper)  # drop_table ends every episode at once, failed
    assert second["validation/success_rate"] == 0.0 and second["validation/kept_iteration"] == 0.0
    assert torch.equal(selector.kept_head.target, repairer.target)
    assert selector.consider(2, seeker(reference, online_envs.REPAIR))["validation/kept_iteration"] == 2.0
    assert selector.describe() == {
        "episodes": 6, "seed": 2000, "keep": "best", "kept_iteration": 2, "kept_success_rate": 1.0, "env_steps": 18,
        "history": [{"iteration": 0, "success_rate": 1.0}, {"iteration": 1, "success_rate": 0.0},
                    {"iteration": 2, "success_rate": 1.0}],
    }


def test_the_kept_head_is_a_copy_that_training_does_not_move(tiny):
    reference = tiny["reference"]
    head = seeker(reference, online_envs.REPAIR)
    selector = PolicySelector(reference, WIDGET, episodes=2)
    selector.consider(0, head)
    kept = head.target.clone()
    head.target += 1.0  # what an optimizer step does to the live head
    assert torch.equal(selector.kept_head.target, kept)


def test_the_selection_survives_a_save_and_load(tiny):
    reference = tiny["reference"]
    selector = PolicySelector(reference, WIDGET, episodes=4)
    selector.consider(0, seeker(reference, online_envs.REPAIR))
    selector.consider(1, seeker(reference, online_envs.WAIT))
    tensors, state = selector.state()
    restored = PolicySelector(reference, WIDGET, episodes=4)
    restored.load(tensors, json.loads(json.dumps(state)), like=seeker(reference, online_envs.DROP))
    assert restored.describe() == selector.describe()
    assert torch.equal(restored.kept_head.target, selector.kept_head.target)


def test_a_validated_run_trains_as_before_and_keeps_the_best_policy(tiny, tmp_path):
    def run(out, iterations, validation, keep="best"):
        config = PPOConfig(
            iterations=iterations, num_envs=2, num_steps=16, vector="sync", beta=0.01, learning_rate=3e-3,
            validation_episodes=validation, validation_keep=keep,
        )
        finetune(tiny["run"], WIDGET, out, config)
        return pl.read_parquet(out / "metrics.parquet")

    validated = run(tmp_path / "validated", 6, 12)
    training = [c for c in METRICS if not c.startswith("time/")]
    # Validation plays copies of the policy, greedily, in environments of its own: training is unchanged.
    assert validated.select(training).equals(run(tmp_path / "plain", 6, 0).select(training))
    assert validated["validation/env_steps"].is_sorted() and validated["validation/env_steps"][0] >= 2 * 12

    summary = json.loads((tmp_path / "validated" / "finetune.json").read_text())["validation"]
    rates = [h["success_rate"] for h in summary["history"]]
    assert [h["iteration"] for h in summary["history"]] == list(range(7))  # the offline policy, then each one
    kept = summary["kept_iteration"]
    assert rates[kept] == max(rates) and all(r < max(rates) for r in rates[kept + 1 :])  # best, ties to the later
    policy_json = json.loads((tmp_path / "validated" / "policy.json").read_text())
    assert policy_json["validation"]["kept_iteration"] == kept
    # The saved weights are those of the policy after `kept` iterations: a run cut there ends with them.
    assert kept > 0 and rates[kept] > rates[0]  # the random offline policy mostly fails
    assert (tmp_path / "validated" / "curves.png").stat().st_size > 10_000

    # guard, on the same validation episodes, keeps the latest policy that matches the offline one's score:
    # here the last one, so it saves exactly what the unvalidated run saves.
    guarded = run(tmp_path / "guarded", 6, 12, keep="guard")
    assert guarded.select(training).equals(validated.select(training))
    guard = json.loads((tmp_path / "guarded" / "finetune.json").read_text())["validation"]
    assert [h["success_rate"] for h in guard["history"]] == rates
    assert guard["keep"] == "guard" and guard["kept_iteration"] == max(i for i, r in enumerate(rates) if r >= rates[0])
    assert guard["kept_iteration"] == 6, rates
    saved, last = (load_file(str(tmp_path / name / "policy.safetensors")) for name in ("guarded", "plain"))
    assert saved.keys() == last.keys() and all(torch.equal(saved[k], last[k]) for k in saved)


def test_a_run_whose_training_goes_wrong_keeps_its_last_good_policy(tiny, tmp_path):
    from offline_agent.evaluate import evaluate

    def run(source, env, out, validation, **settings):
        config = PPOConfig(
            **{"iterations": 6, "num_envs": 2, "num_steps": 16, "vector": "sync", "beta": 0.01, "learning_rate": 3e-3,
               **online_envs.PLAIN, "validation_episodes": validation, **settings}
        )
        finetune(source, env, out, config)
        return out

    # A policy that repairs (fine-tuned on the widget), fine-tuned again where the reward pays for dropping the
    # table: PPO follows the reward and the success rate falls; the validated run keeps a policy that repairs.
    repairs = run(tiny["run"], WIDGET, tmp_path / "repairs", 0)
    lured = {"beta": 0.0, "learning_rate": 1e-2, "iterations": 8}  # no KL to hold it back
    plain = run(repairs, "online_envs:make_lure", tmp_path / "plain", 0, **lured)
    kept = run(repairs, "online_envs:make_lure", tmp_path / "kept", 12, **lured)
    history = json.loads((kept / "finetune.json").read_text())["validation"]["history"]
    rates = [h["success_rate"] for h in history]
    kept_iteration = json.loads((kept / "policy.json").read_text())["validation"]["kept_iteration"]
    # It still repaired for a few iterations, then learnt to drop the table: the last of the good ones is kept.
    assert rates[0] == 1.0 and rates[-1] == 0.0 and 0 < kept_iteration < 8, rates
    assert rates[kept_iteration] == 1.0 and set(rates[kept_iteration + 1 :]) == {0.0}
    start, last, validated = (
        evaluate(folder, WIDGET, episodes=20).success_rate for folder in (repairs, plain, kept)
    )
    assert start == validated == 1.0 and last == 0.0
    # The saved weights are those of the policy after `kept_iteration` iterations: a run cut there ends with them.
    cut = run(repairs, "online_envs:make_lure", tmp_path / "cut", 0, **{**lured, "iterations": kept_iteration})
    saved, ended = (load_file(str(folder / "policy.safetensors")) for folder in (kept, cut))
    assert saved.keys() == ended.keys() and all(torch.equal(saved[k], ended[k]) for k in saved)
