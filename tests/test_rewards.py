import sys

import numpy as np
import pyarrow as pa
import pytest

from offline_agent.cli import main
from offline_agent.dataset import TrajectoryDataset, write_dataset
from offline_agent.errors import UserError
from offline_agent.rewards import (
    RewardParts,
    compute_rewards,
    discounted_returns,
    episode_boundaries,
    last_step_mask,
    outcome_reward,
    parse_reward_spec,
    potential_shaping,
    previous_in_episode,
    relabel,
    shaping_weight,
    step_reward,
    subgoal_potential,
    subgoal_reward,
)
from offline_agent.schema import EPISODES_SCHEMA, STEPS_SCHEMA


def test_discounted_returns_exact_values():
    rewards = np.array([1.0, 0.0, 2.0, 5.0, -1.0, 3.0], dtype=np.float32)
    episodes = np.array(["a", "a", "a", "b", "c", "c"])
    got = discounted_returns(rewards, episodes, gamma=0.5)
    # a: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5 ; b: 5 ; c: G1 = 3, G0 = -1 + 1.5 = 0.5
    np.testing.assert_array_equal(got, [1.5, 1.0, 2.0, 5.0, 0.5, 3.0])
    assert got.dtype == np.float64


def test_discounted_returns_gamma_one_is_reverse_cumsum_and_integer_ids():
    got = discounted_returns(np.array([1.0, 2.0, 3.0, 4.0]), np.array([7, 7, 7, 9]), gamma=1.0)
    np.testing.assert_array_equal(got, [6.0, 5.0, 3.0, 4.0])


def test_discounted_returns_matches_scalar_recursion_on_random_episodes():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=50)
    episodes = np.repeat(np.arange(50), lengths)
    rewards = rng.normal(size=episodes.shape[0])
    expected = np.empty_like(rewards)
    start = 0
    for length in lengths:
        g = 0.0
        for i in range(start + length - 1, start - 1, -1):
            g = rewards[i] + 0.9 * g
            expected[i] = g
        start += length
    np.testing.assert_allclose(discounted_returns(rewards, episodes, 0.9), expected, rtol=0, atol=1e-12)


def test_discounted_returns_empty_and_bad_input():
    assert discounted_returns(np.zeros(0), np.zeros(0, dtype=str), 0.9).shape == (0,)
    with pytest.raises(ValueError, match="not contiguous"):
        discounted_returns(np.ones(3), np.array(["a", "b", "a"]), 0.9)
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns(np.ones(3), np.array(["a", "a", "a"]), 1.5)


# --- helpers ---------------------------------------------------------------------------------------


def make_tables(infos=None, outcomes=(1.0, 0.5)):
    """Two episodes: 'a' with 4 steps (sub-goals 0,1,?,3 of 4) and 'b' with 2 steps (0,1 of 2)."""
    episode_ids = ["a", "a", "a", "a", "b", "b"]
    steps_in_episode = [0, 1, 2, 3, 0, 1]
    if infos is None:
        infos = [
            '{"sub_goals_done": 0, "sub_goals_total": 4}',
            '{"sub_goals_done": 1, "sub_goals_total": 4}',
            None,
            '{"sub_goals_done": 3, "sub_goals_total": 4}',
            '{"sub_goals_done": 0, "sub_goals_total": 2}',
            '{"sub_goals_done": 1, "sub_goals_total": 2}',
        ]
    n = len(episode_ids)
    steps = pa.table(
        {
            "episode_id": episode_ids,
            "step": pa.array(steps_in_episode, pa.int32()),
            "observation": [f"obs {i}" for i in range(n)],
            "action": ['{"name":"search","arguments":{}}', "hi", '{"name":"fix","arguments":{}}', "done"]
            + ["x", "y"],
            "action_kind": ["tool_call", "message", "tool_call", "final", "message", "final"],
            "tool_name": ["search", None, "fix", None, None, None],
            "tool_args": ["{}", None, "{}", None, None, None],
            "reward": pa.array([0, 0, 0, 7, 0, 3], pa.float32()),
            "return_to_go": pa.array([7, 7, 7, 7, 3, 3], pa.float32()),
            "terminated": [False, False, False, True, False, True],
            "truncated": [False] * n,
            "is_error": [False, True, False, False, False, False],
            "candidates": pa.array([None] * n, pa.list_(pa.string())),
            "info": infos,
        },
        schema=STEPS_SCHEMA,
    )
    episodes = pa.table(
        {
            "episode_id": ["a", "b"],
            "source": ["log.jsonl", "log.jsonl"],
            "task": ["t1", "t2"],
            "agent": [None, None],
            "n_steps": pa.array([4, 2], pa.int32()),
            "return": pa.array([7, 3], pa.float32()),
            "success": [True, False],
            "outcome": list(outcomes),
            "split": ["train", "test"],
            "metadata": [None, None],
        },
        schema=EPISODES_SCHEMA,
    )
    return steps, episodes


