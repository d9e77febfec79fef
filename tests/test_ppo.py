"""PPO + KL math against hand-computed numbers, and the fine-tuning policy at iteration 0 against the offline one."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from offline_agent.errors import UserError
from offline_agent.online.config import DEFAULT_TARGET_KL, PPOConfig
from offline_agent.online.kl import entropy, exact_kl, masked_log_softmax
from offline_agent.online.losses import clipped_policy_loss, expected_value, gae, shaping_reward, subgoal_potential
from offline_agent.online.ppo import PPOTrainer

# --- exact values ---------------------------------------------------------------------------------------


def test_gae_matches_a_hand_computed_rollout_with_a_done_in_the_middle():
    # env 0 ends an episode at t=1, so t=1 must not look at t=2's value; env 1 runs through.
    rewards = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 1.0]])  # (T=3, N=2)
    values = torch.tensor([[0.5, 0.0], [1.0, 0.0], [1.5, 0.0]])
    dones = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    next_value = torch.tensor([2.0, 0.0])
    advantages, returns = gae(rewards, values, dones, next_value, gamma=0.5, lam=0.5)
    # env 0: t=2 delta = 3 + .5*2 - 1.5 = 2.5; t=1 delta = 2 - 1 = 1 (done: no bootstrap, no carry);
    #        t=0 delta = 1 + .5*1 - .5 = 1, A = 1 + .25*1 = 1.25
    # env 1: t=2 A = 1; t=1 A = .25 * 1; t=0 A = .25 * .25
    expected = torch.tensor([[1.25, 0.0625], [1.0, 0.25], [2.5, 1.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected + values)


def test_clipped_policy_loss_on_hand_built_ratios():
    old_logp = torch.zeros(3)
    new_logp = torch.log(torch.tensor([1.5, 0.5, 1.0]))  # ratios 1.5, 0.5, 1
    advantages = torch.tensor([1.0, 1.0, -2.0])
    out = clipped_policy_loss(new_logp, old_logp, advantages, clip=0.2)
    # rows: max(-1.5, -1.2) = -1.2;  max(-0.5, -0.8) = -0.5;  max(2, 2) = 2
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 2.0) / 3)
    assert out.clipfrac == pytest.approx(2 / 3)
    assert out.approx_kl == pytest.approx(((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 3)


def test_clipped_loss_gives_no_gradient_beyond_the_clip():
    new_logp = torch.log(torch.tensor([1.5])).requires_grad_(True)
    clipped_policy_loss(new_logp, torch.zeros(1), torch.tensor([1.0]), clip=0.2).loss.backward()
    assert new_logp.grad.item() == 0.0


def test_exact_kl_and_entropy_over_masked_candidates():
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25, 1.0], [0.7, 0.3, 1.0, 1.0]]))
    # The padding slots hold large values: a KL that forgot the mask would be far off.
    ref_logits = torch.tensor([[0.0, 0.0, 0.0, 50.0], [math.log(0.7), math.log(0.3), 50.0, 50.0]])
    logp, ref_logp = masked_log_softmax(logits, mask), masked_log_softmax(ref_logits, mask)
    kl = exact_kl(logp, ref_logp, mask)
    expected_row0 = 0.5 * math.log(0.5 * 3) + 2 * 0.25 * math.log(0.25 * 3)
    torch.testing.assert_close(kl, torch.tensor([expected_row0, 0.0]), atol=1e-6, rtol=0)
    expected_entropy = [
        -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)),
        -(0.7 * math.log(0.7) + 0.3 * math.log(0.3)),
    ]
    torch.testing.assert_close(entropy(logp, mask), torch.tensor(expected_entropy))
    assert not torch.isnan(kl).any()


def test_expected_value_ignores_masked_slots():
    mask = torch.tensor([[True, True, False]])
    q = torch.tensor([[1.0, 3.0, float("-inf")]])
    logp = masked_log_softmax(torch.tensor([[0.0, 0.0, 0.0]]), mask)
    torch.testing.assert_close(expected_value(logp, q, mask), torch.tensor([2.0]))


def test_shaping_reward_credits_progress_and_zeroes_the_potential_after_an_episode_ends():
    potential = np.array([0.0, 0.5, 0.5])
    next_potential = np.array([0.5, 1.0, 0.5])
    done = np.array([False, True, False])
    # 0.9 * 0.5 - 0;  the episode ended: 0 - 0.5;  no progress: 0.9 * 0.5 - 0.5
    np.testing.assert_allclose(shaping_reward(potential, next_potential, done, 0.9), [0.45, -0.5, -0.05])


def test_shaping_of_an_episode_sums_discounted_to_minus_the_start_potential():
    phis = [0.25, 0.5, 0.5, 0.75, 1.0]  # Phi(s_0) .. Phi(s_4); the episode ends after the step from s_4
    gamma = 0.9
    terms = [
        shaping_reward(np.array([phis[t]]), np.array([phis[t + 1] if t + 1 < len(phis) else 0.3]),
                       np.array([t == len(phis) - 1]), gamma)[0]
        for t in range(len(phis))
    ]
    assert sum(gamma**t * f for t, f in enumerate(terms)) == pytest.approx(-phis[0])


@pytest.mark.parametrize(
    ("info", "phi"),
    [({"sub_goals_done": 1, "sub_goals_total": 4}, 0.25), ({"sub_goals_done": 0, "sub_goals_total": 0}, 0.0),
     ({"success": True}, 0.0), (None, 0.0)],
)
def test_subgoal_potential_is_the_share_done_and_zero_where_the_env_says_nothing(info, phi):
    assert subgoal_potential(info) == phi


# --- config ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"target_kl": 0.0}, "--target-kl must be > 0"),
        ({"target_kl": -1.0}, "--target-kl must be > 0"),
        ({"beta": 0.1, "target_kl": 0.05}, "exclude each other"),
        ({"beta": -0.1}, "--beta must be >= 0"),
        ({"num_envs": 0}, "num-envs must be >= 1"),
        ({"gamma": 1.5}, "gamma must be in"),
        ({"num_minibatches": 100, "num_envs": 1, "num_steps": 8}, "exceeds the 8 steps"),
        ({"max_update_kl": 0.0}, "max_update_kl must be > 0"),
        ({"checkpoint_every": 0}, "checkpoint-every must be >= 1"),
        ({"kl_gain": 0.0}, "kl_gain must be > 0"),
        ({"trust_region": 0.5}, "trust_region must be >= 1"),
        ({"value_learning_rate": 0.0}, "value_learning_rate must be > 0"),
        ({"tau": 0.0}, "--tau must be > 0"),
        ({"tau": -0.5}, "--tau must be > 0"),
        ({"subgoal_shaping": -1.0}, "subgoal_shaping must be >= 0"),
    ],
)
def test_config_rejects_bad_values_naming_the_fix(settings, message):
    with pytest.raises(UserError, match=message):
        PPOConfig(**settings)


def test_config_defaults_to_the_adaptive_controller():
    assert PPOConfig().target_kl == DEFAULT_TARGET_KL
    assert PPOConfig(beta=0.0).target_kl is None


# --- the policy at iteration 0 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from online_envs import tiny_checkpoint, tiny_encoder_folder

    root = tmp_path_factory.mktemp("tiny")
    return tiny_checkpoint(root / "run", tiny_encoder_folder(root / "encoder"))


def _trainer(run, **settings):
    from online_envs import PLAIN

    from offline_agent.learn.policy import Policy

    old = {"learning_rate": 3e-3, **({} if "beta" in settings else {"target_kl": 0.05})}  # the defaults they pinned
    config = PPOConfig(num_envs=2, num_steps=16, vector="sync", **{**PLAIN, **old, **settings})
    return PPOTrainer(Policy.load(run), "online_envs:make_widget", config)


@pytest.fixture(scope="module")
def tiny_grounded_run(tmp_path_factory):
    """A checkpoint whose network also reads each candidate's grounding (`offline_agent.learn.grounding`)."""
    from online_envs import tiny_checkpoint, tiny_encoder_folder

    from offline_agent.learn.grounding import PAIR_DIM

    root = tmp_path_factory.mktemp("tiny-grounded")
    return tiny_checkpoint(root / "run", tiny_encoder_folder(root / "encoder"), pair_dim=PAIR_DIM)


