"""The built-in simulators, environment loading and the scripted behaviour policies."""

from __future__ import annotations

import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from offline_agent.actions import canonical_action
from offline_agent.envs import BUILTIN_ENVS, check_contract, make_env, make_policy
from offline_agent.envs.base import EXPERT, HARMFUL, MALFORMED, call
from offline_agent.envs.loading import task_text
from offline_agent.errors import UserError
from offline_agent.simulate import rollout

ENV_IDS = sorted(BUILTIN_ENVS)


def play(env: gym.Env, policy, seed: int) -> list:
    """Every (observation, reward, terminated, truncated, info) of one episode."""
    observation, info = env.reset(seed=seed)
    trace = [(observation, 0.0, False, False, info)]
    done = False
    while not done:
        observation, reward, terminated, truncated, info = env.step(policy(env, observation))
        trace.append((observation, reward, terminated, truncated, info))
        done = terminated or truncated
    return trace


def success_rate(env_id: str, spec: str, episodes: int, seed: int = 0) -> float:
    results = rollout(make_env(env_id), make_policy(spec, seed), episodes, seed)
    return sum(r.success for r in results) / episodes


# --- the built-in simulators ---------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_passes_gymnasium_env_checker_and_the_contract(env_id):
    env = gym.make(env_id)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    assert not [str(w.message) for w in caught if "render" not in str(w.message)]
    check_contract(make_env(env_id), steps=5)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_same_seed_same_trajectory(env_id):
    env = make_env(env_id)
    first = play(env, make_policy("noisy:0.5", 3), seed=11)
    again = play(env, make_policy("noisy:0.5", 3), seed=11)
    assert first == again
    other = play(env, make_policy("noisy:0.5", 3), seed=12)
    assert other != first


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_expert_always_succeeds_in_ten_or_more_steps(env_id):
    env = make_env(env_id)
    results = rollout(env, make_policy("expert"), episodes=20, seed=5)
    assert all(r.success and r.episode_return == 1.0 for r in results)
    assert min(r.n_steps for r in results) >= 10
    assert all(r.sub_goals_done == r.sub_goals_total for r in results)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_random_mostly_fails_and_noisy_half_lands_in_the_benchmark_band(env_id):
    assert success_rate(env_id, "random", 60) < 0.15
    assert 0.15 <= success_rate(env_id, "noisy:0.5", 200) <= 0.55


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_every_step_offers_distinct_valid_candidates_with_one_expert(env_id):
    env = make_env(env_id).unwrapped
    policy = make_policy("random", 0)
    for seed in range(15):
        for observation, reward, terminated, _, info in play(env, policy, seed):
            assert env.observation_space.contains(observation)
            assert {"success", "is_error", "sub_goals_done", "sub_goals_total"} <= set(info)
            if terminated:
                assert observation["candidates"] == ()
                assert reward == (1.0 if info["success"] else 0.0)
                continue
            texts = [canonical_action(c) for c in observation["candidates"]]
            assert len(texts) == env.max_candidates == len(set(texts))
    observation, _ = env.reset(seed=0)
    assert env.candidate_kinds.count(EXPERT) == 1


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_an_index_outside_the_candidates_is_a_clear_error(env_id):
    env = make_env(env_id)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="not a candidate index: this step offers 8 candidates"):
        env.step(8)
    with pytest.raises(ValueError, match="not a candidate index"):
        env.step(-1)


def first_step_offering(env: gym.Env, kind: str) -> int:
    """Follow the expert from successive seeds until a step offers a candidate of `kind`; return its index."""
    for seed in range(20):
        env.reset(seed=seed)
        done = False
        while not done:
            if kind in env.unwrapped.candidate_kinds:
                return env.unwrapped.candidate_kinds.index(kind)
            _, _, terminated, truncated, _ = env.step(env.unwrapped.expert_action())
            done = terminated or truncated
    raise AssertionError(f"no {kind} candidate in 20 expert episodes")


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_malformed_call_comes_back_as_an_error_observation(env_id):
    env = make_env(env_id)
    index = first_step_offering(env, MALFORMED)
    observation, reward, terminated, truncated, info = env.step(index)
    assert info["is_error"] and not terminated
    assert observation["text"].startswith("ERROR invalid arguments for ")


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_harmful_call_ends_the_episode_as_a_failure(env_id):
    env = make_env(env_id)
    index = first_step_offering(env, HARMFUL)
    observation, reward, terminated, truncated, info = env.step(index)
    assert terminated and reward == 0.0 and info["success"] is False and info["is_error"]
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(0)


def test_max_steps_truncates_the_episode():
    env = make_env("offline_agent/Logistics-v0", max_steps=3)
    trace = play(env, make_policy("expert"), seed=0)
    assert len(trace) == 4 and trace[-1][3] is True and trace[-1][4]["success"] is False
    assert trace[-1][0]["candidates"]  # a truncated state still offers candidates to bootstrap from


def test_pipeline_fault_is_hidden_until_the_logs_are_inspected():
    env = make_env("offline_agent/PipelineRepair-v0").unwrapped
    observation, info = env.reset(seed=4)
    assert "FAILED" in observation["text"] and info["retries"] == 0
    env._apply(call("ack_alert"))
    stage = env._failed_stage()
    for detail in ("Timeout", "JSONDecode", "KeyError", "AttributeError"):
        assert detail not in observation["text"]
    text, is_error = env._apply(call("patch_stage", stage=stage, fix="map_renamed_column"))
    assert is_error and "inspect_logs" in text
    text, is_error = env._apply(call("inspect_logs", stage=stage))
    assert not is_error and any(d in text for d in ("Timeout", "JSONDecode", "KeyError", "AttributeError"))