# --- reward terms: exact values --------------------------------------------------------------------

EPISODES = np.array(["a", "a", "a", "a", "b", "b"])
IS_LAST = np.array([False, False, False, True, False, True])


def test_last_step_mask_and_previous_in_episode():
    np.testing.assert_array_equal(last_step_mask(EPISODES), IS_LAST)
    got = previous_in_episode(np.arange(6.0), EPISODES, first=-1.0)
    np.testing.assert_array_equal(got, [-1, 0, 1, 2, -1, 4])


def test_outcome_reward_on_last_step_only():
    outcome = np.array([1.0, 1.0, 1.0, 1.0, np.nan, np.nan])
    np.testing.assert_array_equal(outcome_reward(outcome, IS_LAST), [0, 0, 0, 1, 0, 0])
    outcome = np.array([1.0, 1.0, 1.0, 1.0, 0.5, 0.5])
    np.testing.assert_array_equal(outcome_reward(outcome, IS_LAST, weight=2.0), [0, 0, 0, 2, 0, 1])


def test_subgoal_reward_is_weighted_increase_with_unknowns_carried_forward():
    done = np.array([0.0, 1.0, np.nan, 3.0, np.nan, 1.0])
    # a: counts 0,1,1,3 -> increases 0,1,0,2 ; b: unknown first count reads 0 -> 0,1
    np.testing.assert_allclose(subgoal_reward(done, EPISODES, 0.5), [0, 0.5, 0, 1.0, 0, 0.5], rtol=0, atol=0)


def test_step_reward():
    np.testing.assert_array_equal(step_reward(3, -0.01), [-0.01, -0.01, -0.01])


def test_potential_shaping_exact_and_terminal_potential_is_zero():
    phi = np.array([0.0, 0.5, 1.0, 0.2, 0.4])
    is_last = np.array([False, False, True, False, True])
    got = potential_shaping(phi, is_last, gamma=0.9)
    # 0.9*0.5-0, 0.9*1-0.5, 0.9*0-1 (terminal), 0.9*0.4-0.2, 0.9*0-0.4
    np.testing.assert_allclose(got, [0.45, 0.4, -1.0, 0.16, -0.4], rtol=0, atol=1e-15)


def test_shaping_telescopes_to_minus_start_potential():
    rng = np.random.default_rng(1)
    episodes = np.repeat(np.arange(5), [3, 1, 7, 2, 4])
    phi = rng.normal(size=episodes.shape[0])
    shaping = potential_shaping(phi, last_step_mask(episodes), gamma=0.8)
    discounted_sum = discounted_returns(shaping, episodes, 0.8)  # at an episode's first row
    starts, _ = episode_boundaries(episodes)
    np.testing.assert_allclose(discounted_sum[starts], -phi[starts], atol=1e-12)


def test_subgoal_potential_is_fraction_done_before_the_step():
    done = np.array([1.0, np.nan, 2.0, 4.0, 0.0, 1.0])
    total = np.array([4.0, np.nan, 4.0, 4.0, np.nan, 2.0])
    got = subgoal_potential(done, total, EPISODES)
    np.testing.assert_array_equal(got, [0.0, 0.25, 0.25, 0.5, 0.0, 0.0])


