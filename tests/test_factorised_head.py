"""The factorised Q head (CQL's default): exact scores, its three ways of scoring ids, training, checkpoints.

The pairwise `QNetwork` is kept as `--head pairwise`; `test_cql.py` holds its own exact-value tests.
"""

from __future__ import annotations

import json

import learn_data
import numpy as np
import pytest
import torch
from learn_envs import SPEC

from offline_agent.errors import UserError
from offline_agent.learn.cql import CQLConfig, conservative_penalty, cql_loss, double_q_target, train_cql
from offline_agent.learn.features import make_batch
from offline_agent.learn.networks import FactorisedQNetwork, QNetwork
from offline_agent.learn.policy import Policy, load_checkpoint, save_checkpoint

T = torch.tensor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hand_built(pair_dim: int = 0) -> FactorisedQNetwork:
    """D = 4 (so inputs are scaled by sqrt(4) = 2), one head, H = 2, R = 1, G = 1, weights set by hand:
    the state tower reads coordinates 0, 1 and the action tower 2, 3; each tower's first hidden unit is its
    reduced vector (u or v), the second its term t. Then h1 = relu(3 u v + t(s) + t(a) [- g]),
    h2 = relu(0.5 h1 - 0.25) and q = 2 h2 + 0.5."""
    net = FactorisedQNetwork(dim=4, hidden=2, n_heads=1, rank=1, pair_hidden=1, pair_dim=pair_dim)
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
        net.state_tower.first.weight.copy_(T([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
        net.action_tower.first.weight.copy_(T([[0, 0, 1.0, 0], [0, 0, 0, 1.0]]))
        for tower in (net.state_tower, net.action_tower):
            tower.second.copy_(torch.eye(2)[None])  # (K, H, R + G): u = h0, t = h1
        head = net.pair_head
        head.w_product.fill_(3.0)
        head.second.fill_(0.5)
        head.second_bias.fill_(-0.25)
        head.out.fill_(2.0)
        head.out_bias.fill_(0.5)
        if pair_dim:
            head.w_pair.fill_(-1.0)
    return net


def test_factorised_scores_are_the_two_pair_layers_over_the_towers_computed_by_hand():
    net = hand_built()
    states = T([[0.5, -0.25, 0, 0], [0, 0.5, 0, 0]])  # x2 -> (1, -0.5): u 1, t 0;  (0, 1): u 0, t 1
    actions = T([[0, 0, 0.5, 0.5], [0, 0, -0.5, 0.25]])  # x2 -> (1, 1): v 1, t 1;  (-1, 0.5): v 0, t 0.5
    q = net.all_heads(states, actions[None].expand(2, -1, -1))  # (K, B, C) = (1, 2, 2)
    # h1: (s1, a1) 3 + 0 + 1 = 4, (s1, a2) 0 + 0 + 0.5, (s2, a1) 0 + 1 + 1 = 2, (s2, a2) 0 + 1 + 0.5
    # q = 2 relu(0.5 h1 - 0.25) + 0.5: 4.0, 0.5 (the second layer's ReLU cuts 0), 2.0, 1.5
    assert torch.equal(q, T([[[4.0, 0.5], [2.0, 1.5]]]))
    grounded = hand_built(pair_dim=1)
    pair = T([[[1.0], [0.0]], [[3.0], [0.5]]])  # (B, C, P): g enters the first pair layer as -g
    q = grounded.all_heads(states, actions[None].expand(2, -1, -1), pair)
    # h1: 4 - 1 = 3, 0.5, relu(2 - 3) = 0, 1.5 - 0.5 = 1 -> q: 3.0, 0.5, 0.5, 1.0
    assert torch.equal(q, T([[[3.0, 0.5], [0.5, 1.0]]]))
    with pytest.raises(ValueError, match="pass `pair`"):
        grounded.all_heads(states, actions[None].expand(2, -1, -1))


def test_q_values_take_the_min_over_heads_and_mask_with_minus_infinity():
    torch.manual_seed(0)
    net = FactorisedQNetwork(dim=6, hidden=8, n_heads=2, rank=3, pair_hidden=4)
    s, a = torch.randn(2, 6), torch.randn(2, 3, 6)
    mask = T([[True, True, False], [True, True, True]])
    q, heads = net.q_values(s, a, mask), net.all_heads(s, a)
    assert heads.shape == (2, 2, 3) and q[0, 2] == float("-inf")
    assert torch.equal(q[1], heads[:, 1].min(0).values) and not torch.equal(heads[0], heads[1])


@pytest.mark.parametrize("adapters", [False, True])
@pytest.mark.parametrize("path", ["distinct", "whole table", "precomputed table"])
def test_scoring_by_id_gives_the_values_and_gradients_of_scoring_embeddings(adapters, path):
    torch.manual_seed(0)
    net = FactorisedQNetwork(dim=6, hidden=8, n_heads=2, rank=3, pair_hidden=4, pair_dim=2,
                             state_adapter=adapters, action_adapter=adapters)
    for p in net.parameters():  # adapters start as the identity: give them something to do
        torch.nn.init.normal_(p, std=0.3)
    s, pair = torch.randn(4, 6), torch.randn(4, 3, 2)
    # 12 id slots: a table of 5 rows is scored whole, one of 20 rows through its distinct ids
    table = torch.randn(20 if path == "distinct" else 5, 6)
    ids = T([[0, 3, 3], [4, 4, 4], [1, 0, 2], [2, 2, 0]])

    def by_id():
        if path == "precomputed table":
            return net.all_heads_by_id(s, table, ids, pair, table_vectors=net.action_vectors(table))
        return net.all_heads_by_id(s, table, ids, pair)

    learn_data.assert_same_scores_and_gradients(net, by_id, lambda: net.all_heads(s, table[ids], pair))


def test_the_cql_loss_of_a_factorised_head_is_the_loss_of_its_scores():
    f = learn_data.color_lock_features()
    torch.manual_seed(0)
    net, target = FactorisedQNetwork(f.dim, 16, rank=4, pair_hidden=8), FactorisedQNetwork(f.dim, 16, rank=4,
                                                                                            pair_hidden=8)
    batch = make_batch(f, torch.arange(64), torch.Generator().manual_seed(0))
    config = CQLConfig(gamma=0.9, alpha=0.5)
    loss = cql_loss(net, target, batch, config)  # the action tower runs once over the small table
    with torch.no_grad():
        q = net.all_heads(batch.state, torch.cat([batch.action[:, None, :], batch.cand], 1))  # (K, B, 1 + C)
        next_cand = batch.action_table[batch.next_cand_ids]  # (B, C', D)
        y = double_q_target(batch.reward, batch.done, 0.9, net.all_heads(batch.next_state, next_cand).min(0).values,
                            target.all_heads(batch.next_state, next_cand).min(0).values, batch.next_mask)
    td = float((q[:, :, 0] - y[None, :]).pow(2).mean(1).sum())
    cql = 0.5 * float(conservative_penalty(q[:, :, 0], q[:, :, 1:], batch.cand_mask, batch.return_to_go).mean(1).sum())
    assert loss.td == pytest.approx(td, abs=1e-5) and loss.cql == pytest.approx(cql, abs=1e-5)
    assert loss.q_target_mean == pytest.approx(float(y.mean()), abs=1e-5)


# --- configs and training --------------------------------------------------------------------------------


def test_the_default_head_is_factorised_and_each_head_has_its_own_default_width():
    assert (CQLConfig().head, CQLConfig().hidden) == ("factorised", 128)
    assert CQLConfig(head="pairwise").hidden == 256 and CQLConfig(head="pairwise", hidden=32).hidden == 32
    with pytest.raises(UserError, match="head must be factorised or pairwise, got 'mlp'"):
        CQLConfig(head="mlp")
    with pytest.raises(UserError, match="rank must be >= 1, got 0"):
        CQLConfig(rank=0)


def test_cql_with_the_pairwise_head_still_learns_to_open_the_lock():
    f = learn_data.color_lock_features()
    fast = {"steps": 300, "batch_size": 64, "hidden": 64, "learning_rate": 1e-3, "target_update_rate": 0.02}
    net, _ = train_cql(f, CQLConfig(**fast, head="pairwise"))
    assert isinstance(net, QNetwork)
    from offline_agent.online.play import rollout_policy

    meta = {"algo": "test", "tau": 0.1, "k": learn_data.K, "max_tokens": 256}
    outcomes = rollout_policy(SPEC, Policy(net, learn_data.encoder(), meta), 60, seed=123)
    assert sum(o.success for o in outcomes) / 60 >= 0.9


# --- checkpoints -------------------------------------------------------------------------------------------


def _meta():
    enc = learn_data.encoder()
    return {"algo": "cql", "tau": 0.1, "k": 0, "max_tokens": 256,
            "encoder": {"id": enc.id, "path": enc.path, "dim": enc.dim, "max_length": enc.max_length}}


STATE = "Task: open it\n[obs] Panel 1 of 3 shows RED."
CANDIDATES = [{"name": "press", "arguments": {"color": c}} for c in ("red", "blue", "green")]


def test_a_factorised_checkpoint_loads_and_scores_identically(tmp_path):
    enc = learn_data.encoder()
    torch.manual_seed(0)
    net = FactorisedQNetwork(enc.dim, 32, rank=8, pair_hidden=8, pair_dim=3)
    save_checkpoint(tmp_path / "run", net, _meta())
    loaded, meta = load_checkpoint(tmp_path / "run")
    assert isinstance(loaded, FactorisedQNetwork) and meta["network"]["kind"] == "factorised_q"
    assert meta["network"] == net.config()
    before, after = Policy(net, enc, _meta()), Policy.load(tmp_path / "run", encoder=enc)
    assert np.array_equal(before.score(STATE, CANDIDATES), after.score(STATE, CANDIDATES))


def test_a_pairwise_checkpoint_written_before_the_factorised_head_still_loads_and_scores_identically(tmp_path):
    enc = learn_data.encoder()
    torch.manual_seed(0)
    net = QNetwork(enc.dim, 16, 2, pair_dim=3)
    save_checkpoint(tmp_path / "run", net, _meta())
    # policy.json as the earlier version wrote it: its network entry knew no `head`, `rank` or `pair_hidden`.
    path = tmp_path / "run" / "policy.json"
    written = json.loads(path.read_text())
    written["network"] = {"kind": "candidate_q", "dim": enc.dim, "hidden": 16, "n_heads": 2, "state_adapter": False,
                          "action_adapter": False, "adapter_hidden": 128, "pair_dim": 3}
    written["config"] = {k: v for k, v in written.get("config", {}).items() if k not in ("head", "rank")}
    path.write_text(json.dumps(written))
    loaded, _ = load_checkpoint(tmp_path / "run")
    assert type(loaded) is QNetwork
    before, after = Policy(net, enc, _meta()), Policy.load(tmp_path / "run", encoder=enc)
    assert np.array_equal(before.score(STATE, CANDIDATES), after.score(STATE, CANDIDATES))


def test_train_records_the_head_it_trained(tmp_path):
    from typer.testing import CliRunner

    from offline_agent.cli import app

    dataset = learn_data.fresh_copy(tmp_path / "ds")
    runner = CliRunner()
    for head, kind in (("factorised", "factorised_q"), ("pairwise", "candidate_q")):
        out = tmp_path / head
        result = runner.invoke(app, ["train", str(dataset), "--out", str(out), "--steps", "5", "--batch-size", "8",
                                     "--k", "0", "--head", head])
        assert result.exit_code == 0, result.output
        written = json.loads((out / "policy.json").read_text())
        assert written["network"]["kind"] == kind and written["config"]["head"] == head
    result = runner.invoke(app, ["train", str(dataset), "--out", str(tmp_path / "bad"), "--head", "mlp"])
    assert result.exit_code != 0 and "head must be factorised or pairwise, got 'mlp'" in result.output