def test_pipeline_counts_retries_of_failed_stages():
    env = make_env("offline_agent/PipelineRepair-v0")
    results = rollout(env, make_policy("expert"), episodes=20, seed=0)
    for r in results:
        assert r.recoveries == r.sub_goals_total - 1  # every fault recovered, plus the verification
        assert r.retries >= r.recoveries
    assert any(r.retries > r.recoveries for r in results)  # timeouts sometimes need a second retry


def test_logistics_needs_an_inventory_query_before_loading():
    env = make_env("offline_agent/Logistics-v0").unwrapped
    env.reset(seed=0)
    text, is_error = env._apply(call("load", item="water", qty=1))
    assert is_error and "query_inventory" in text


def test_support_denies_account_data_before_identity_is_verified():
    env = make_env("offline_agent/CustomerSupport-v0").unwrapped
    env.reset(seed=0)
    text, is_error = env._apply(call("get_payments", customer_id=env.customer_id))
    assert is_error and "verify the customer's identity" in text
    assert any(isinstance(c, str) for c in env._candidates)  # messages to the customer are candidates too


# --- loading environments ------------------------------------------------------------------------------


def test_make_env_from_a_module_factory_with_keyword_arguments():
    env = make_env("user_envs:make_count_to", target=2)
    results = rollout(env, lambda env, observation: 0 if env.unwrapped.count < 2 else 1, episodes=2, seed=0)
    assert [r.success for r in results] == [True, True]
    assert results[0].n_steps == 3 and results[0].task == "count to 2"


def test_make_env_imports_from_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "my_sim_for_cwd_test.py").write_text(
        "from user_envs import CountTo\n\ndef make():\n    return CountTo(target=1)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert make_env("my_sim_for_cwd_test:make").unwrapped.target == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "an environment spec must be a non-empty string"),
        ("Nope-v0", "unknown environment 'Nope-v0': expected a registered gymnasium id"),
        ("offline_agent/Logistic-v0", "did you mean 'offline_agent/Logistics-v0'"),
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'.*PYTHONPATH"),
        ("user_envs:missing", "module 'user_envs' has no attribute 'missing'"),
        ("user_envs:make_raising", "creating environment 'user_envs:make_raising' failed: RuntimeError: simulator"),
        ("user_envs:make_not_an_env", "returned int, expected a gymnasium.Env"),
        ("user_envs:make_string_observation", r"reset\(\) returned 'count is 0', expected an observation"),
        ("user_envs:make_bad_candidates", "candidate 1 is not a valid action"),
        ("user_envs:make_too_many_candidates", r"offered 3 candidates but the action space is Discrete\(2\)"),
        ("user_envs:make_no_success_info", "last step must hold 'success'"),
    ],
)
def test_make_env_errors_say_what_was_expected(spec, message):
    with pytest.raises(UserError, match=message):
        make_env(spec)


def test_make_env_reports_bad_keyword_arguments():
    with pytest.raises(UserError, match="creating environment 'offline_agent/Logistics-v0' failed: TypeError"):
        make_env("offline_agent/Logistics-v0", no_such_option=1)


# --- behaviour policies --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("greedy", "unknown policy 'greedy': expected expert, random, noisy:EPS"),
        ("noisy", "EPS must be a probability"),
        ("noisy:1.5", "EPS must be a probability"),
        ("flaky:abc", "EPS must be a probability"),
        ("random:0.1", "unknown policy"),
    ],
)
def test_bad_policy_specs(spec, message):
    with pytest.raises(UserError, match=message):
        make_policy(spec)


def test_expert_needs_an_oracle():
    env = make_env("user_envs:make_count_to")
    with pytest.raises(UserError, match="needs an environment with an expert_action"):
        rollout(env, make_policy("expert"), episodes=1)
    # the LLM-like policy falls back to random mistakes outside the built-ins, and needs the oracle otherwise
    assert rollout(env, make_policy("flaky:1.0", 0), episodes=2)


def test_llm_like_policy_repeats_failed_calls_and_sends_malformed_ones():
    env = make_env("offline_agent/PipelineRepair-v0")
    results = rollout(env, make_policy("flaky:0.5", 0), episodes=30, seed=0, record=True)
    malformed = sum(
        m["content"].startswith("ERROR invalid arguments") for r in results for m in r.messages if m["role"] == "tool"
    )
    repeats = 0
    for r in results:
        turns = [m for m in r.messages if m["role"] in ("assistant", "tool")]
        steps = list(zip(turns[0::2], turns[1::2], strict=True))  # (action, result) pairs
        for (action, result), (next_action, _) in zip(steps, steps[1:], strict=False):
            same = action["tool_calls"][0]["function"] == next_action["tool_calls"][0]["function"]
            repeats += result["is_error"] and same
    assert malformed > 5 and repeats > 0
    assert 0.1 < sum(r.success for r in results) / 30 < 1.0


def test_the_task_comes_from_the_reset_info_then_the_env_then_the_first_observation():
    class WithTask:
        unwrapped = type("Env", (), {"task": "the env's task"})()

    class WithoutTask:
        unwrapped = object()

    observation = {"text": "first observation", "candidates": []}
    assert task_text({"task": "the info's task"}, WithTask(), observation) == "the info's task"
    assert task_text({}, WithTask(), observation) == "the env's task"
    assert task_text({"task": ""}, WithTask(), observation) == "the env's task"
    assert task_text({"task": 3}, WithoutTask(), observation) == "first observation"  # not text: ignored
    assert task_text(None, None, observation) == "first observation"