def test_shaping_weight_schedules():
    assert [shaping_weight(s, 10) for s in (0, 5, 10, 20, -1)] == [1.0, 0.5, 0.0, 0.0, 1.0]
    assert shaping_weight(0, 10, "cosine") == 1.0
    assert shaping_weight(5, 10, "cosine") == pytest.approx(0.5, abs=1e-15)
    assert shaping_weight(10, 10, "cosine") == 0.0
    assert shaping_weight(25, 100, "cosine") == pytest.approx((1 + np.sqrt(0.5)) / 2, abs=1e-15)
    assert shaping_weight(7, 10, "constant") == 1.0
    with pytest.raises(ValueError, match="unknown shaping schedule 'exp'; choose one of linear, cosine"):
        shaping_weight(1, 10, "exp")
    with pytest.raises(ValueError, match="total must be > 0"):
        shaping_weight(1, 0)


def test_reward_parts_total_applies_the_shaping_weight():
    parts = RewardParts(base=np.array([1.0, 0.0]), shaping=np.array([0.5, -0.5]))
    np.testing.assert_array_equal(parts.total(), [1.5, -0.5])
    np.testing.assert_array_equal(parts.total(shaping_weight(3, 4)), [1.125, -0.125])


# --- potential-based shaping leaves the optimal policy unchanged (Ng et al. 1999) ------------------

LEFT, RIGHT = 0, 1
N_STATES, GOAL = 4, 3  # chain 0-1-2-3, state 3 is terminal; +1 for reaching it


def chain_transition(state: int, action: int) -> int:
    return max(state - 1, 0) if action == LEFT else state + 1


def q_value_iteration(bonus, gamma=0.9, iterations=400):
    """Q(s, a) = R(s, a) + bonus(s, a, s') + gamma * max_a' Q(s', a'), with Q(terminal) = 0."""
    q = np.zeros((N_STATES, 2))
    for _ in range(iterations):
        new_q = np.zeros_like(q)
        for s in range(GOAL):
            for a in (LEFT, RIGHT):
                s_next = chain_transition(s, a)
                future = 0.0 if s_next == GOAL else q[s_next].max()
                new_q[s, a] = float(s_next == GOAL) + bonus(s, a, s_next) + gamma * future
        q = new_q
    return q[:GOAL]


def test_potential_shaping_keeps_the_greedy_policy_and_a_plain_bonus_does_not():
    gamma = 0.9
    phi = np.array([5.0, 0.0, -3.0, 7.0])  # pulls towards state 0; Phi(goal) is ignored: terminal

    def shaping_bonus(s, a, s_next):
        # one transition as a 2-row episode: row 0 acts in s, row 1 in s_next (the last row if terminal)
        potential = np.array([phi[s], phi[s_next]])
        is_last = np.array([s_next == GOAL, True])
        return potential_shaping(potential, is_last, gamma)[0]

    plain = q_value_iteration(lambda s, a, s_next: 0.0, gamma)
    shaped = q_value_iteration(shaping_bonus, gamma)
    loop_bonus = q_value_iteration(lambda s, a, s_next: 1.0 if (s, a) == (1, LEFT) else 0.0, gamma)

    assert plain.argmax(axis=1).tolist() == [RIGHT, RIGHT, RIGHT]
    assert shaping_bonus(1, LEFT, 0) > shaping_bonus(1, RIGHT, 2)  # myopically, shaping prefers LEFT ...
    assert shaped.argmax(axis=1).tolist() == [RIGHT, RIGHT, RIGHT]  # ... yet the optimal policy is the same
    np.testing.assert_allclose(shaped, plain - phi[:GOAL, None], atol=1e-9)  # Q' = Q - Phi(s)
    assert loop_bonus.argmax(axis=1)[1] == LEFT  # a bonus that is not potential-based changes it


