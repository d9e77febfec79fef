"""Grounding of candidate actions in their episode: exact features, the table the learners use, the
networks' extra input, checkpoints, the CLI, and "it learns" where embeddings alone cannot tell."""

from __future__ import annotations

import learn_data
import numpy as np
import pytest
import torch
from learn_envs import CODE_LOCK_SPEC

from offline_agent.actions import tool_call_text
from offline_agent.learn.cql import CQLConfig, cql_loss, double_q_target
from offline_agent.learn.features import build_features, make_batch
from offline_agent.learn.grounding import (
    GROUNDING_FEATURES,
    PAIR_DIM,
    GroundingTable,
    StringFinder,
    features_in,
    grounding,
    grounding_batch,
    occurs,
    situation,
    split_state,
)
from offline_agent.learn.networks import QHead, QNetwork, ResidualQNetwork, build_network
from offline_agent.learn.policy import Policy, save_checkpoint
from offline_agent.text.states import StateSettings, dataset_texts, render_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOOKUP = '{"name":"lookup_customer","arguments":{"email":"ana@example.com"}}'
STATE = render_state(
    "Help the customer ana@example.com with a double charge.",
    [("Customer: I was charged twice.", LOOKUP), ("found customer C-17", "Thanks. Please confirm the last four.")],
    "Customer: It ends in 8551.",
)


def call(name: str, **arguments) -> str:
    return tool_call_text(name, arguments)


def features(state: str, action: str, taken=None) -> dict[str, float]:
    return dict(zip(GROUNDING_FEATURES, grounding(state, action, taken).tolist(), strict=True))


# --- the features, by hand ------------------------------------------------------------------------------


def test_the_state_text_splits_into_context_current_observation_and_actions():
    context, observation, actions = split_state(STATE)
    assert observation == "customer: it ends in 8551."
    assert context == (
        "help the customer ana@example.com with a double charge.\ncustomer: i was charged twice.\n"
        "found customer c-17\ncustomer: it ends in 8551."
    )
    assert actions == [LOOKUP, "Thanks. Please confirm the last four."]
    # observations span lines; a bare prompt is all context and all observation
    assert split_state("[obs] arrived at mill_rd.\n[T-7 at mill_rd] cargo: water x4")[1] == (
        "arrived at mill_rd.\n[t-7 at mill_rd] cargo: water x4"
    )
    assert split_state("What is 2 + 2?") == ("what is 2 + 2?", "what is 2 + 2?", [])


def test_a_value_occurs_only_as_a_whole_word():
    assert occurs("c-17", "found customer c-17.") and occurs("8551", "ends in 8551")
    assert not occurs("7", "found customer c-17") and not occurs("c-1", "found customer c-17")
    assert not occurs("example.com", "ana@mail.example.community")
    assert occurs("ana@example.com", "(ana@example.com)")


def test_grounding_of_right_and_made_up_argument_values():
    verify = call("verify_identity", customer_id="C-17", last4="8551")
    assert features(STATE, verify) == {
        "is_call": 1.0, "has_values": 1.0, "values_in_context": 1.0, "values_in_observation": 0.5,
        "name_in_observation": 0.0, "taken_before": 0.0, "tool_used_before": 0.0, "repeats_last": 0.0,
        "values_in_one_clause": 0.0, "task_clause_observed": 0.0,
    }
    # the last four reversed: one value of two is grounded, and not in the current observation
    reversed_last4 = features(STATE, call("verify_identity", customer_id="C-17", last4="1558"))
    assert reversed_last4["values_in_context"] == 0.5 and reversed_last4["values_in_observation"] == 0.0
    # a made-up e-mail domain: the call was made before (tool), but not this call, and its value is nowhere
    made_up = features(STATE, call("lookup_customer", email="ana@mail.example.com"))
    assert made_up["values_in_context"] == 0.0 and made_up["taken_before"] == 0.0
    assert made_up["tool_used_before"] == 1.0
    # values the agent itself wrote in an earlier call are not grounding: "C-99" only appears in an [act] line
    own = render_state("t", [("hello", call("get_orders", customer_id="C-99"))], "no orders")
    assert features(own, call("get_payments", customer_id="C-99"))["values_in_context"] == 0.0


