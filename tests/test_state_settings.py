"""`StateSettings`: one frozen object for how states become text, from the CLI flags to policy.json.

Checkpoints saved before it existed lack some of its keys; they must load with the values they were
trained and played with (k 3, no token budget, no opening turn, the encoder entry's observation view).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import learn_data
import numpy as np
import online_envs
import pytest

from offline_agent.errors import UserError
from offline_agent.learn.features import build_features
from offline_agent.learn.policy import EpisodeHistory, Policy
from offline_agent.text.states import DEFAULT_K, StateSettings, render_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TURNS = [("stage 1 failed", "inspect(stage=1)"), ("bad column", "fix(stage=1)"), ("stage 2 failed", "rerun()"),
         ("ok", "inspect(stage=2)")]
STATE = "Task: repair the pipeline\n[obs] stage 2 failed\n[act] rerun()"
CANDIDATES = ["rerun()", '{"name":"inspect","arguments":{"stage":2}}', "give up"]


def older_checkpoint(run, to, drop, drop_encoder_view):
    """A copy of the checkpoint `run` whose policy.json lacks the keys `drop` (and with `drop_encoder_view` the
    encoder entry's observation_view), as one saved before they existed."""
    shutil.copytree(run, to)
    meta = json.loads((to / "policy.json").read_text())
    for key in drop:
        meta.pop(key)
    if drop_encoder_view:
        meta["encoder"].pop("observation_view")
        meta["encoder"].pop("per_turn")
    (to / "policy.json").write_text(json.dumps(meta))
    return to


# --- the object --------------------------------------------------------------------------------------


def test_the_defaults_are_those_of_the_cli():
    assert StateSettings() == StateSettings(k=DEFAULT_K, max_tokens=None, keep_opening=False, observation_view=False)
    assert DEFAULT_K == 3


@pytest.mark.parametrize("settings", [
    StateSettings(),
    StateSettings(k=0, max_tokens=64, keep_opening=True, observation_view=True),
    StateSettings(k=5, max_tokens=None, keep_opening=True),
])
def test_settings_round_trip_through_the_checkpoint_meta_and_json(settings):
    meta = json.loads(json.dumps(settings.to_meta()))
    assert StateSettings.from_meta(meta) == settings
    # The flat keys of the checkpoints saved before the object existed, read as their loader read them.
    assert (int(meta.get("k", 3)), meta.get("max_tokens"), bool(meta.get("keep_opening", False))) == (
        settings.k, settings.max_tokens, settings.keep_opening
    )


def test_settings_are_frozen_and_hashable():
    settings = StateSettings(k=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.k = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.keep_opening = True
    assert settings.k == 2 and {settings: "two"}[StateSettings(k=2)] == "two"
    assert dataclasses.replace(settings, k=4) == StateSettings(k=4) and settings.k == 2


@pytest.mark.parametrize(("values", "message"), [
    ({"k": -1}, r"k \(--k, turns of history in a state text\) must be an integer >= 0, got -1"),
    ({"k": 2.5}, r"k \(--k, turns of history in a state text\) must be an integer >= 0, got 2.5"),
    ({"k": True}, r"k \(--k, turns of history in a state text\) must be an integer >= 0, got True"),
    ({"max_tokens": 0}, r"max_tokens \(the token budget of a state text\) must be an integer >= 1 or None"),
    ({"max_tokens": "256"}, r"max_tokens .* got '256'"),
    ({"keep_opening": "yes"}, r"keep_opening \(--keep-opening\) must be True or False, got 'yes'"),
    ({"observation_view": 1}, r"observation_view \(--observation-view\) must be True or False, got 1"),
])
def test_bad_values_are_user_errors_that_name_the_setting(values, message):
    with pytest.raises(UserError, match=message):
        StateSettings(**values)


def test_a_damaged_checkpoint_meta_is_a_user_error():
    with pytest.raises(UserError, match=r"policy.json holds bad state settings \(.*\): the checkpoint is damaged"):
        StateSettings.from_meta({"k": "three"})
    with pytest.raises(UserError, match=r"policy.json holds bad state settings \(k .* got -2\)"):
        StateSettings.from_meta({"k": -2})
    with pytest.raises(UserError, match=r"observation_view=True but its encoder entry says False"):
        StateSettings.from_meta({"observation_view": True, "encoder": {"observation_view": False}})


def test_an_encoder_fixes_the_token_budget_and_must_have_the_view_asked_for():
    encoder = learn_data.whole_text_encoder()
    assert StateSettings(k=1, per_turn=False).for_encoder(encoder) == StateSettings(
        k=1, max_tokens=encoder.max_length, per_turn=False
    )
    # Per turn, no budget for the whole text: each block is cut to the window on its own.
    assert StateSettings(k=1).for_encoder(learn_data.encoder()) == StateSettings(k=1, max_tokens=None)

    class NoTokenizer:  # an encoder that cannot count tokens: its texts are never cut
        max_length = 16

    assert StateSettings(max_tokens=99, per_turn=False).for_encoder(NoTokenizer()).max_tokens is None
    with pytest.raises(ValueError, match=r"the encoder has observation_view=False but the state settings ask for True"):
        StateSettings(observation_view=True, per_turn=False).for_encoder(encoder)


def test_train_on_the_cli_refuses_a_negative_k_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from offline_agent.cli import app

    result = CliRunner().invoke(app, ["train", str(learn_data.color_lock_dataset()), "--out", str(tmp_path / "r"),
                                      "--k", "-1"])
    assert result.exit_code == 2, result.output
    assert "k (--k, turns of history in a state text) must be an integer >= 0, got -1" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "r").exists()


# --- checkpoints -------------------------------------------------------------------------------------


def test_a_new_checkpoint_records_the_settings_its_features_were_rendered_with():
    run = learn_data.pipeline_run()["run"]
    meta = json.loads((run / "policy.json").read_text())
    policy = Policy.load(run, encoder=learn_data.encoder())
    assert policy.state_settings == StateSettings(max_tokens=None, per_turn=True)  # the defaults
    assert {key: meta[key] for key in ("k", "max_tokens", "keep_opening", "observation_view", "per_turn")} == (
        policy.state_settings.to_meta()
    )
    # What rebuilds the encoder (encoder_for).
    assert meta["encoder"]["observation_view"] is False and meta["encoder"]["per_turn"] is True
    whole = Policy.load(learn_data.pipeline_run(per_turn=False)["run"], encoder=learn_data.whole_text_encoder())
    assert whole.state_settings == StateSettings(max_tokens=whole.encoder.max_length, per_turn=False)


@pytest.mark.parametrize(("drop", "drop_encoder_view"), [
    (["k", "max_tokens", "keep_opening", "observation_view", "per_turn"], True),
    (["keep_opening", "observation_view", "per_turn"], True),
    (["observation_view", "per_turn"], False),
], ids=["no-settings", "before-keep-opening", "before-the-object"])
def test_a_checkpoint_saved_before_the_settings_existed_loads_with_the_defaults_of_its_time(
    drop, drop_encoder_view, tmp_path
):
    # Checkpoints saved before the settings existed had whole-text vectors.
    run = learn_data.pipeline_run(per_turn=False)["run"]
    whole = learn_data.whole_text_encoder()
    new = Policy.load(run, encoder=whole)
    old = Policy.load(older_checkpoint(run, tmp_path / "old", drop, drop_encoder_view), encoder=whole)
    expected = {"k": 3, "max_tokens": None, "keep_opening": False, "observation_view": False, "per_turn": False}
    expected.update({key: getattr(new.state_settings, key) for key in ("k", "max_tokens") if key not in drop})
    assert old.state_settings == StateSettings(**expected)

    # It scores, renders and chooses as the checkpoint it was cut from (the pipeline's texts fit the budget).
    np.testing.assert_array_equal(old.score(STATE, CANDIDATES), new.score(STATE, CANDIDATES))
    history = EpisodeHistory("repair the pipeline", list(TURNS))
    text = old.render(history, "stage 3 failed")
    assert text == new.render(history, "stage 3 failed") == (
        "Task: repair the pipeline\n[obs] bad column\n[act] fix(stage=1)\n[obs] stage 2 failed\n[act] rerun()\n"
        "[obs] ok\n[act] inspect(stage=2)\n[obs] stage 3 failed"
    )
    assert text == render_state("repair the pipeline", TURNS, "stage 3 failed", StateSettings(k=3))
    old.reset("repair the pipeline")
    new.reset("repair the pipeline")
    observation = {"text": "stage 2 failed", "candidates": CANDIDATES}
    assert old.act(observation) == new.act(observation)

    # evaluate and advise build the features of a dataset with the policy's settings: the same ones.
    data = learn_data.pipeline_run()["data"]
    old_features = build_features(data, old.encoder, old.state_settings, keep_texts=True)
    new_features = build_features(data, new.encoder, new.state_settings, keep_texts=True)
    assert old_features.state_settings == new_features.state_settings
    assert old_features.state_texts == new_features.state_texts
    assert old_features.state_emb.equal(new_features.state_emb)


def test_an_older_observation_view_checkpoint_reads_the_view_from_its_encoder_entry(tmp_path):
    encoder = online_envs.tiny_encoder_folder(tmp_path / "encoder")
    run = online_envs.tiny_checkpoint(tmp_path / "run", encoder, observation_view=True)
    meta = json.loads((run / "policy.json").read_text())
    assert "observation_view" not in meta and "keep_opening" not in meta  # written as before the object
    policy = Policy.load(run)
    assert policy.state_settings == StateSettings(k=2, max_tokens=64, observation_view=True, per_turn=False)
    assert policy.encoder.observation_view
