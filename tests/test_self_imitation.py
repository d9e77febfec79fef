"""Self-imitation: the returns and the loss by hand, the buffer keeps exactly the successful episodes'
steps, and its updates make the policy take them more often."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from offline_agent.actions import canonical_action
from offline_agent.errors import UserError
from offline_agent.online.config import PPOConfig
from offline_agent.online.kl import masked_log_softmax
from offline_agent.online.ppo import PPOTrainer
from offline_agent.online.self_imitation import Step, SuccessBuffer, imitation_steps, self_imitation_loss


def test_the_loss_imitates_only_what_did_better_than_expected_and_leaves_v_alone():
    logp = torch.tensor([-0.5, -1.0, -2.0], requires_grad=True)
    values = torch.tensor([0.4, 0.5, 0.5], requires_grad=True)
    returns = torch.tensor([1.0, 0.2, 0.5])  # R - V = 0.6, -0.3, 0.0: only the first row is imitated
    loss = self_imitation_loss(logp, returns, values)
    torch.testing.assert_close(loss, torch.tensor(0.5 * 0.6 / 3))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-0.6 / 3, 0.0, 0.0]))
    assert values.grad is None  # V is the baseline here, not trained by this loss


def test_the_imitation_steps_are_passes_over_the_buffer_so_few_while_it_is_small():
    assert imitation_steps(2048, 2.0, 128) == 32
    assert imitation_steps(180, 2.0, 128) == 3  # ceil(2.8125)
    assert imitation_steps(1, 0.5, 128) == 1


def _step(marker: float, reward: float, action: int = 1) -> Step:
    return Step(
        state=torch.full((2,), marker), cands=torch.full((3, 2), marker), mask=torch.tensor([True, True, False]),
        pair=None, ref_value=torch.tensor(marker), action=action, reward=reward,
    )


def test_the_buffer_keeps_successful_episodes_only_with_their_returns_oldest_out_first():
    buffer = SuccessBuffer(capacity=4, num_envs=2, candidates=3, dim=2, pair_dim=None)
    for t in range(3):
        buffer.record(0, _step(10 + t, reward=1.0 if t == 2 else 0.0))
        buffer.record(1, _step(20 + t, reward=0.0))
    assert buffer.end_episode(1, success=False, gamma=0.5) == 0 and buffer.size == 0
    assert buffer.end_episode(0, success=True, gamma=0.5) == 3
    assert buffer.size == 3 and buffer.open == [[], []]
    torch.testing.assert_close(buffer.state[:3, 0], torch.tensor([10.0, 11.0, 12.0]))
    torch.testing.assert_close(buffer.returns[:3], torch.tensor([0.25, 0.5, 1.0]))
    # A second success of two steps fills the last row and overwrites the oldest one.
    buffer.record(1, _step(30, reward=0.0, action=0))
    buffer.record(1, _step(31, reward=2.0, action=0))
    assert buffer.end_episode(1, success=True, gamma=0.5) == 2
    assert buffer.size == 4 and buffer.next == 1
    torch.testing.assert_close(buffer.state[:, 0], torch.tensor([31.0, 11.0, 12.0, 30.0]))
    torch.testing.assert_close(buffer.returns, torch.tensor([2.0, 0.5, 1.0, 1.0]))
    assert buffer.action.tolist() == [0, 1, 1, 0]
    buffer.record(0, _step(40, reward=1.0))
    buffer.drop_open()
    assert buffer.open == [[], []] and buffer.size == 4
    copy = SuccessBuffer(capacity=4, num_envs=2, candidates=3, dim=2, pair_dim=None)
    copy.load(buffer.tensors())
    assert (copy.size, copy.next) == (4, 1)
    for name in SuccessBuffer.NAMES[:3] + SuccessBuffer.NAMES[4:]:
        assert torch.equal(getattr(copy, name), getattr(buffer, name)), name


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"self_imitation": -1.0}, "self_imitation must be >= 0"),
     ({"self_imitation_buffer": 0}, "self-imitation-buffer must be >= 1"),
     ({"self_imitation_epochs": 0.0}, "self_imitation_epochs must be > 0"),
     ({"self_imitation_start": -1}, "self_imitation_start must be >= 0")],
)
def test_config_rejects_bad_self_imitation_settings(settings, message):
    with pytest.raises(UserError, match=message):
        PPOConfig(**settings)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from online_envs import tiny_checkpoint, tiny_encoder_folder

    root = tmp_path_factory.mktemp("tiny")
    return tiny_checkpoint(root / "run", tiny_encoder_folder(root / "encoder"))


def test_rollouts_buffer_exactly_the_successful_episodes_and_imitation_raises_their_calls(tiny_run):
    """Widget: `repair` ends an episode with success (reward 1), `drop_table` with failure, a time limit
    after 4 steps. With beta 0 a kept step's return is gamma ** (steps to the repair). Rollouts of 2 steps
    are shorter than most episodes, so the storage is overwritten under the steps of open episodes."""
    from online_envs import DROP, EXECUTED, REPAIR

    from offline_agent.learn.policy import Policy

    gamma, T, N, rollouts = 0.9, 2, 2, 12
    config = PPOConfig(num_envs=N, num_steps=T, vector="sync", beta=0.0, gamma=gamma, self_imitation=1.0,
                       learning_rate=1e-2, checkpoint_every=100, num_minibatches=2, self_imitation_epochs=0.5)
    trainer = PPOTrainer(Policy.load(tiny_run), "online_envs:make_widget", config)
    try:
        EXECUTED.clear()
        for _ in range(rollouts):
            trainer.collect_rollout(beta=0.0)
            trainer.iteration += 1  # as train_iteration does: the episodes run on (no checkpoint reset)
        chosen = [EXECUTED[t * N : (t + 1) * N] for t in range(T * rollouts)]  # sync envs step env 0, then 1
        expected, calls = [], []  # returns and calls of the steps of successful episodes, in the order they end
        open_episodes: list[list[int]] = [[] for _ in range(N)]
        for t in range(T * rollouts):
            for i in range(N):
                open_episodes[i].append(t)
                steps = len(open_episodes[i])
                if chosen[t][i] == REPAIR:
                    expected += [gamma ** (steps - 1 - k) for k in range(steps)]
                    calls += [canonical_action(chosen[k][i]) for k in open_episodes[i]]
                if chosen[t][i] in (REPAIR, DROP) or steps >= 4:
                    open_episodes[i] = []
        buffer = trainer.success_buffer
        assert len(expected) > 0 and buffer.size == len(expected)
        torch.testing.assert_close(buffer.returns[: buffer.size], torch.tensor(expected))
        assert [len(steps) for steps in buffer.open] == [len(steps) for steps in open_episodes]
        # The call each kept step remembers is the one it made: its own candidates, not what the storage held
        # when its episode ended.
        texts = list(dict.fromkeys(calls))
        vectors = torch.from_numpy(np.stack([trainer.featurizer.memo[text] for text in texts]))  # (V, D)
        rows = torch.arange(buffer.size)
        called = buffer.cands[rows, buffer.action[rows]]  # (K, D)
        nearest = torch.cdist(called, vectors).argmin(-1)
        assert [texts[j] for j in nearest] == calls

        def mean_logp_of_buffered_calls() -> float:
            with torch.no_grad():
                rows = slice(0, buffer.size)
                logits = trainer.model.logits(buffer.state[rows], buffer.cands[rows], buffer.mask[rows])
                logp = masked_log_softmax(logits, buffer.mask[rows])
                return float(logp.gather(1, buffer.action[rows][:, None]).mean())

        before = mean_logp_of_buffered_calls()
        params = [p.detach().clone() for p in trainer.model.policy_head.parameters() if p.requires_grad]
        metrics = trainer.imitate()
        after = mean_logp_of_buffered_calls()
        assert metrics["self_imitation/buffer_steps"] == buffer.size and metrics["loss/self_imitation"] > 0
        assert after > before
        trained = [p for p in trainer.model.policy_head.parameters() if p.requires_grad]
        assert any(not torch.equal(a, b) for a, b in zip(params, trained, strict=True))
        # Half a pass over the buffer in minibatches of N * T / 2 = 2 rows.
        assert {int(trainer.optimizer.state[p]["step"]) for p in trained} == {math.ceil(buffer.size / 4)}
    finally:
        trainer.close()


def test_without_self_imitation_there_is_no_buffer_and_the_metrics_are_zero(tiny_run):
    from offline_agent.learn.policy import Policy

    config = PPOConfig(num_envs=2, num_steps=8, vector="sync", beta=0.0, self_imitation=0.0)
    trainer = PPOTrainer(Policy.load(tiny_run), "online_envs:make_widget", config)
    try:
        assert trainer.success_buffer is None
        assert trainer.imitate() == {"loss/self_imitation": 0.0, "self_imitation/kl": 0.0,
                                     "self_imitation/buffer_steps": 0.0}
    finally:
        trainer.close()


def test_imitation_waits_until_the_buffer_holds_self_imitation_start_steps(tiny_run):
    from offline_agent.learn.policy import Policy

    config = PPOConfig(num_envs=2, num_steps=4, vector="sync", beta=0.0, self_imitation=1.0, checkpoint_every=100,
                       num_minibatches=2, self_imitation_start=10**6)
    trainer = PPOTrainer(Policy.load(tiny_run), "online_envs:make_widget", config)
    try:
        for _ in range(50):  # until some episode has succeeded (bounded, so a broken env fails, not hangs)
            trainer.collect_rollout(beta=0.0)
            trainer.iteration += 1
            if trainer.success_buffer.size:
                break
        size = trainer.success_buffer.size
        assert size > 0
        params = [p.detach().clone() for p in trainer.model.policy_head.parameters() if p.requires_grad]
        # Warming up: the buffer is reported, nothing is trained.
        assert trainer.imitate() == {"loss/self_imitation": 0.0, "self_imitation/kl": 0.0,
                                     "self_imitation/buffer_steps": float(size)}
        trained = [p for p in trainer.model.policy_head.parameters() if p.requires_grad]
        assert all(torch.equal(a, b) for a, b in zip(params, trained, strict=True))
        trainer.config.self_imitation_start = size  # reached: two passes in minibatches of 4 rows
        assert trainer.imitate()["loss/self_imitation"] > 0
        assert {int(trainer.optimizer.state[p]["step"]) for p in trained} == {imitation_steps(size, 2.0, 4)}
    finally:
        trainer.close()


def test_imitation_is_held_near_the_reference_by_the_kl_penalty(tiny_run):
    """Two trainers with the same seed fill the same success buffer; imitating it under beta = 10 ends much
    closer to the reference policy on the imitated states than imitating it with no penalty."""
    from offline_agent.learn.policy import Policy
    from offline_agent.online.kl import exact_kl

    def imitated(beta: float) -> tuple[float, dict[str, float]]:
        config = PPOConfig(num_envs=2, num_steps=16, vector="sync", beta=0.0, self_imitation=1.0,
                           self_imitation_epochs=8.0, num_minibatches=2, learning_rate=3e-2, checkpoint_every=100)
        trainer = PPOTrainer(Policy.load(tiny_run), "online_envs:make_widget", config)
        try:
            for _ in range(20):
                trainer.collect_rollout(beta=0.0)
                if trainer.success_buffer.size >= 8:
                    break
            metrics = trainer.imitate(beta)
            buffer, rows = trainer.success_buffer, slice(0, trainer.success_buffer.size)
            with torch.no_grad():
                args = (buffer.state[rows], buffer.cands[rows], buffer.mask[rows])
                logp = masked_log_softmax(trainer.model.logits(*args), buffer.mask[rows])
                ref_logp, _ = trainer.reference_policy(*args)
            return float(exact_kl(logp, ref_logp, buffer.mask[rows]).mean()), metrics
        finally:
            trainer.close()

    free, free_metrics = imitated(0.0)
    held, held_metrics = imitated(10.0)
    assert free > 0.05 and held < free / 3, (free, held)
    assert 0 < held_metrics["self_imitation/kl"] < free_metrics["self_imitation/kl"]
