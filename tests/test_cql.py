"""The offline learner: exact values of every loss, batches, configs, "it learns", determinism, checkpoints."""

from __future__ import annotations

import dataclasses
import math

import learn_data
import numpy as np
import pytest
import torch
from learn_envs import SPEC

from offline_agent.errors import UserError
from offline_agent.learn.bc import BCConfig, bc_loss, top_episode_rows, train_bc
from offline_agent.learn.cql import (
    METRICS,
    CQLConfig,
    conservative_penalty,
    cql_loss,
    double_q_target,
    monte_carlo_loss,
    policy_probs,
    train_cql,
)
from offline_agent.learn.d3rlpy_bridge import D3rlpyCQLConfig, train_d3rlpy_cql
from offline_agent.learn.features import make_batch
from offline_agent.learn.fqe import FQEConfig, fitted_q_evaluation, fqe_target
from offline_agent.learn.networks import FactorisedQNetwork, QHead, QNetwork, VocabQNetwork
from offline_agent.learn.policy import Policy, load_checkpoint, save_checkpoint
from offline_agent.learn.train import make_config, train
from offline_agent.text.states import StateSettings

T = torch.tensor


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- exact values on hand-built tensors --------------------------------------------------------------


def test_double_q_target_takes_the_argmax_of_the_online_net_and_the_value_of_the_target_net():
    reward, done = T([1.0, 0.5]), T([0.0, 1.0])
    online = T([[1.0, 3.0, 2.0], [5.0, 0.0, 0.0]])
    target = T([[10.0, 20.0, 30.0], [7.0, 7.0, 7.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    y = double_q_target(reward, done, 0.5, online, target, mask)
    # row 0: online argmax is slot 1, the target says 20 there (not its own max 30); row 1 is terminal
    assert torch.equal(y, T([1.0 + 0.5 * 20.0, 0.5]))
    mask[0, 1] = False  # a masked slot can never be a*
    assert double_q_target(reward, done, 0.5, online, target, mask)[0] == 1.0 + 0.5 * 30.0


def test_the_loss_uses_the_double_q_target():
    f = learn_data.color_lock_features()
    torch.manual_seed(0)
    net, target = QNetwork(f.dim, 16), QNetwork(f.dim, 16)
    batch = make_batch(f, torch.arange(64), torch.Generator().manual_seed(0))
    with torch.no_grad():
        next_cand = batch.action_table[batch.next_cand_ids]  # (B, C', D)
        online = net.all_heads(batch.next_state, next_cand).min(0).values
        full = target.all_heads(batch.next_state, next_cand).min(0).values
    y = double_q_target(batch.reward, batch.done, 0.9, online, full, batch.next_mask)
    loss = cql_loss(net, target, batch, CQLConfig(gamma=0.9))
    assert loss.q_target_mean == pytest.approx(float(y.mean()), abs=1e-6)


def test_double_q_target_ignores_the_next_state_of_a_terminal_row_even_if_it_is_all_padding():
    y = double_q_target(T([2.0]), T([1.0]), 0.9, T([[0.0]]), T([[float("-inf")]]), T([[False]]))
    assert torch.equal(y, T([2.0]))


def test_conservative_penalty_is_logsumexp_over_candidates_and_the_data_action_minus_its_value():
    q_data = T([1.0, 0.0])
    q_cand = T([[0.0, 2.0, 5.0], [1.0, 1.0, 1.0]])
    mask = T([[True, True, False], [True, False, False]])
    penalty = conservative_penalty(q_data, q_cand, mask)
    expected = [math.log(math.e + 1 + math.e**2) - 1.0, math.log(1 + math.e)]
    assert torch.allclose(penalty, T(expected))
    # no other candidate: logsumexp over {a} alone is Q(s, a), so nothing is pushed
    assert conservative_penalty(T([3.0]), T([[9.0]]), T([[False]])).item() == 0.0


def test_cal_ql_floors_the_pushed_down_values_at_the_monte_carlo_return():
    q_data, q_cand, mask = T([1.0]), T([[0.0, 2.0, 5.0]]), T([[True, True, False]])
    floored = conservative_penalty(q_data, q_cand, mask, floor=T([1.5]))
    # max(0, 1.5) = 1.5, max(2, 1.5) = 2, the masked slot stays out; the data action is never floored
    assert torch.allclose(floored, T([math.log(math.e + math.e**1.5 + math.e**2) - 1.0]))
    assert floored > conservative_penalty(q_data, q_cand, mask)


def test_the_monte_carlo_loss_is_the_squared_gap_to_the_logged_return_per_head():
    q_data = T([[1.0, 0.5], [0.0, 2.0]])  # (K, B)
    assert torch.equal(monte_carlo_loss(q_data, T([0.5, 1.0])), T([[0.25, 0.25], [0.25, 1.0]]))


def test_the_monte_carlo_weight_adds_its_term_to_the_loss_and_zero_leaves_the_loss_as_it_was():
    f = learn_data.color_lock_features()
    torch.manual_seed(0)
    net, target = (FactorisedQNetwork(f.dim, hidden=16, rank=4, pair_hidden=8) for _ in range(2))
    batch = make_batch(f, torch.arange(64), torch.Generator().manual_seed(0), return_to_go=f.returns_to_go(0.9))
    plain = cql_loss(net, target, batch, CQLConfig(gamma=0.9))
    weighted = cql_loss(net, target, batch, CQLConfig(gamma=0.9, mc_weight=0.5))
    with torch.no_grad():
        q_data = net.all_heads(batch.state, batch.action_table[batch.action_id][:, None, :])[:, :, 0]  # (K, B)
    expected = 0.5 * monte_carlo_loss(q_data, batch.return_to_go).mean(1).sum()
    assert plain.mc == 0.0 and weighted.mc == pytest.approx(float(expected), rel=1e-5)
    assert float(weighted.total.detach()) == pytest.approx(float(plain.total.detach()) + float(expected), rel=1e-5)
    assert (weighted.td, weighted.cql) == (plain.td, plain.cql)


def test_the_penalty_broadcasts_over_heads():
    q_data = T([[1.0], [2.0]])  # (K, B)
    q_cand = T([[[0.0, 2.0]], [[1.0, 1.0]]])  # (K, B, C)
    both = conservative_penalty(q_data, q_cand, T([[True, True]]))
    one = [conservative_penalty(q_data[k], q_cand[k], T([[True, True]])) for k in range(2)]
    assert torch.allclose(both, torch.stack(one))


def test_policy_is_a_softmax_of_q_over_tau_on_valid_candidates():
    probs = policy_probs(T([[1.0, 2.0, 9.0]]), T([[True, True, False]]), tau=0.5)
    e1, e2 = math.exp(2.0), math.exp(4.0)
    assert torch.allclose(probs, T([[e1 / (e1 + e2), e2 / (e1 + e2), 0.0]]))


def test_bc_loss_is_the_cross_entropy_of_the_logged_action():
    loss = bc_loss(T([2.0]), T([[0.0, 1.0]]), T([[True, True]]))
    assert torch.allclose(loss, T([-math.log(math.e**2 / (math.e**2 + 1 + math.e))]))


def test_fqe_target_follows_the_evaluated_policy_at_the_next_state():
    y = fqe_target(T([1.0, 1.0]), T([0.0, 1.0]), 0.5, T([[2.0, 4.0, float("-inf")], [9.0, 9.0, 9.0]]),
                   T([[0.25, 0.75, 0.0], [0.5, 0.5, 0.0]]))
    assert torch.allclose(y, T([1.0 + 0.5 * (0.5 + 3.0), 1.0]))
    # Where the policy's choice at s' is not in the logs near it, the bound stands in for its value.
    q, pi = T([[2.0, 4.0], [6.0, 8.0], [6.0, 8.0]]), T([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    unlogged = torch.tensor([True, False, True])
    y = fqe_target(T([0.0, 0.5, 0.5]), T([0.0, 0.0, 1.0]), 0.5, q, pi, unlogged, bound=-1.0)
    assert torch.allclose(y, T([0.5 * -1.0, 0.5 + 0.5 * 6.0, 0.5]))  # the last is terminal: no next value


def test_the_first_layer_of_a_q_head_is_a_linear_map_of_the_concatenation():
    torch.manual_seed(0)
    head = QHead(dim=5, hidden=7)
    s, a = torch.randn(3, 5), torch.randn(3, 4, 5)
    weight = torch.cat([head.w_state.weight, head.w_action.weight, head.w_product.weight], 1)  # (H, 3D)
    x = torch.cat([s[:, None, :].expand(-1, 4, -1), a, s[:, None, :] * a], -1)  # (B, C, 3D)
    expected = head.mlp(x @ weight.T + head.w_state.bias).squeeze(-1)
    assert torch.allclose(head(s, a), expected, atol=1e-5)


@pytest.mark.parametrize("adapters", [False, True])
def test_scoring_candidates_by_id_gives_the_values_of_scoring_their_embeddings(adapters):
    torch.manual_seed(0)
    net = QNetwork(dim=6, hidden=8, n_heads=2, state_adapter=adapters, action_adapter=adapters)
    for p in net.parameters():  # adapters start as the identity: give them something to do
        torch.nn.init.normal_(p, std=0.3)
    s, table = torch.randn(4, 6), torch.randn(5, 6)
    ids = torch.tensor([[0, 3, 3], [4, 4, 4], [1, 0, 2], [2, 2, 0]])
    assert net.all_heads_by_id(s, table, ids).shape == (2, 4, 3)
    learn_data.assert_same_scores_and_gradients(
        net, lambda: net.all_heads_by_id(s, table, ids), lambda: net.all_heads(s, table[ids])
    )


def test_the_loss_is_the_same_whether_candidates_come_as_ids_or_as_embeddings():
    f = learn_data.color_lock_features()
    torch.manual_seed(0)
    net, target = QNetwork(f.dim, 16), QNetwork(f.dim, 16)
    batch = make_batch(f, torch.arange(64), torch.Generator().manual_seed(0))
    config = CQLConfig(gamma=0.9, alpha=0.5)
    as_ids = cql_loss(net, target, batch, config)
    # The same loss scored from the candidates' embeddings, as the learner did before it took ids.
    with torch.no_grad():
        q = net.all_heads(batch.state, torch.cat([batch.action[:, None, :], batch.cand], 1))  # (K, B, 1 + C)
        next_cand = batch.action_table[batch.next_cand_ids]  # (B, C', D)
        online = net.all_heads(batch.next_state, next_cand).min(0).values
        y = double_q_target(batch.reward, batch.done, 0.9, online,
                            target.all_heads(batch.next_state, next_cand).min(0).values, batch.next_mask)
    td = float((q[:, :, 0] - y[None, :]).pow(2).mean(1).sum())
    floor = batch.return_to_go  # Cal-QL is on by default
    cql = 0.5 * float(conservative_penalty(q[:, :, 0], q[:, :, 1:], batch.cand_mask, floor).mean(1).sum())
    q_min = q.min(0).values
    other_mean = (q_min[:, 1:] * batch.cand_mask).sum() / batch.cand_mask.sum()
    expected = {"td": td, "cql": cql, "q_data_mean": float(q_min[:, 0].mean()),
                "q_ood_gap": float(q_min[:, 0].mean() - other_mean), "q_target_mean": float(y.mean())}
    for name, value in expected.items():
        assert getattr(as_ids, name) == pytest.approx(value, abs=1e-5), name


def test_q_values_are_the_min_over_heads_and_minus_infinity_in_masked_slots():
    torch.manual_seed(0)
    net = QNetwork(dim=6, hidden=8, n_heads=2)
    s, a = torch.randn(2, 6), torch.randn(2, 3, 6)
    mask = T([[True, True, False], [True, True, True]])
    q = net.q_values(s, a, mask)
    heads = net.all_heads(s, a)
    assert q[0, 2] == float("-inf")
    assert torch.allclose(q[1], heads[:, 1].min(0).values)


# --- batches and features ------------------------------------------------------------------------------


def test_a_batch_leaves_the_data_action_out_of_its_candidates_and_offers_the_next_logged_action():
    f = learn_data.color_lock_features()
    assert f.has_candidates.all() and f.n_actions == 4 and f.candidate_ids.shape[1] == 4
    rows = torch.arange(f.n_steps)
    batch = make_batch(f, rows, torch.Generator().manual_seed(0))
    # ColorLock offers every button each step: the other 3 are candidates, the data action is masked
    assert batch.cand_mask.sum(1).eq(3).all()
    assert not (batch.cand_ids.masked_fill(~batch.cand_mask, -1) == batch.action_id[:, None]).any()
    last = f.next_index < 0
    assert torch.equal(batch.done.bool(), f.terminated | last)
    # the next action is already among the next step's candidates, so its extra slot is masked
    assert batch.next_mask[:, :4].sum(1).eq(4).all() and not batch.next_mask[:, 4].any()


def test_steps_without_logged_candidates_get_sampled_ones():
    f = learn_data.color_lock_features()
    g = dataclasses.replace(f, has_candidates=torch.zeros_like(f.has_candidates))
    batch = make_batch(g, torch.arange(32), torch.Generator().manual_seed(0), n_sampled=6)
    assert batch.cand_ids.shape == (32, 6) and (batch.cand_ids >= 0).all()
    assert (batch.cand_ids < f.n_actions).all()


def test_filtered_bc_keeps_the_top_episodes_by_return_with_ties():
    f = learn_data.color_lock_features()
    rows = f.rows("train")
    kept = top_episode_rows(f, rows, 0.2)
    returns = f.episode_return[f.episode_index[kept]]
    assert 0 < kept.numel() < rows.numel() and (returns == 1.0).all()  # successes all return 1: all kept
    assert torch.equal(top_episode_rows(f, rows, 1.0), rows)


# --- configs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: CQLConfig(alpha=-1.0), r"alpha must be >= 0, got -1.0: use e.g. --alpha 1.0"),
        (lambda: CQLConfig(mc_weight=-1.0), r"mc_weight must be >= 0, got -1.0: e.g. --mc-weight 1.0"),
        (lambda: CQLConfig(tau=0.0), r"tau \(policy temperature\) must be > 0, got 0.0"),
        (lambda: CQLConfig(gamma=1.5), r"gamma must be in \[0, 1\], got 1.5"),
        (lambda: CQLConfig(steps=0), r"steps must be >= 1, got 0; e.g. --steps 2000"),
        (lambda: CQLConfig(device="tpu"), r"device must be cpu, cuda or cuda:N, got 'tpu'"),
        (lambda: BCConfig(filter_fraction=0.0), r"filter_fraction must be in \(0, 1\], got 0.0"),
        (lambda: D3rlpyCQLConfig(alpha=-2.0), r"alpha must be >= 0, got -2.0"),
        (lambda: FQEConfig(split="holdout"), r"split must be one of train, valid, test, got 'holdout'"),
        (lambda: FQEConfig(unlogged="worst"), r"unlogged must be one of extrapolate, low, high, got 'worst'"),
        (lambda: FQEConfig(unlogged="low", greedy=False), r"defined for the greedy policy: pass greedy=True"),
        (lambda: FQEConfig(fit_on="train"), r"fit_on must be split or all, got 'train'"),
        (lambda: make_config("sac"), r"unknown algorithm 'sac': use --algo one of cql, bc, filtered-bc, d3rlpy-cql"),
        (lambda: make_config("bc", cal_ql=True), r"--algo bc has no setting cal_ql"),
    ],
)
def test_bad_configs_are_one_line_user_errors(make, match):
    with pytest.raises(UserError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_a_dataset_without_actions_is_a_user_error(tmp_path):
    from offline_agent.dataset import write_dataset
    from offline_agent.learn.features import build_features
    from offline_agent.schema import EPISODES_SCHEMA, STEPS_SCHEMA

    empty = write_dataset(tmp_path / "empty", STEPS_SCHEMA.empty_table(), EPISODES_SCHEMA.empty_table(), None, {})
    with pytest.raises(UserError, match=r"has no actions \(0 steps\)"):
        build_features(empty, learn_data.encoder())


def test_alpha_with_bc_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"--algo bc has none: drop --alpha"):
        train(learn_data.color_lock_dataset(), "bc", tmp_path / "run", alpha=1.0)


# --- training ---------------------------------------------------------------------------------------------

FAST = {"steps": 300, "batch_size": 64, "hidden": 64, "learning_rate": 1e-3, "target_update_rate": 0.02}


def _success(network, episodes: int = 60) -> float:
    from offline_agent.online.play import rollout_policy

    meta = {"algo": "test", "tau": 0.1, "k": learn_data.K, "max_tokens": 256}
    policy = Policy(network, learn_data.encoder(), meta)
    outcomes = rollout_policy(SPEC, policy, episodes, seed=123)
    return sum(o.success for o in outcomes) / episodes


@pytest.mark.parametrize("cal_ql, mc_weight, min_gap", [(True, 0.0, 0.03), (False, 0.0, 0.1), (True, 1.0, 0.03)])
def test_cql_learns_to_open_the_lock_far_better_than_random(cal_ql, mc_weight, min_gap):
    from offline_agent.online.play import rollout_policy

    f = learn_data.color_lock_features()
    net, history = train_cql(f, CQLConfig(**FAST, cal_ql=cal_ql, mc_weight=mc_weight, log_every=50))
    assert [r["step"] for r in history] == [50, 100, 150, 200, 250, 300]
    assert set(METRICS) <= set(history[-1])
    # The logged (mostly right) buttons are valued above the others; Cal-QL's floor (the return, in [0, 1]
    # here) stops the push-down of the others sooner, so its gap is smaller.
    assert history[-1]["q/ood_gap"] > min_gap
    random = rollout_policy(SPEC, "behaviour:random", 200, seed=123)
    random_rate = sum(o.success for o in random) / 200
    learned = _success(net)
    assert random_rate < 0.3 and learned >= 0.9, (random_rate, learned)


@pytest.mark.parametrize("make", [
    lambda dim: QNetwork(dim, hidden=16, n_heads=2, state_adapter=True, action_adapter=True),
    lambda dim: FactorisedQNetwork(dim, hidden=16, rank=4, pair_hidden=8, state_adapter=True, action_adapter=True),
], ids=["pairwise", "factorised"])
def test_every_trainable_parameter_changes_in_a_step(make):
    f = learn_data.color_lock_features()
    torch.manual_seed(0)
    net, target = make(f.dim), make(f.dim)
    target.load_state_dict(net.state_dict())
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    batch = make_batch(f, torch.arange(64), torch.Generator().manual_seed(0))
    for _ in range(2):  # an adapter's zero-initialised output layer lets gradients reach its input layer
        loss = cql_loss(net, target, batch, CQLConfig())
        optimizer.zero_grad()
        loss.total.backward()
        optimizer.step()
    unchanged = [n for n, p in net.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []


def test_training_is_deterministic_under_a_seed():
    f = learn_data.color_lock_features()
    config = {"steps": 20, "batch_size": 32, "hidden": 32, "log_every": 5, "seed": 7}
    a = train_cql(f, CQLConfig(**config))[1]
    b = train_cql(f, CQLConfig(**config))[1]
    c = train_cql(f, CQLConfig(**{**config, "seed": 8}))[1]
    assert a == b and a != c
    assert train_bc(f, BCConfig(steps=10, batch_size=16, hidden=16, seed=3))[1] == \
        train_bc(f, BCConfig(steps=10, batch_size=16, hidden=16, seed=3))[1]


def test_training_on_two_threads_gives_the_same_weights_every_time():
    # With two CPU threads the backward of x[idx] accumulated rows in thread order: before training ran under
    # torch's deterministic algorithms, these three runs gave three different networks.
    f = learn_data.color_lock_features()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cql_runs = [train_cql(f, CQLConfig(steps=20, seed=0))[0].state_dict() for _ in range(3)]
        bc_runs = [train_bc(f, BCConfig(steps=20, seed=0))[0].state_dict() for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    for runs in (cql_runs, bc_runs):
        for other in runs[1:]:
            assert all(torch.equal(runs[0][k], other[k]) for k in runs[0])
    assert not torch.are_deterministic_algorithms_enabled()  # the setting is restored after training


def test_bc_and_filtered_bc_learn_from_the_logs():
    f = learn_data.color_lock_features()
    fast = {"steps": 300, "batch_size": 64, "hidden": 64, "learning_rate": 1e-3}
    net, history = train_bc(f, BCConfig(**fast, filter_fraction=0.2))
    assert history[-1]["policy/data_prob"] > 0.3  # above uniform (0.25): successful episodes err less
    assert _success(net) >= 0.8


def test_d3rlpy_cql_trains_on_the_same_features_writes_no_logs_and_exports_without_pickle(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    f = learn_data.color_lock_features()
    net, history = train_d3rlpy_cql(f, D3rlpyCQLConfig(steps=200, batch_size=64, hidden=64, log_every=50,
                                                       learning_rate=1e-3, target_update_interval=50))
    assert list(tmp_path.iterdir()) == []  # no ./d3rlpy_logs
    assert [r["step"] for r in history] == [50, 100, 150, 200] and {"loss/td", "loss/cql"} <= set(history[-1])
    assert isinstance(net, VocabQNetwork) and torch.equal(net.vocab_emb, f.action_emb)
    # candidates map to their own vocabulary entry; order of the candidates does not matter
    cand = f.action_emb[[3, 0, 2]][None]  # (1, 3, D)
    assert torch.equal(net.nearest_action(cand), T([[3, 0, 2]]))
    assert _success(net) >= 0.6


# --- checkpoints and the policy -------------------------------------------------------------------------


def test_save_and_load_give_identical_scores_for_every_network_kind(tmp_path):
    f = learn_data.color_lock_features()
    enc = learn_data.encoder()
    meta = {"algo": "cql", "tau": 0.1, "k": 0, "max_tokens": 256,
            "encoder": {"id": enc.id, "path": enc.path, "dim": enc.dim, "max_length": enc.max_length}}
    torch.manual_seed(0)
    for i, net in enumerate([QNetwork(f.dim, 32, 2, state_adapter=True), VocabQNetwork(f.dim, f.n_actions, 32)]):
        if isinstance(net, VocabQNetwork):
            net.vocab_emb.copy_(f.action_emb)
        run = tmp_path / f"run{i}"
        save_checkpoint(run, net, meta)
        assert sorted(p.name for p in run.iterdir()) == ["policy.json", "policy.safetensors"]
        loaded, loaded_meta = load_checkpoint(run / "policy.json")
        assert loaded_meta["network"] == net.config()
        before = Policy(net, enc, meta)
        after = Policy.load(run, encoder=enc)
        state = "Task: open it\n[obs] Panel 1 of 3 shows RED."
        cands = [{"name": "press", "arguments": {"color": c}} for c in ("red", "blue")] + ['{"name":"x"}']
        assert np.array_equal(before.score(state, cands), after.score(state, cands))
        probs = after.probabilities(state, cands)
        assert probs.shape == (3,) and abs(probs.sum() - 1) < 1e-6


def test_a_checkpoint_from_another_encoder_is_refused(tmp_path):
    enc = learn_data.encoder()
    meta = {"algo": "cql", "tau": 0.1, "k": 0, "max_tokens": None,
            "encoder": {"id": "some-other-model-0123456789ab", "path": "/nowhere", "dim": enc.dim, "max_length": 256}}
    save_checkpoint(tmp_path / "run", QNetwork(enc.dim, 8), meta)
    with pytest.raises(UserError, match=r"trained on embeddings of encoder some-other-model-0123456789ab"):
        Policy.load(tmp_path / "run", encoder=enc)
    with pytest.raises(UserError, match=r"holds no policy checkpoint"):
        Policy.load(tmp_path)


@pytest.mark.parametrize("k, keep_opening", [(2, False), (1, True)])
def test_the_policy_renders_states_as_the_training_data_did(k, keep_opening):
    """The state text a Policy builds while playing is the text dataset_texts rendered from the logs."""
    from offline_agent.envs.loading import make_env
    from offline_agent.envs.policies import make_policy
    from offline_agent.simulate import episode_seed
    from offline_agent.text.states import dataset_texts

    settings = StateSettings(k=k, keep_opening=keep_opening)
    logged = dataset_texts(learn_data.color_lock_dataset(), settings).states
    if keep_opening:  # the setting changes the texts (the third step's shows its first turn)
        assert set(logged) != set(dataset_texts(learn_data.color_lock_dataset(), StateSettings(k=k)).states)
    env = make_env(SPEC)
    behaviour = make_policy(learn_data.BEHAVIOUR, 0)
    meta = settings.to_meta()
    policy = Policy(QNetwork(learn_data.encoder().dim, 8), learn_data.encoder(), meta)
    obs, info = env.reset(seed=episode_seed(0, 0))
    policy.reset(info["task"])
    rendered = []
    for _ in range(3):
        rendered.append(policy.render(policy.history, obs["text"]))
        index = behaviour(env, obs)
        policy.history.turns.append((obs["text"], policy_text(obs["candidates"][index])))
        obs, _, terminated, truncated, _ = env.step(index)
        if terminated or truncated:
            break
    assert set(rendered) <= set(logged)


def policy_text(candidate):
    from offline_agent.actions import canonical_action

    return canonical_action(candidate)


# --- FQE --------------------------------------------------------------------------------------------------


def test_fqe_values_a_good_policy_above_the_logged_behaviour():
    f = learn_data.color_lock_features()
    net, _ = train_cql(f, CQLConfig(**FAST))
    # 600 steps: on per-turn vectors FQE's value was still rising at 300 (0.51, then 0.93 at 600).
    result = fitted_q_evaluation(f, net, FQEConfig(steps=600, batch_size=64, hidden=64, learning_rate=1e-3,
                                                   target_update_rate=0.02, split="test", log_every=200))
    assert result.episodes == int((f.episode_split == 2).sum()) and len(result.history) == 3
    # the greedy policy opens ~every lock in 3 steps: V ~ 0.99^2; the noisy behaviour about half of them
    assert result.value > result.behaviour_value and 0.6 < result.value < 1.1, result


def test_a_greedy_policys_next_value_is_scored_at_its_choice_alone(monkeypatch):
    from offline_agent.learn import fqe

    ids, mask = torch.tensor([[4, 7, -1], [2, 5, 9]]), torch.tensor([[True, True, False], [True, True, True]])
    pi = T([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    cut = fqe.only_chosen(ids, mask, pi)
    assert cut[0].tolist() == [[7], [9]] and cut[1].all() and cut[2].tolist() == [[1.0], [1.0]]
    q = T([[2.0, 4.0, float("-inf")], [6.0, 8.0, 3.0]])
    y = fqe_target(T([1.0, 0.0]), T([0.0, 0.0]), 0.5, q, pi)
    assert torch.equal(y, fqe_target(T([1.0, 0.0]), T([0.0, 0.0]), 0.5, q.gather(1, T([[1], [2]]).long()), cut[2]))
    # A whole fit: the same value as when the target network scores every candidate (the sums' last bits aside).
    f = learn_data.color_lock_features()
    torch.manual_seed(0)
    net = QNetwork(f.dim, 16, n_heads=1)
    config = FQEConfig(steps=100, batch_size=32, hidden=32, learning_rate=1e-3, split="test", log_every=100)
    fast = fitted_q_evaluation(f, net, config)
    monkeypatch.setattr(fqe, "only_chosen", lambda *d: d)
    every = fitted_q_evaluation(f, net, config)
    assert torch.allclose(fast.episode_values, every.episode_values, atol=1e-5), (fast.value, every.value)


def test_fqe_scores_a_factorised_policy_by_id_and_reads_choices_scored_once():
    from offline_agent.learn import fqe
    from offline_agent.learn.features import step_candidates

    f = learn_data.color_lock_features()
    torch.manual_seed(0)
    net = FactorisedQNetwork(f.dim, 16, n_heads=2, rank=8, pair_hidden=8)
    rows = torch.arange(f.n_steps)
    ids, mask = step_candidates(f, rows)
    # the action tower once over the vocabulary gives what it gives slot by slot
    per_slot = net.q_values(f.state_emb[rows], f.action_emb[ids.clamp(min=0)], mask).detach()
    by_id = fqe.q_over(net, f, rows, ids, mask)
    assert torch.equal(by_id.isinf(), ~mask) and torch.allclose(by_id[mask], per_slot[mask], atol=1e-6)
    # refits that read the policy's choices, scored once at every step, get what scoring their own steps gives
    config = FQEConfig(steps=100, batch_size=32, hidden=32, learning_rate=1e-3, split="test", log_every=100,
                       resample=True)
    choices = fqe.policy_choices(net, f, rows, config.tau, config.greedy)
    assert choices[0].shape == (f.n_steps, 1)
    once = fitted_q_evaluation(f, net, config, choices=choices)
    assert torch.equal(once.episode_values, fitted_q_evaluation(f, net, config).episode_values)
    with pytest.raises(ValueError, match="choices hold 3 rows"):
        fitted_q_evaluation(f, net, config, choices=tuple(t[:3] for t in choices))


def test_fqe_bounds_bracket_the_estimate_and_put_the_bound_where_the_first_choice_is_unlogged():
    from offline_agent.learn.fqe import policy_distribution, unlogged_choices

    f = learn_data.color_lock_features()
    torch.manual_seed(0)
    net = QNetwork(f.dim, 16, n_heads=1)  # untrained: its choices often differ from the logged ones
    common = dict(steps=200, batch_size=64, hidden=32, learning_rate=1e-3, split="test", log_every=200)
    fits = {u: fitted_q_evaluation(f, net, FQEConfig(**common, unlogged=u)) for u in ("low", "extrapolate", "high")}
    firsts = f.first_rows("test")
    ids, _, pi = policy_distribution(net, f, firsts, 0.1, greedy=True)
    unlogged = unlogged_choices(f, firsts, ids, pi, f.rows("test"), k=10)
    assert 0 < int(unlogged.sum()) < len(firsts)  # some first choices are logged nearby, some are not
    returns = f.returns_to_go(f.gamma)
    assert torch.all(fits["low"].episode_values[unlogged] == returns.min())
    assert torch.all(fits["high"].episode_values[unlogged] == returns.max())
    assert fits["low"].value <= fits["extrapolate"].value <= fits["high"].value
    assert fits["high"].value - fits["low"].value > 0.2


def test_train_writes_a_run_folder_and_hits_the_embedding_cache_the_second_time(tmp_path):
    import polars as pl

    dataset = learn_data.fresh_copy(tmp_path / "ds")
    enc, k0 = learn_data.encoder(), StateSettings(k=0)
    first = train(dataset, "cql", tmp_path / "run", steps=20, batch_size=16, encoder=enc, state_settings=k0,
                  settings={"hidden": 16, "log_every": 5})
    assert first.cache_misses == 0  # fresh_copy carries the cache the shared features filled
    (dataset / "embeddings").rename(tmp_path / "moved-cache")
    again = train(dataset, "cql", tmp_path / "run2", steps=20, batch_size=16, encoder=enc, state_settings=k0,
                  settings={"hidden": 16, "log_every": 5})
    assert again.cache_misses > 0 and again.cache_hits == 0
    third = train(dataset, "cql", tmp_path / "run3", steps=20, batch_size=16, encoder=enc, state_settings=k0,
                  settings={"hidden": 16, "log_every": 5})
    assert third.cache_misses == 0 and third.cache_hits == again.cache_misses
    metrics = pl.read_parquet(tmp_path / "run" / "metrics.parquet")
    assert metrics["step"].to_list() == [5, 10, 15, 20] and set(METRICS) <= set(metrics.columns)
    assert metrics.equals(pl.read_parquet(tmp_path / "run2" / "metrics.parquet"))  # same seed, same run
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["curves.png", "metrics.parquet", "policy.json", "policy.safetensors", "texts.safetensors",
                     "train.json", "value.safetensors"]
    with pytest.raises(UserError, match=r"already holds a trained policy: choose another --out, or pass --overwrite"):
        train(dataset, "cql", tmp_path / "run", steps=5, encoder=enc, state_settings=k0)
    # Features built by the caller carry their state settings; settings that disagree are refused.
    opening = StateSettings(k=learn_data.K, keep_opening=True)
    with pytest.raises(ValueError, match=r"features were built with keep_opening=False, not keep_opening=True"):
        train(dataset, "cql", tmp_path / "run4", steps=5, encoder=enc, state_settings=opening,
              features=learn_data.color_lock_features())