def test_repeats_messages_and_the_tool_named_by_an_error():
    again = features(STATE, LOOKUP)
    assert again["taken_before"] == 1.0 and again["repeats_last"] == 0.0 and again["has_values"] == 1.0
    message = features(STATE, "Thanks. Please confirm the last four.")
    assert message == {name: 0.0 for name in GROUNDING_FEATURES} | {"taken_before": 1.0, "repeats_last": 1.0}
    error = render_state(None, [], "ERROR load: no pick list at depot; query_inventory(depot) first.")
    query = features(error, call("query_inventory", location="depot"))
    assert query["name_in_observation"] == 1.0 and query["values_in_observation"] == 1.0
    assert features(error, call("list_orders"))["has_values"] == 0.0


def test_the_episode_history_reaches_further_back_than_the_state_window():
    turns = [(f"obs {i}", call("step", n=i)) for i in range(6)]
    window = render_state("t", turns, "now", StateSettings(k=2))
    first = call("step", n=0)
    assert features(window, first)["taken_before"] == 0.0  # out of the window's [act] lines
    taken = [a for _, a in turns]
    assert features(window, first, taken)["taken_before"] == 1.0
    assert features(window, call("step", n=5), taken)["repeats_last"] == 1.0


DISPATCH = render_state(
    "Deliver every order, then end the shift. Orders: O-3330 3 x water to harbor; O-8191 4 x tires to mill_rd.",
    [("Shift started.", call("move", to="harbor"))],
    "arrived at harbor.\n[T-7 at harbor, 11:21] cargo: water x3, tires x4 | delivered 0/2",
)