def _first_decision(trainer):
    """The first observations after a reset, their tensors, and the trainer's policy over their candidates."""
    observations, infos = trainer.envs.reset(trainer.env_seeds(0))
    for i, info in enumerate(infos):
        trainer.featurizer.start(i, info["task"])
    tensors = trainer.featurizer.tensors(observations)
    with torch.no_grad():
        probs = torch.softmax(trainer.model.logits(*tensors), -1)
    return observations, tensors, probs


@pytest.mark.parametrize(
    ("policy_init", "run_fixture"), [("residual", "tiny_run"), ("copy", "tiny_run"), ("residual", "tiny_grounded_run")]
)
def test_at_iteration_zero_the_policy_is_the_offline_policy(request, policy_init, run_fixture):
    torch.set_num_threads(1)
    tiny_run = request.getfixturevalue(run_fixture)
    trainer = _trainer(tiny_run, policy_init=policy_init)
    try:
        observations, _, probs = _first_decision(trainer)
        reference = trainer.reference
        for i, observation in enumerate(observations):
            text = reference.render(trainer.featurizer.histories[i], observation["text"])
            expected = reference.probabilities(text, observation["candidates"])
            n = len(observation["candidates"])
            torch.testing.assert_close(probs[i, :n], torch.from_numpy(expected), atol=1e-6, rtol=0)
        # The first rollout samples from the untouched copy: its KL to the reference is exactly zero.
        row = trainer.train_iteration()
        assert row["objective/kl"] == 0.0
        assert row["objective/non_score_reward"] == 0.0
        # ... and the update that follows moves every trainable parameter of the policy and value heads (the
        # Q network's value is a min over twin heads, so a head that is never the min gets no gradient: each
        # parameter has to change in at least one head).
        original = dict(reference.network.named_parameters())
        head = trainer.model.policy_head
        if policy_init == "residual":  # the base stays the offline network; every weight of the correction moves
            assert all(torch.equal(p, original[n]) for n, p in head.base.named_parameters())
            trained = {f"correction.{n}": p for n, p in head.correction.named_parameters()}
            original = _initial_correction(tiny_run)
        else:
            trained = dict(head.named_parameters())
        optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
        assert all(id(p) in optimized and p.requires_grad for p in trained.values())
        changed: dict[str, bool] = {}
        for name, param in trained.items():
            key = re.sub(r"heads\.\d+\.", "heads.*.", name)
            changed[key] = changed.get(key, False) or not torch.equal(param, original[name])
        # Except a head's output bias: it adds the same to every candidate's Q where its head is the min, which
        # the softmax cancels; it gets a gradient only where the min switches heads between an observation's
        # candidates, else rounding noise or none (on a fresh install: none, and it stayed put).
        output_bias = max((k for k in changed if re.search(r"mlp\.\d+\.bias$", k)),
                          key=lambda k: int(k.split(".")[-2]))
        del changed[output_bias]
        assert all(changed.values()), [k for k, v in changed.items() if not v]
        assert all(p.abs().sum() > 0 for p in trainer.model.value_mlp[-1].parameters())
        second = trainer.train_iteration()
        assert second["objective/kl"] > 0.0
    finally:
        trainer.close()