# --- reward specs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("outcome", "outcome"),
        ("outcome+subgoal:0.1", "outcome+subgoal:0.1"),
        (" outcome + step:-0.01 ", "outcome+step:-0.01"),
        ("outcome:2+shaping:subgoals", "outcome:2.0+shaping:subgoals"),
        ("current+step:+1e-3", "current+step:0.001"),
    ],
)
def test_parse_reward_spec(spec, canonical):
    assert str(parse_reward_spec(spec)) == canonical
    assert str(parse_reward_spec(canonical)) == canonical


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "bad reward spec '': it is empty; valid terms: outcome"),
        ("outcom", "unknown term 'outcom'; valid terms: outcome\\[:W\\], subgoal\\[:W\\], step:C"),
        ("outcome+bonus:1", "unknown term 'bonus:1'"),
        ("step", "'step' needs a per-step value, e.g. step:-0.01"),
        ("outcome+subgoal:abc", "'subgoal' takes a number, got 'abc'"),
        ("outcome+step:nan", "takes a finite number"),
        ("outcome+outcome:2", "term 'outcome' appears twice"),
        ("shaping:foo", "shaping potential 'foo' is neither 'subgoals' nor module:function"),
        (
            "shaping:no_such_module_xyz:phi",
            "cannot import module 'no_such_module_xyz' for the shaping potential 'no_such_module_xyz:phi'",
        ),
        ("shaping:json:no_such_function", "module 'json' has no function 'no_such_function' for the shaping"),
    ],
)
def test_bad_reward_spec_messages(spec, message):
    with pytest.raises(UserError, match=message):
        parse_reward_spec(spec)


def test_bad_spec_message_is_one_line():
    with pytest.raises(UserError) as excinfo:
        parse_reward_spec("nope")
    assert "\n" not in str(excinfo.value)


# --- composing a spec over tables ------------------------------------------------------------------


def test_compute_rewards_composes_terms_exactly():
    steps, episodes = make_tables()
    parts = compute_rewards(steps, episodes, "outcome+subgoal:0.5+step:-0.25+shaping:subgoals", gamma=0.5)
    np.testing.assert_array_equal(parts.terms["outcome"], [0, 0, 0, 1.0, 0, 0.5])
    np.testing.assert_array_equal(parts.terms["subgoal"], [0, 0.5, 0, 1.0, 0, 0.5])
    np.testing.assert_array_equal(parts.terms["step"], [-0.25] * 6)
    # Phi (fraction done before the step): a: 0, 0, 1/4, 1/4 ; b: 0, 0 ; terminal rows see Phi' = 0
    np.testing.assert_array_equal(parts.shaping, [0, 0.125, -0.125, -0.25, 0, 0])
    np.testing.assert_array_equal(parts.base, [-0.25, 0.25, -0.25, 1.75, -0.25, 0.75])
    np.testing.assert_array_equal(parts.total(), [-0.25, 0.375, -0.375, 1.5, -0.25, 0.75])


def test_compute_rewards_current_term_scales_the_existing_rewards():
    steps, episodes = make_tables()
    parts = compute_rewards(steps, episodes, "current:0.5", gamma=1.0)
    np.testing.assert_array_equal(parts.total(), [0, 0, 0, 3.5, 0, 1.5])