def test_a_call_is_related_to_what_the_task_says_about_its_values():
    right, wrong = (features(DISPATCH, call("deliver", order_id=o)) for o in ("O-3330", "O-8191"))
    # the task's clause on O-3330 names water and harbor, both in the observation; O-8191's names tires and
    # mill_rd, and the truck is not at mill_rd
    assert right["task_clause_observed"] == 1.0 and wrong["task_clause_observed"] == 0.5
    assert right["values_in_context"] == wrong["values_in_context"] == 1.0  # the old features cannot tell
    # "to" and "x" are too short to count; a clause that does not name the value does not count either
    assert features(DISPATCH, call("move", to="depot"))["task_clause_observed"] == 0.0
    # two values: the quantity with its item is in one clause, another quantity is not. Of its clause, water
    # sees harbor (of o-3330, harbor) and 3 sees water and harbor (of o-3330, water, harbor)
    load = features(DISPATCH, call("load", item="water", qty=3))
    assert load["values_in_one_clause"] == 1.0 and load["task_clause_observed"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert features(DISPATCH, call("load", item="water", qty=4))["values_in_one_clause"] == 0.0
    assert features(DISPATCH, call("deliver", order_id="O-3330"))["values_in_one_clause"] == 0.0  # one value
    # values that the task does not name: C-17 and 8551 are in different clauses of the conversation
    verify = features(STATE, call("verify_identity", customer_id="C-17", last4="8551"))
    assert verify["values_in_one_clause"] == 0.0 and verify["task_clause_observed"] == 0.0


def test_a_batch_of_states_is_padded_with_zeros():
    pair = grounding_batch([STATE, "[obs] hi"], [[LOOKUP, "Thanks"], ["hi"]], width=3, taken=[None, ["hi"]])
    assert pair.shape == (2, 3, PAIR_DIM) and pair.dtype == torch.float32
    assert torch.equal(pair[0, 0], torch.from_numpy(grounding(STATE, LOOKUP)))
    assert pair[1, 0, GROUNDING_FEATURES.index("taken_before")] == 1.0
    assert not pair[0, 2].any() and not pair[1, 1:].any()


# --- the table the learners read -----------------------------------------------------------------------------


def test_the_table_gives_each_logged_pair_its_grounding_with_the_episode_so_far():
    texts = ["[obs] at a", "[obs] at b", "[obs] at c", "[obs] at a"]
    vocab = [call("go", to="a"), call("go", to="b"), "hello"]
    action_id, episode_index = torch.tensor([0, 1, 2, 0]), torch.tensor([0, 0, 0, 1])
    table = GroundingTable(texts, vocab, action_id, episode_index)
    assert table.taken_before(0) == [] and table.taken_before(2) == [vocab[0], vocab[1]]
    assert table.taken_before(3) == []  # a new episode starts afresh
    pair = table.lookup(torch.tensor([2, 3]), torch.tensor([[0, 1, -1], [0, 2, -1]]))
    assert torch.equal(pair[0, 0], torch.from_numpy(grounding(texts[2], vocab[0], [vocab[0], vocab[1]])))
    assert pair[0, 0, GROUNDING_FEATURES.index("taken_before")] == 1.0
    assert pair[0, 1, GROUNDING_FEATURES.index("repeats_last")] == 1.0
    assert pair[0, 0, GROUNDING_FEATURES.index("values_in_observation")] == 0.0  # row 2 is "at c"
    assert pair[1, 0, GROUNDING_FEATURES.index("values_in_observation")] == 1.0  # row 3 is "at a"
    assert not pair[:, 2].any()


def test_the_string_finder_finds_exactly_the_strings_that_occur():
    strings = ["o-3330", "3330", "ana@example.com", "-5", "$", "4 x water", "water", "e", "17", "7", "x1", "été",
               "(none)", "a.b", "b"]
    texts = ["order o-3330: 4 x water to harbor", "refund -5 or $20 to ana@example.com.", "x17 7 x1y été",
             "(none) a.b", "", "ab-5 $$ 4 x waters"]
    finder = StringFinder(strings)
    for text in texts:
        assert finder.found_in(text) == [i for i, s in enumerate(strings) if occurs(s, text)], text
    assert [strings[i] for i in finder.found_in(texts[0])] == ["o-3330", "3330", "4 x water", "water"]


def table_inputs(dataset):
    """What `build_features` hands the table (state texts, vocabulary, action ids, episode index), without
    encoding anything."""
    from offline_agent.dataset import TrajectoryDataset

    ds = TrajectoryDataset.open(dataset)
    texts = dataset_texts(ds)
    steps = ds.steps_table(columns=["episode_id", "action"]).to_pydict()
    vocab = sorted(set(steps["action"]) | set(texts.candidates))
    index = {a: i for i, a in enumerate(vocab)}
    episodes = {e: i for i, e in enumerate(dict.fromkeys(steps["episode_id"]))}
    return (texts.states, vocab, torch.tensor([index[a] for a in steps["action"]]),
            torch.tensor([episodes[e] for e in steps["episode_id"]]))


def assert_table_is_features_in(table, texts, vocab, rows):
    """The table's grounding of `rows` against the whole vocabulary equals `features_in` pair by pair."""
    got = table.lookup(rows, torch.arange(len(vocab))[None].expand(len(rows), -1))  # (n, V, P)
    for i, row in enumerate(rows.tolist()):
        where = situation(texts[row], table.taken_before(row))
        expected = torch.from_numpy(np.stack([features_in(where, a) for a in vocab]))
        assert torch.equal(got[i], expected), (row, (got[i] != expected).nonzero()[:3].tolist())
    return got


def test_the_table_equals_the_features_of_every_pair_in_simulated_logs(tmp_path):
    from offline_agent.ingest import ingest
    from offline_agent.simulate import simulate

    nonzero = torch.zeros(PAIR_DIM, dtype=torch.bool)
    for env in ("Logistics-v0", "CustomerSupport-v0", "PipelineRepair-v0"):
        simulate(f"offline_agent/{env}", 6, "noisy:0.5", 0, tmp_path / f"{env}.jsonl")
        ingest([tmp_path / f"{env}.jsonl"], tmp_path / env)
        texts, vocab, action_id, episode_index = table_inputs(tmp_path / env)
        table = GroundingTable(texts, vocab, action_id, episode_index)
        got = assert_table_is_features_in(table, texts, vocab, torch.arange(len(texts)))
        nonzero |= got.flatten(0, 1).bool().any(0)
    assert nonzero.all(), [f for f, seen in zip(GROUNDING_FEATURES, nonzero, strict=True) if not seen]
    # slots past a step's candidates (-1) read zeros
    assert not table.lookup(torch.tensor([0, 1]), torch.tensor([[-1, 0], [-1, -1]]))[:, 0].any()


def test_the_table_equals_the_features_on_real_logs(real_data, tmp_path):
    from offline_agent.ingest import ingest

    ingest([real_data / "tau_bench_airline" / "gpt-4o-airline.json"], tmp_path / "tau")
    texts, vocab, action_id, episode_index = table_inputs(tmp_path / "tau")
    table = GroundingTable(texts, vocab, action_id, episode_index)
    rows = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))[:60]
    got = assert_table_is_features_in(table, texts, vocab, rows)
    assert got[..., GROUNDING_FEATURES.index("values_in_context")].any()