@pytest.mark.parametrize("policy_init", ["residual", "copy"])
def test_tau_sets_the_temperature_of_the_policy_and_of_the_reference(tiny_run, policy_init):
    torch.set_num_threads(1)
    trainer = _trainer(tiny_run, policy_init=policy_init, tau=0.25)
    try:
        reference = trainer.reference
        assert reference.tau == 1.0  # the checkpoint's own temperature, which --tau overrides
        observations, (state, cands, mask, pair), probs = _first_decision(trainer)
        ref_probs = trainer.reference_policy(state, cands, mask, pair)[0].exp()
        for i, observation in enumerate(observations):
            text = reference.render(trainer.featurizer.histories[i], observation["text"])
            q = torch.from_numpy(reference.score(text, observation["candidates"]))
            expected = torch.softmax(q / 0.25, 0)
            n = len(observation["candidates"])
            torch.testing.assert_close(probs[i, :n], expected, atol=1e-6, rtol=0)
            torch.testing.assert_close(ref_probs[i, :n], expected, atol=1e-6, rtol=0)
            # A colder softmax than the checkpoint's: the same argmax, more mass on it.
            assert probs[i, :n].max() > torch.softmax(q, 0).max()
        assert trainer.train_iteration()["objective/kl"] == 0.0  # both at tau 0.25: the same policy
    finally:
        trainer.close()


