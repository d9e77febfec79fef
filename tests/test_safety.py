"""The safety filter: rule specs, what it counts, and that a forbidden action never reaches the environment."""

from __future__ import annotations

import random

import online_envs
import pytest
import torch
from online_envs import DROP, REPAIR, SORRY, WAIT

from offline_agent.actions import canonical_action
from offline_agent.envs.safety import (
    ALL_FORBIDDEN,
    STOP_CANDIDATE,
    SafetyFilter,
    SafetyWrapper,
    split_specs,
)
from offline_agent.errors import UserError
from offline_agent.online.vector import build_env

# --- specs ------------------------------------------------------------------------------------------------


def test_specs_split_on_semicolons_only_where_a_new_rule_starts():
    specs = split_specs(["deny:drop_table, rollback_stage;regex:rm -rf; x;y", "callable:online_envs:no_apologies"])
    assert specs == ["deny:drop_table, rollback_stage", "regex:rm -rf; x;y", "callable:online_envs:no_apologies"]
    assert SafetyFilter.from_spec(specs).specs == [
        "deny:drop_table,rollback_stage",
        "regex:rm -rf; x;y",
        "callable:online_envs:no_apologies",
    ]
    assert not SafetyFilter.from_spec(None) and not SafetyFilter.from_spec([])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("block:drop_table", "unknown safety rule 'block:drop_table'"),
        ("deny:", "is empty"),
        ("deny: , ", "names no tool"),
        ("regex:(unclosed", "invalid regular expression"),
        ("callable:no_such_module_xyz:judge", "cannot import module 'no_such_module_xyz' for safety rule"),
        ("callable:online_envs:missing", "has no function 'missing'"),
        ("callable:judge", "must name module.path:function"),
    ],
)
def test_bad_specs_are_one_line_user_errors(spec, message):
    with pytest.raises(UserError, match=message):
        SafetyFilter.from_spec(spec)


def test_check_counts_each_rule_and_each_denied_tool():
    safety = SafetyFilter.from_spec(
        "deny:drop_table,wait;regex:\"part\":\"widget\";callable:online_envs:no_apologies;regex:drop"
    )
    allowed, blocked = safety.check("the widget is broken", [REPAIR, WAIT, DROP, SORRY])
    assert allowed == [False, False, False, False]
    assert blocked == {
        "deny:drop_table": 1,
        "deny:wait": 1,
        'regex:"part":"widget"': 1,
        "callable:online_envs:no_apologies": 1,
        "regex:drop": 1,
    }
    # The judge sees the observation: once the widget works, apologies are allowed.
    allowed, blocked = safety.check("the widget works", [SORRY])
    assert allowed == [True] and blocked == {}


def test_a_judge_that_does_not_return_a_bool_is_a_user_error():
    safety = SafetyFilter.from_spec("callable:online_envs:judge_says_maybe")
    with pytest.raises(UserError, match="must return True"):
        safety.check("text", ["hello"])


# --- the wrapper ------------------------------------------------------------------------------------------


def test_a_blocked_action_is_never_executed_whatever_the_agent_picks():
    online_envs.EXECUTED.clear()
    env = SafetyWrapper(online_envs.Widget(max_steps=6), SafetyFilter.from_spec("deny:drop_table"))
    rng = random.Random(0)
    blocked = 0
    for episode in range(200):
        observation, info = env.reset(seed=episode)
        blocked += info["safety_blocked"].get("deny:drop_table", 0)
        done = False
        while not done:
            assert DROP not in observation["candidates"]
            observation, _, terminated, truncated, info = env.step(rng.randrange(len(observation["candidates"])))
            blocked += info.get("safety_blocked", {}).get("deny:drop_table", 0)
            done = terminated or truncated
    assert len(online_envs.EXECUTED) > 200 and DROP not in online_envs.EXECUTED
    assert blocked > 200  # drop_table is offered at every step of the Widget env


def test_agent_indices_map_to_the_allowed_candidates():
    online_envs.EXECUTED.clear()
    env = SafetyWrapper(online_envs.Widget(), SafetyFilter.from_spec("deny:drop_table"))
    observation, _ = env.reset(seed=3)
    index = list(observation["candidates"]).index(REPAIR)
    _, reward, terminated, _, info = env.step(index)
    assert online_envs.EXECUTED == [REPAIR] and terminated and reward == 1.0 and info["success"]


def test_all_candidates_forbidden_after_a_step_truncates_with_the_info_field():
    online_envs.EXECUTED.clear()
    env = SafetyWrapper(online_envs.Trap(), SafetyFilter.from_spec("deny:drop_table"))
    observation, _ = env.reset(seed=0)
    assert observation["candidates"] == (WAIT,)
    observation, reward, terminated, truncated, info = env.step(0)
    assert (terminated, truncated) == (False, True)
    assert info["safety"] == ALL_FORBIDDEN and info["success"] is False
    assert info["safety_blocked"] == {"deny:drop_table": 1}
    assert observation["candidates"] == ()
    assert online_envs.EXECUTED == [WAIT]


def test_all_candidates_forbidden_at_reset_offers_only_stop_which_never_reaches_the_env():
    online_envs.EXECUTED.clear()
    env = SafetyWrapper(online_envs.Widget(), SafetyFilter.from_spec("regex:."))
    observation, info = env.reset(seed=0)
    assert observation["candidates"] == (STOP_CANDIDATE,) and info["safety"] == ALL_FORBIDDEN
    assert sum(info["safety_blocked"].values()) == 4
    _, reward, terminated, truncated, info = env.step(0)
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["safety"] == ALL_FORBIDDEN and info["success"] is False
    assert online_envs.EXECUTED == []


def test_build_env_wraps_a_contract_checked_env_from_its_spec():
    env = build_env("online_envs:make_widget", ["deny:drop_table"])
    assert isinstance(env, SafetyWrapper)
    observation, _ = env.reset(seed=0)
    assert DROP not in observation["candidates"] and len(observation["candidates"]) == 3


# --- in fine-tuning ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return online_envs.tiny_checkpoint(root / "run", online_envs.tiny_encoder_folder(root / "encoder"))


def test_fine_tuning_never_executes_a_blocked_action_and_logs_what_it_blocked(tiny_run):
    from offline_agent.learn.policy import Policy
    from offline_agent.online.config import PPOConfig
    from offline_agent.online.ppo import PPOTrainer

    torch.set_num_threads(1)
    online_envs.EXECUTED.clear()
    config = PPOConfig(num_envs=2, num_steps=32, vector="sync", learning_rate=3e-3)
    safety = SafetyFilter.from_spec("deny:drop_table;callable:online_envs:no_apologies")
    trainer = PPOTrainer(Policy.load(tiny_run), "online_envs:make_widget", config, safety)
    try:
        rows = [trainer.train_iteration() for _ in range(2)]
    finally:
        trainer.close()
    executed = [canonical_action(a) for a in online_envs.EXECUTED]
    assert len(executed) >= 2 * 2 * 32
    assert canonical_action(DROP) not in executed and SORRY not in executed
    for row in rows:
        assert row["safety/blocked/deny:drop_table"] > 0
        assert row["safety/blocked/callable:online_envs:no_apologies"] > 0
        assert row["safety/blocked"] == (
            row["safety/blocked/deny:drop_table"] + row["safety/blocked/callable:online_envs:no_apologies"]
        )
        assert row["safety/truncated"] == 0.0  # repair and wait are always left