def test_a_grounded_batch_carries_each_slots_grounding():
    f = learn_data.color_lock_features()
    with pytest.raises(ValueError, match="keep_texts=True"):
        type(f)(**{**f.__dict__, "state_texts": None, "_grounding": None}).grounding_table()
    settings = StateSettings(k=learn_data.K)
    f = build_features(learn_data.color_lock_dataset(), learn_data.encoder(), settings, keep_texts=True)
    rows = torch.arange(40)
    batch = make_batch(f, rows, torch.Generator().manual_seed(0), grounding=f.grounding_table())
    assert batch.pair.shape == (40, 1 + batch.cand_ids.shape[1], PAIR_DIM)
    table = f.grounding_table()
    for i in (0, 7, 39):
        row = int(rows[i])
        expected = grounding(f.state_texts[row], f.vocab[int(f.action_id[row])], table.taken_before(row))
        assert torch.equal(batch.pair[i, 0], torch.from_numpy(expected))
        j = int(batch.cand_ids[i, 0])
        assert torch.equal(batch.pair[i, 1], torch.from_numpy(grounding(f.state_texts[row], f.vocab[j],
                                                                        table.taken_before(row))))
    # the next step's slots: grounding at the next row, zeros where a slot is masked
    nxt = int(f.next_index[0])
    k = int(batch.next_mask[0].nonzero()[0])
    expected = grounding(f.state_texts[nxt], f.vocab[int(batch.next_cand_ids[0, k])], table.taken_before(nxt))
    assert torch.equal(batch.next_pair[0, k], torch.from_numpy(expected))
    assert not batch.next_pair[~batch.next_mask].any()
    # ColorLock's presses name the colour the panel shows: the logged expert press is grounded there
    assert batch.pair[:, :, GROUNDING_FEATURES.index("values_in_observation")].any()


# --- the networks' extra input ------------------------------------------------------------------------------


def test_the_first_layer_of_a_grounded_head_is_a_linear_map_of_the_concatenation():
    torch.manual_seed(0)
    head = QHead(dim=5, hidden=7, pair_dim=3)
    s, a, g = torch.randn(2, 5), torch.randn(2, 4, 5), torch.rand(2, 4, 3)
    weight = torch.cat([head.w_state.weight, head.w_action.weight, head.w_product.weight, head.w_pair.weight], 1)
    x = torch.cat([s[:, None, :].expand(-1, 4, -1), a, s[:, None, :] * a, g], -1)  # (B, C, 3D + P)
    expected = head.mlp(x @ weight.T + head.w_state.bias).squeeze(-1)
    torch.testing.assert_close(head(s, a, pair=g), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="pass `pair`"):
        head(s, a)