def _initial_correction(run) -> dict[str, torch.Tensor]:
    """The residual correction's weights before any update (an untrained trainer's)."""
    trainer = _trainer(run, policy_init="residual")
    try:
        correction = trainer.model.policy_head.correction
        return {f"correction.{n}": p.detach().clone() for n, p in correction.named_parameters()}
    finally:
        trainer.close()


def test_the_value_head_has_its_own_learning_rate_and_both_anneal(tiny_run):
    assert PPOConfig(learning_rate=2e-5).value_learning_rate == 2e-5  # by default, the policy's
    trainer = _trainer(tiny_run, learning_rate=1e-5, value_learning_rate=1e-3, anneal_lr=True, iterations=4)
    try:
        policy, value = trainer.optimizer.param_groups
        trainable = [p for p in trainer.model.parameters() if p.requires_grad]  # not the residual's frozen base
        assert {id(p) for p in policy["params"]} == {id(p) for p in trainer.model.policy_head.correction.parameters()}
        assert {id(p) for p in value["params"]} == {id(p) for p in trainer.model.value_mlp.parameters()}
        assert len(policy["params"]) + len(value["params"]) == len(trainable)  # nothing left out of the optimizer
        trainer.iteration = 1
        trainer.train_iteration()
        assert policy["lr"] == pytest.approx(1e-5 * 0.75) and value["lr"] == pytest.approx(1e-3 * 0.75)
    finally:
        trainer.close()


def test_from_scratch_has_the_offline_architecture_and_new_weights(tiny_run):
    trainer = _trainer(tiny_run, from_scratch=True, beta=0.0, seed=1)  # the checkpoint was made with seed 0
    try:
        fresh = dict(trainer.model.policy_head.named_parameters())
        for name, param in trainer.reference.network.named_parameters():
            assert fresh[name].shape == param.shape
            assert not torch.equal(fresh[name], param)
    finally:
        trainer.close()


def test_kl_and_entropy_gradients_are_finite_with_padding_slots():
    mask = torch.tensor([[True, True, False]])
    logits = torch.tensor([[0.3, -0.2, 0.0]], requires_grad=True)
    logp = masked_log_softmax(logits, mask)
    ref_logp = masked_log_softmax(torch.tensor([[0.0, 0.0, 0.0]]), mask)
    (exact_kl(logp, ref_logp, mask) + entropy(logp, mask)).sum().backward()
    assert torch.isfinite(logits.grad).all()


def _kl_to_reference(trainer) -> float:
    """Mean exact KL(pi || pi_ref) over the states of the trainer's stored rollout."""
    C, D = trainer.storage.obs_cands.shape[2:]
    state, cands = trainer.storage.obs_state.reshape(-1, D), trainer.storage.obs_cands.reshape(-1, C, D)
    mask = trainer.storage.masks.reshape(-1, C)
    with torch.no_grad():
        logp = masked_log_softmax(trainer.model.logits(state, cands, mask), mask)
    return float(exact_kl(logp, trainer.storage.ref_logps.reshape(-1, C), mask).mean())