def test_user_potential_from_a_module(tmp_path, monkeypatch):
    (tmp_path / "my_potentials.py").write_text(
        "def by_step(row):\n    return row['step'] + row['info'].get('sub_goals_done', 10)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    steps, episodes = make_tables()
    parts = compute_rewards(steps, episodes, "shaping:my_potentials:by_step", gamma=1.0)
    phi = np.array([0, 2, 12, 6, 0, 2], dtype=float)  # step + done (10 where info is null)
    np.testing.assert_array_equal(parts.shaping, [2, 10, -6, -6, 2, -2])
    np.testing.assert_array_equal(parts.shaping, potential_shaping(phi, IS_LAST, 1.0))


def test_user_potential_that_returns_garbage_names_the_step(tmp_path, monkeypatch):
    (tmp_path / "bad_potentials.py").write_text("def phi(row):\n    return 'high'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    steps, episodes = make_tables()
    with pytest.raises(UserError, match="failed on episode 'a' step 0: .*must return a float"):
        compute_rewards(steps, episodes, "shaping:bad_potentials:phi", gamma=1.0)


def test_subgoal_terms_need_subgoal_info():
    steps, episodes = make_tables(infos=[None, "{}", "not json", None, None, '{"other": 1}'])
    with pytest.raises(UserError, match="reward term 'subgoal' reads info.sub_goals_done.*no step"):
        compute_rewards(steps, episodes, "subgoal", gamma=1.0)
    with pytest.raises(UserError, match="'shaping:subgoals' reads info.sub_goals_done"):
        compute_rewards(steps, episodes, "outcome+shaping:subgoals", gamma=1.0)


# --- relabel a dataset -----------------------------------------------------------------------------


def file_bytes(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def parent_dataset(tmp_path):
    steps, episodes = make_tables()
    reward = {"mode": "per-step", "success_threshold": 1.0}
    meta = {"name": "tiny", "gamma": 0.5, "reward": reward, "sources": []}
    return write_dataset(tmp_path / "parent", steps, episodes, None, meta)


def test_relabel_round_trip_writes_new_rewards_and_leaves_the_parent_untouched(parent_dataset, tmp_path):
    before = file_bytes(parent_dataset.path)
    child = relabel(parent_dataset.path, "outcome:2+step:-0.25", tmp_path / "child")

    assert file_bytes(parent_dataset.path) == before
    steps = child.steps_table()
    np.testing.assert_array_equal(steps["reward"].to_numpy(), [-0.25, -0.25, -0.25, 1.75, -0.25, 0.75])
    # gamma 0.5 from the parent: a: 1.75, -0.25+0.875, -0.25+0.3125, -0.25+0.03125 ; b: 0.75, -0.25+0.375
    np.testing.assert_array_equal(
        steps["return_to_go"].to_numpy(), [-0.21875, 0.0625, 0.625, 1.75, 0.125, 0.75]
    )
    np.testing.assert_array_equal(child.episodes_table()["return"].to_numpy(), [1.0, 0.5])
    unchanged = [c for c in STEPS_SCHEMA.names if c not in ("reward", "return_to_go")]
    assert steps.select(unchanged).equals(parent_dataset.steps_table().select(unchanged))

    spec = "outcome:2.0+step:-0.25"
    assert child.meta["reward"] == {"mode": "relabel", "success_threshold": 1.0, "spec": spec}
    assert child.meta["gamma"] == 0.5
    assert child.meta["lineage"] == {
        "parent": {"path": str(parent_dataset.path), "fingerprint": parent_dataset.fingerprint},
        "reward_spec": "outcome:2.0+step:-0.25",
    }
    assert child.meta["counts"] == parent_dataset.meta["counts"]
    assert child.fingerprint != parent_dataset.fingerprint


def test_relabel_chain_keeps_the_lineage_and_gamma_override(parent_dataset, tmp_path):
    child = relabel(parent_dataset.path, "outcome", tmp_path / "child")
    grandchild = relabel(child.path, "current+step:-1", tmp_path / "grandchild", gamma=1.0)
    np.testing.assert_array_equal(
        grandchild.steps_table()["return_to_go"].to_numpy(), [-3, -2, -1, 0, -1.5, -0.5]
    )
    assert grandchild.meta["lineage"]["parent"]["lineage"] == child.meta["lineage"]


def test_relabel_refuses_to_write_over_its_input_or_an_existing_dataset(parent_dataset, tmp_path):
    with pytest.raises(UserError, match="is the input dataset; relabel writes a new dataset"):
        relabel(parent_dataset.path, "outcome", parent_dataset.path)
    relabel(parent_dataset.path, "outcome", tmp_path / "child")
    with pytest.raises(UserError, match="a dataset already exists at"):
        relabel(parent_dataset.path, "outcome", tmp_path / "child")
    relabel(parent_dataset.path, "step:-1", tmp_path / "child", overwrite=True)
    with pytest.raises(UserError, match="is not a dataset"):
        relabel(tmp_path / "nothing", "outcome", tmp_path / "other")


def run_cli(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["offline-agent", *map(str, args)])
    try:
        main()
    except SystemExit as exc:
        return exc.code
    return 0


def test_relabel_cli(parent_dataset, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cli-child"
    spec = "outcome+step:-0.01"
    assert run_cli(monkeypatch, "relabel", parent_dataset.path, "--reward", spec, "--out", out) == 0
    assert "relabelled 2 episodes, 6 steps" in capsys.readouterr().err
    assert TrajectoryDataset.open(out).meta["reward"]["spec"] == "outcome+step:-0.01"

    bad = tmp_path / "bad"
    assert run_cli(monkeypatch, "relabel", parent_dataset.path, "--reward", "bogus", "--out", bad) == 2
    err = capsys.readouterr().err
    assert "bad reward spec 'bogus': unknown term 'bogus'; valid terms:" in err
    assert not bad.exists()