def test_a_head_trained_on_fewer_grounding_features_reads_the_first_ones():
    torch.manual_seed(0)
    head = QHead(dim=5, hidden=7, pair_dim=3)  # a checkpoint from before features were appended
    s, a, g = torch.randn(2, 5), torch.randn(2, 4, 5), torch.rand(2, 4, 5)
    torch.testing.assert_close(head(s, a, pair=g), head(s, a, pair=g[..., :3]))


def test_grounded_scores_by_id_match_scores_by_embedding_and_a_residual_sees_the_grounding_too():
    torch.manual_seed(0)
    net = QNetwork(dim=6, hidden=8, n_heads=2, pair_dim=PAIR_DIM)
    s, table = torch.randn(3, 6), torch.randn(5, 6)
    ids = torch.tensor([[0, 3, 3], [4, 4, 1], [2, 0, 1]])
    pair = torch.rand(3, 3, PAIR_DIM)
    torch.testing.assert_close(net.all_heads_by_id(s, table, ids, pair), net.all_heads(s, table[ids], pair))
    assert not torch.allclose(net.all_heads(s, table[ids], pair), net.all_heads(s, table[ids], pair * 0))
    residual = ResidualQNetwork.around(net, hidden=8, scale=0.5)
    assert residual.pair_dim == PAIR_DIM and residual.correction.pair_dim == PAIR_DIM
    mask = torch.ones(3, 3, dtype=torch.bool)
    torch.testing.assert_close(residual.q_values(s, table[ids], mask, pair), net.q_values(s, table[ids], mask, pair))
    assert build_network(net.config()).pair_dim == PAIR_DIM
    assert build_network({k: v for k, v in net.config().items() if k != "pair_dim"}).pair_dim == 0  # old files


def test_the_grounded_cql_loss_scores_every_slot_with_its_grounding():
    settings = StateSettings(k=learn_data.K)
    f = build_features(learn_data.color_lock_dataset(), learn_data.encoder(), settings, keep_texts=True)
    torch.manual_seed(0)
    net, target = QNetwork(f.dim, 16, pair_dim=PAIR_DIM), QNetwork(f.dim, 16, pair_dim=PAIR_DIM)
    batch = make_batch(f, torch.arange(64), torch.Generator().manual_seed(0), grounding=f.grounding_table())
    config = CQLConfig(gamma=0.9, alpha=0.5, grounding=True)
    loss = cql_loss(net, target, batch, config)
    with torch.no_grad():
        q = net.all_heads(batch.state, torch.cat([batch.action[:, None, :], batch.cand], 1), batch.pair)
        next_cand = batch.action_table[batch.next_cand_ids]
        online = net.all_heads(batch.next_state, next_cand, batch.next_pair).min(0).values
        full = target.all_heads(batch.next_state, next_cand, batch.next_pair).min(0).values
        y = double_q_target(batch.reward, batch.done, 0.9, online, full, batch.next_mask)
    assert loss.q_data_mean == pytest.approx(float(q.min(0).values[:, 0].mean()), abs=1e-5)
    assert loss.q_target_mean == pytest.approx(float(y.mean()), abs=1e-5)


# --- decision time, checkpoints, "it learns" ------------------------------------------------------------------