@pytest.mark.parametrize("kl_gradient", [True, False])
def test_the_kl_penalty_pulls_the_policy_back_only_through_its_own_gradient(tiny_run, kl_gradient):
    # The KL term of the reward does not depend on the action taken, so with zero advantages the clipped
    # objective has no gradient: only the penalty's direct gradient (kl_gradient) can move the policy, and it
    # must move it toward the reference.
    torch.set_num_threads(1)
    trainer = _trainer(tiny_run, beta=1.0, kl_gradient=kl_gradient, learning_rate=3e-3, max_update_kl=None)
    try:
        trainer.train_iteration()  # fills the rollout storage from the untouched copy
        trainer.optimizer.state.clear()  # Adam's momentum would move the policy even with zero gradients
        with torch.no_grad():
            for param in trainer.model.policy_head.parameters():
                if param.requires_grad:  # the correction (the residual's base is frozen)
                    param.add_(0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(0)))
        before, params = _kl_to_reference(trainer), [p.clone() for p in trainer.model.policy_head.parameters()]
        zeros = torch.zeros(trainer.config.num_steps, trainer.config.num_envs)
        row = trainer.update(zeros, zeros, beta=1.0)
        after = _kl_to_reference(trainer)
        assert before > 0.05 and row["loss/policy"] == 0.0
        if kl_gradient:
            assert after < 0.7 * before and row["loss/kl"] > 0.0
        else:
            assert after == before
            assert all(torch.equal(p, q) for p, q in zip(params, trainer.model.policy_head.parameters(), strict=True))
    finally:
        trainer.close()


def test_a_residual_network_starts_as_its_base_trains_only_its_correction_and_rebuilds_from_its_config():
    from offline_agent.learn.networks import QNetwork, ResidualQNetwork, build_network

    torch.manual_seed(0)
    base = QNetwork(dim=8, hidden=16)
    state, cands = torch.randn(3, 8), torch.randn(3, 4, 8)
    mask = torch.tensor([[True, True, True, False]] * 3)
    # Fine-tuning a fine-tuned policy nests one residual in another: still the base at the start.
    twice = ResidualQNetwork.around(ResidualQNetwork.around(base, hidden=16, scale=0.1), hidden=16, scale=0.1)
    torch.testing.assert_close(twice.q_values(state, cands, mask), base.q_values(state, cands, mask), rtol=0, atol=0)
    trainable = {n for n, p in twice.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("correction.") for n in trainable)
    with torch.no_grad():
        twice.correction.heads[0].mlp[-1].bias.fill_(1.0)  # the correction adds scale * 1 to every valid slot
    q = twice.q_values(state, cands, mask)
    torch.testing.assert_close(q[:, :3], base.q_values(state, cands, mask)[:, :3] + 0.1)
    assert torch.isinf(q[:, 3]).all()
    rebuilt = build_network(twice.config())
    rebuilt.load_state_dict(twice.state_dict(), strict=True)
    torch.testing.assert_close(rebuilt.q_values(state, cands, mask), q, rtol=0, atol=0)


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_subgoal_shaping_in_the_rollout_rewards_follows_the_env_sub_goals(tiny_run, weight):
    """Errand's sub-goals: look (wait), then repair. Each step's shaping, recomputed from the calls the env
    executed, is in the rewards the trainer stores; with weight 0 the rewards are the env's."""
    from online_envs import DROP, EXECUTED, REPAIR, WAIT

    from offline_agent.learn.policy import Policy

    gamma, T, N = 0.9, 16, 2
    config = PPOConfig(num_envs=N, num_steps=T, vector="sync", beta=0.0, gamma=gamma, subgoal_shaping=weight)
    trainer = PPOTrainer(Policy.load(tiny_run), "online_envs:make_errand", config)
    try:
        EXECUTED.clear()
        trainer.collect_rollout(beta=0.0)
    finally:
        trainer.close()
    chosen = [EXECUTED[t * N : (t + 1) * N] for t in range(T)]  # sync envs step in order: env 0, then env 1
    expected = np.zeros((T, N))
    for i in range(N):
        phi, waited, steps = 0.0, False, 0
        for t in range(T):
            call = chosen[t][i]
            waited |= call == WAIT
            steps += 1
            done = call in (REPAIR, DROP) or steps >= 4
            next_phi = (int(waited) + int(call == REPAIR)) / 2
            expected[t, i] = weight * ((0.0 if done else gamma * next_phi) - phi)
            phi, waited, steps = (0.0, False, 0) if done else (next_phi, waited, steps)
    assert weight == 0.0 or np.abs(expected).max() > 0  # the rollout did make (and end with) progress
    np.testing.assert_allclose(trainer.storage.shaping.numpy(), expected, atol=1e-6)
    rollout = trainer.storage
    torch.testing.assert_close(rollout.rewards, rollout.scores + rollout.shaping)
