"""`evaluate` behind the safety rules a fine-tuned run saved: they are applied by default, can be replaced or
turned off, what they blocked is counted, and a bad spec is a one-line error.

The run is a real fine-tuned checkpoint (one PPO iteration under `deny:drop_table`) over the tiny encoder.
`SlowTrap` makes the counts exact: it offers only `wait` twice, then only `drop_table`, so an unfiltered
policy executes drop_table in every episode, and one behind `deny:drop_table` ends every episode truncated
after two steps with one candidate blocked.
"""

from __future__ import annotations

import json
import shutil

import online_envs
import pytest
import torch
from online_envs import DROP, REPAIR, WAIT
from typer.testing import CliRunner

from offline_agent.actions import canonical_action
from offline_agent.cli import app
from offline_agent.errors import UserError
from offline_agent.evaluate import evaluate
from offline_agent.online.config import PPOConfig
from offline_agent.online.finetune import finetune

runner = CliRunner()
WIDGET = "online_envs:make_widget"
TRAP = "test_evaluate_safety:make_slow_trap"
EPISODES = 6


class SlowTrap(online_envs.Trap):
    """Trap one step later, so that the contract check (reset, then one step) does not reach the trap."""

    def _offer(self) -> None:
        self.candidates = (DROP,) if self.steps >= 2 else (WAIT,)


def make_slow_trap() -> SlowTrap:
    return SlowTrap()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("tuned")
    run = online_envs.tiny_checkpoint(root / "run", online_envs.tiny_encoder_folder(root / "encoder"))
    config = PPOConfig(iterations=1, num_envs=2, num_steps=16, vector="sync", learning_rate=3e-3, beta=0.01)
    finetune(run, WIDGET, root / "ft", config, safety="deny:drop_table")
    return root / "ft"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    online_envs.EXECUTED.clear()
    yield
    torch.set_num_threads(threads)


def executed() -> list[str]:
    return [canonical_action(a) for a in online_envs.EXECUTED]


def test_the_rules_saved_by_finetune_are_applied_and_counted(tuned):
    report = evaluate(tuned, TRAP, episodes=EPISODES, n_envs=2)
    assert set(executed()) == {canonical_action(WAIT)}  # the contract check's step included
    assert report.safety == ("deny:drop_table",)
    assert report.blocked_actions == EPISODES and report.blocked_by_rule == {"deny:drop_table": EPISODES}
    assert report.safety_truncated == EPISODES and report.success_rate == 0.0 and report.mean_steps == 2.0


def test_a_trap_reached_by_the_contract_check_itself_is_evaluated_too(tuned):
    report = evaluate(tuned, "online_envs:make_trap", episodes=EPISODES, n_envs=2)
    assert report.safety_truncated == EPISODES and canonical_action(DROP) not in executed()


def test_each_rule_is_counted_at_every_decision(tuned):
    # Denied repair and drop_table, the policy waits or apologises until the Widget's 4 steps are up; both
    # are removed from each of the 4 observations it acts on (none from the last, which ends the episode).
    report = evaluate(tuned, WIDGET, episodes=10, n_envs=4, safety="deny:repair,drop_table")
    assert not {canonical_action(REPAIR), canonical_action(DROP)} & set(executed())
    assert report.mean_steps == 4.0 and report.safety_truncated == 0
    assert report.blocked_by_rule == {"deny:drop_table": 40, "deny:repair": 40} and report.blocked_actions == 80


def test_no_safety_turns_the_saved_rules_off(tuned):
    report = evaluate(tuned, TRAP, episodes=EPISODES, n_envs=2, safety=())
    assert executed().count(canonical_action(DROP)) == EPISODES and report.mean_steps == 3.0
    assert report.safety == () and report.blocked_actions == 0 and report.safety_truncated == 0


def test_an_override_replaces_the_saved_rules(tuned):
    rule = 'regex:"table":"widgets"'
    report = evaluate(tuned, TRAP, episodes=EPISODES, n_envs=2, safety=rule)
    assert canonical_action(DROP) not in executed()
    assert report.safety == (rule,) and report.blocked_by_rule == {rule: EPISODES}
    assert report.safety_truncated == EPISODES
    online_envs.EXECUTED.clear()
    report = evaluate(tuned, TRAP, episodes=EPISODES, n_envs=2, safety="regex:repair")
    assert canonical_action(DROP) in executed() and report.blocked_actions == 0  # deny:drop_table is gone


def test_a_bad_override_fails_before_any_rollout(tuned):
    with pytest.raises(UserError, match="unknown safety rule 'forbid:drop_table'"):
        evaluate(tuned, TRAP, episodes=EPISODES, safety="forbid:drop_table")
    assert executed() == []


def test_a_behaviour_policy_cannot_take_safety_rules():
    with pytest.raises(UserError, match="evaluate it without --safety"):
        evaluate("behaviour:random", TRAP, episodes=EPISODES, safety="deny:wait")


# --- the verb ---------------------------------------------------------------------------------------------


def _evaluate(*args: str):
    return runner.invoke(app, ["evaluate", *args, "--episodes", str(EPISODES)])


@pytest.mark.parametrize(
    ("flags", "safety", "blocked"),
    [
        ([], ["deny:drop_table"], EPISODES),
        (["--no-safety"], [], 0),
        (["--safety", "regex:drop_table"], ["regex:drop_table"], EPISODES),
        (["--safety", "regex:repair"], ["regex:repair"], 0),
    ],
)
def test_json_reports_the_rules_and_what_they_blocked(tuned, flags, safety, blocked):
    result = _evaluate(str(tuned), "--env", TRAP, "--json", *flags)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["safety"] == safety and out["blocked_actions"] == blocked
    assert out["safety_truncated"] == blocked  # each block leaves nothing allowed in Trap


def test_the_summary_says_what_was_blocked(tuned):
    result = _evaluate(str(tuned), "--env", TRAP)
    assert result.exit_code == 0, result.output
    assert (
        f"safety filter deny:drop_table: {EPISODES} candidate actions blocked, "
        f"{EPISODES} episodes ended with every candidate forbidden"
    ) in result.stdout
    assert "no safety filter" in _evaluate(str(tuned), "--env", TRAP, "--no-safety").stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--env", TRAP, "--safety", "forbid:drop_table"], "unknown safety rule 'forbid:drop_table'"),
        (["--env", TRAP, "--safety", "regex:(unclosed"], "invalid regular expression"),
        (["--env", TRAP, "--safety", " "], "names no rule"),
        (["--env", TRAP, "--safety", "deny:wait", "--no-safety"], "pass one of the two"),
        (["--dataset", "data", "--no-safety"], "apply to rollouts: add --env ENV"),
    ],
)
def test_bad_safety_flags_are_one_line_errors(tuned, flags, message):
    result = _evaluate(str(tuned), *flags)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert executed() == []


def test_saved_rules_that_cannot_be_applied_here_say_how_to_go_on(tuned, tmp_path):
    moved = shutil.copytree(tuned, tmp_path / "ft")
    meta = json.loads((moved / "policy.json").read_text())
    (moved / "policy.json").write_text(json.dumps({**meta, "safety": ["callable:no_such_module_xyz:judge"]}))
    result = _evaluate(str(moved), "--env", TRAP)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "the safety rules saved with it cannot be applied" in result.output and "--no-safety" in result.output
    assert _evaluate(str(moved), "--env", TRAP, "--no-safety").exit_code == 0
