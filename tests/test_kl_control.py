"""KL control: the controller's steps by hand, and on the tiny Widget env the per-step KL to the offline
policy stays within 2x its target over 48 iterations, where without control it runs to deterministic play."""

from __future__ import annotations

import math

import pytest
import torch

from offline_agent.online.config import PPOConfig
from offline_agent.online.kl import AdaptiveKLController, FixedKLController, beta_factor
from offline_agent.online.ppo import PPOTrainer


@pytest.mark.parametrize(
    ("kl", "factor"),
    [
        (0.10, 2.0),  # twice the target: beta doubles
        (0.06, 1.2),
        (0.05, 1.0),
        (0.045, 0.9),
        (0.02, 0.8),  # (0.4) kept at 1 / max_down
        (0.0, 0.8),  # the first rollout, the policy still the reference
        (1.39, 4.0),  # 28x: kept at max_up
    ],
)
def test_beta_moves_by_the_ratio_of_kl_to_target_within_its_limits(kl, factor):
    assert beta_factor(kl, 0.05, gain=1.0, max_up=4.0, max_down=1.25) == pytest.approx(factor)


def test_the_gain_is_a_power_of_the_ratio():
    assert beta_factor(0.1, 0.05, gain=0.5, max_up=4.0, max_down=1.25) == pytest.approx(math.sqrt(2.0))


def test_the_controller_compounds_its_steps_and_a_fixed_beta_never_moves():
    controller, fixed = AdaptiveKLController(beta=0.1, target=0.05), FixedKLController(0.1)
    for kl in (0.0, 0.1, 0.2, 0.05, 0.04):
        controller.update(kl)
        fixed.update(kl)
    assert controller.beta == pytest.approx(0.1 * 0.8 * 2.0 * 4.0 * 1.0 * 0.8)
    assert fixed.beta == 0.1
    with pytest.raises(ValueError, match="target KL must be > 0"):
        AdaptiveKLController(beta=0.1, target=0.0)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from online_envs import tiny_checkpoint, tiny_encoder_folder

    root = tmp_path_factory.mktemp("tiny-kl")
    return tiny_checkpoint(root / "run", tiny_encoder_folder(root / "encoder"))


def _kls(run, env: str, iterations: int = 48, **settings) -> tuple[list[float], list[dict[str, float]]]:
    from online_envs import PLAIN

    from offline_agent.learn.policy import Policy

    torch.set_num_threads(1)
    kl = {"target_kl": 0.05} if "beta" not in settings else {}
    config = PPOConfig(num_envs=4, num_steps=32, vector="sync", iterations=iterations, learning_rate=3e-3,
                       **{**PLAIN, **kl, **settings})
    trainer = PPOTrainer(Policy.load(run), env, config)
    try:
        rows = [trainer.train_iteration() for _ in range(iterations)]
    finally:
        trainer.close()
    return [row["objective/kl"] for row in rows], rows


@pytest.mark.parametrize("env", ["online_envs:make_widget", "online_envs:make_lure"])
def test_the_kl_stays_within_twice_its_target_where_it_drifted_before(tiny_run, env):
    # Repairing pays on the Widget (dropping the table, on the Lure): PPO carries the policy from the
    # near-uniform reference to deterministic play. Without a penalty the KL runs to log(4) = 1.39 nats, as
    # it did under the old controller (beta 0.10 -> 0.30 in 48 iterations); with the default control the
    # whole run stays within 2x the 0.05 target, the controller and the trust region sharing the work.
    free, _ = _kls(tiny_run, env, iterations=24, beta=0.0)
    assert max(free) > 1.0
    held, rows = _kls(tiny_run, env)
    assert max(held) <= 2 * 0.05
    assert 0.03 < sum(held[10:]) / len(held[10:]) < 0.07  # near the target, not pinned to the reference
    assert any(row["policy/pulled_back"] > 0 for row in rows)  # the trust region did bind on the way


def test_self_imitation_is_held_too(tiny_run):
    held, rows = _kls(tiny_run, "online_envs:make_widget", self_imitation=1.0, subgoal_shaping=1.0, tau=0.5)
    assert max(held) <= 2 * 0.05
    assert sum(row["self_imitation/buffer_steps"] > 0 for row in rows) > 40  # imitation ran all along


def _update_far_from_the_reference(run, **settings) -> tuple[float, float, dict[str, float]]:
    """KL to the reference before and after one PPO update (random advantages, no penalty gradient) of a
    policy carried far from the reference, and the update's metrics."""
    from online_envs import PLAIN
    from test_ppo import _kl_to_reference

    from offline_agent.learn.policy import Policy

    torch.set_num_threads(1)
    config = PPOConfig(num_envs=2, num_steps=16, vector="sync", target_kl=0.05, max_update_kl=None,
                       learning_rate=3e-3, **{**PLAIN, **settings})
    trainer = PPOTrainer(Policy.load(run), "online_envs:make_widget", config)
    try:
        trainer.train_iteration()  # fills the rollout storage
        with torch.no_grad():  # carry the correction far from zero: the policy far from the reference
            for param in trainer.model.policy_head.parameters():
                if param.requires_grad:
                    param.add_(0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(0)))
        before = _kl_to_reference(trainer)
        advantages = torch.randn(16, 2, generator=torch.Generator().manual_seed(1))
        row = trainer.update(advantages, advantages, beta=0.0)
        return before, _kl_to_reference(trainer), row
    finally:
        trainer.close()


def test_a_step_outside_the_trust_region_moves_the_policy_back_toward_the_reference(tiny_run):
    before, after, row = _update_far_from_the_reference(tiny_run)
    assert before > 2 * 0.05 and row["policy/pulled_back"] > 0.5
    assert after < 0.85 * before
    same_before, free_after, free_row = _update_far_from_the_reference(tiny_run, trust_region=None)
    assert same_before == before and free_row["policy/pulled_back"] == 0.0
    assert free_after > 0.95 * before  # PPO alone does not bring it back