def test_a_grounded_policy_round_trips_and_scores_with_the_episodes_history(tmp_path):
    enc = learn_data.encoder()
    meta = {"algo": "cql", "tau": 0.1, "k": 1, "max_tokens": 256,
            "encoder": {"id": enc.id, "path": enc.path, "dim": enc.dim, "max_length": enc.max_length}}
    torch.manual_seed(0)
    net = QNetwork(enc.dim, 16, 2, pair_dim=PAIR_DIM)
    save_checkpoint(tmp_path / "run", net, meta)
    before, after = Policy(net, enc, meta), Policy.load(tmp_path / "run", encoder=enc)
    assert after.network.pair_dim == PAIR_DIM
    cands = [call("verify_identity", customer_id="C-17", last4=x) for x in ("8551", "1558")]
    assert np.array_equal(before.score(STATE, cands), after.score(STATE, cands))
    # act() checks repeats against the whole episode, not only the k = 1 turn its state text shows
    first, second = call("step", n=0), call("step", n=1)
    after.reset("t")
    after.history.turns = [("a", first), ("b", second)]
    obs = {"text": "go", "candidates": [first, second]}
    state = after.render(after.history, "go")
    assert first not in split_state(state)[2]  # out of the window
    by_history = after.score_batch([state], [obs["candidates"]], [[first, second]])[0]
    expected = net.q_values(
        torch.from_numpy(after.embed([state])), torch.from_numpy(after.embed(obs["candidates"]))[None],
        torch.ones(1, 2, dtype=torch.bool), grounding_batch([state], [obs["candidates"]], 2, [[first, second]]),
    )[0].detach().numpy()
    np.testing.assert_allclose(by_history, expected, atol=1e-6)
    assert not np.allclose(by_history, after.score(state, obs["candidates"]))  # the text alone misses `first`
    assert after.act(obs) == int(np.argmax(by_history))


@pytest.fixture(scope="module")
def code_lock_features():
    from offline_agent.ingest import ingest
    from offline_agent.simulate import simulate

    root = learn_data.root() / "code_lock"
    root.mkdir(exist_ok=True)
    simulate(CODE_LOCK_SPEC, 100, "noisy:0.7", 0, root / "logs.jsonl")
    ingest([root / "logs.jsonl"], root / "dataset")
    return build_features(root / "dataset", learn_data.encoder(), StateSettings(k=0), keep_texts=True)


@pytest.fixture(scope="module")
def code_lock_policies(code_lock_features):
    """CQL on the CodeLock logs without and with grounding: {grounded: network}."""
    from offline_agent.learn.cql import train_cql

    return {
        grounded: train_cql(code_lock_features, CQLConfig(steps=300, batch_size=64, hidden=64, seed=0,
                                                          grounding=grounded))[0]
        for grounded in (False, True)
    }


def test_grounded_cql_learns_to_type_the_code_it_is_shown(code_lock_features, code_lock_policies):
    """Every keypad shows a fresh 4-digit code and offers it among three made-up ones: grounding says which
    call's value is the one on the screen, which MiniLM's two vectors only roughly do."""
    from offline_agent.online.play import rollout_policy

    f, enc = code_lock_features, learn_data.encoder()
    rates = {}
    for grounded, net in code_lock_policies.items():
        policy = Policy(net, enc, {"algo": "cql", "tau": CQLConfig.tau, **f.state_settings.to_meta()})
        outcomes = rollout_policy(CODE_LOCK_SPEC, policy, 60, 5)
        rates[grounded] = sum(o.success for o in outcomes) / len(outcomes)
    assert rates[True] >= 0.95, rates
    assert rates[True] >= rates[False] + 0.1, rates


def test_grounded_fqe_tells_a_policy_that_types_the_code_from_one_that_guesses(code_lock_features, code_lock_policies):
    """FQE values the greedy policy's choice at every next state. Without grounding its Q sees the right code
    and the made-up ones as near-identical calls and gives both policies about the logs' average (measured:
    0.83-0.87 for each, against simulated values of 0.98 and 0.23); with it, it values each by what it types."""
    from offline_agent.learn.fqe import FQEConfig, fitted_q_evaluation

    f = code_lock_features
    values = {}
    for fqe_grounding in (False, True):
        config = FQEConfig(steps=600, batch_size=64, hidden=64, learning_rate=1e-3, target_update_rate=0.02,
                           split="test", log_every=600, grounding=fqe_grounding)
        values[fqe_grounding] = {policy_grounded: fitted_q_evaluation(f, net, config).value
                                 for policy_grounded, net in code_lock_policies.items()}
    grounded = values[True]
    assert grounded[True] >= 0.9 and grounded[False] <= 0.65, values  # simulated: 0.98 and 0.23
    gap = {fqe_grounding: v[True] - v[False] for fqe_grounding, v in values.items()}
    assert gap[True] >= gap[False] + 0.3, values
