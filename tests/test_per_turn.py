"""Per-turn state vectors (the default; `--whole-text` is the other way): each block of a state text is embedded
on its own, the state is their mean, and every cache keeps blocks, so that a new step of an episode costs the
encoder one new block.

Real components: the packaged MiniLM, the bundled PipelineRepair logs, a CQL policy trained through the CLI.
"""

from __future__ import annotations

import json
import shutil

import learn_data
import numpy as np
import pytest
from typer.testing import CliRunner

from offline_agent.cli import app
from offline_agent.errors import UserError
from offline_agent.learn.policy import EpisodeHistory, Policy
from offline_agent.text.cache import CACHE_DIRNAME, EmbeddingCache, EmbeddingMemo, text_hash
from offline_agent.text.encoder import TextEncoder
from offline_agent.text.states import StateSettings, dataset_texts, render_state, turn_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()
TURNS = [("stage load failed:\nlocked table", '{"name": "retry", "arguments": {"stage": "load"}}'),
         ("stage load ok", '{"name": "run", "arguments": {"stage": "clean"}}')]


@pytest.fixture(scope="module")
def per_turn():
    encoder = learn_data.encoder()  # the default encoder
    assert encoder.per_turn
    return encoder


@pytest.fixture(scope="module")
def plain():
    return TextEncoder(per_turn=False)  # whole texts, one pass each: sentence-transformers' vectors


def _unit_mean(vectors: np.ndarray) -> np.ndarray:
    mean = vectors.mean(0)
    return mean / np.linalg.norm(mean)


def test_a_state_text_splits_into_its_task_observation_and_action_blocks():
    state = render_state("Repair the pipeline", TURNS, "stage clean failed", StateSettings(k=2))
    assert turn_blocks(state) == [
        "Task: Repair the pipeline",
        "[obs] stage load failed:\nlocked table",  # an observation's own line break stays in its block
        '[act] {"name": "retry", "arguments": {"stage": "load"}}',
        "[obs] stage load ok",
        '[act] {"name": "run", "arguments": {"stage": "clean"}}',
        "[obs] stage clean failed",
    ]
    assert "\n".join(turn_blocks(state)) == state
    action = '{"name": "retry",\n"arguments": {}}'  # not a rendered state: one block, whole
    assert turn_blocks(action) == [action]


def test_a_per_turn_vector_is_the_normalised_mean_of_its_blocks_plain_vectors(per_turn, plain):
    assert (per_turn.id, per_turn.fp32_id, per_turn.dim) == (plain.id + "-perturn", plain.id + "-perturn", plain.dim)
    assert per_turn.single_view().id == plain.id and per_turn.single_view().model is per_turn.model
    state = render_state("Repair the pipeline", TURNS, "stage clean failed", StateSettings(k=2))
    action = TURNS[0][1]
    got = per_turn.encode([state, action])
    np.testing.assert_allclose(got[0], _unit_mean(plain.encode(turn_blocks(state))), atol=1e-6)
    np.testing.assert_allclose(got[1], plain.encode([action])[0], atol=1e-6)  # an action's vector is the plain one
    assert float(got[0] @ plain.encode([state])[0]) < 0.99  # not the whole text's vector
    both = TextEncoder(observation_view=True)
    assert both.id == plain.id + "-perturn-obsview" and both.dim == 2 * plain.dim
    viewed = both.encode([state])[0]
    np.testing.assert_allclose(
        viewed, np.concatenate([got[0], plain.encode(["stage clean failed"])[0]]) / np.sqrt(2), atol=1e-6
    )


def test_the_memo_encodes_only_the_blocks_a_new_state_brings(per_turn):
    memo = EmbeddingMemo(per_turn)
    settings = StateSettings(k=2)
    observations = ["stage load failed:\nlocked table", "stage load ok", "stage clean failed"]
    states = [render_state("Repair the pipeline", TURNS[:t], observations[t], settings) for t in range(3)]
    first = memo.embed(states[:1])
    assert (memo.encoder_calls, memo.misses) == (1, 2)  # the task and the first observation
    memo.embed(states[1:2])
    assert (memo.encoder_calls, memo.misses) == (2, 4)  # one action and one observation are new
    # Two new blocks, and the action as a candidate: a text of its own (its block has the `[act] ` prefix).
    memo.embed(states[2:3] + [TURNS[0][1]])
    assert (memo.encoder_calls, memo.misses) == (3, 7)
    np.testing.assert_allclose(memo.embed(states), per_turn.encode(states), atol=1e-6)
    np.testing.assert_array_equal(memo.embed(states[:1]), first)
    assert memo.encoder_calls == 3 and len(memo) == 7  # blocks, not states
    restored = EmbeddingMemo(per_turn)
    restored.load_arrays(memo.arrays())  # what a resume checkpoint keeps: the blocks' plain vectors
    assert memo.arrays()["vectors"].shape == (7, per_turn.dim)
    np.testing.assert_array_equal(restored.embed(states), memo.embed(states))
    assert restored.encoder_calls == 0


def test_embed_caches_blocks_under_the_plain_encoder_and_encodes_each_once(tmp_path, per_turn, plain):
    data = tmp_path / "data"
    shutil.copytree(learn_data.pipeline_run()["data"], data)
    shutil.rmtree(data / CACHE_DIRNAME, ignore_errors=True)
    texts = dataset_texts(data, StateSettings().for_encoder(per_turn), per_turn.count_tokens)
    blocks = {b for t in texts.states for b in turn_blocks(t)} | {*texts.actions, *texts.candidates}
    # States share most of their blocks: fewer tokens to encode than the distinct state texts hold.
    tokens = per_turn.count_tokens
    assert 2 * sum(map(tokens, blocks)) < sum(map(tokens, {*texts.states, *texts.actions, *texts.candidates}))
    result = runner.invoke(app, ["embed", str(data)])
    assert result.exit_code == 0, result.output
    assert f"{len(blocks)} new texts encoded, 0 cached" in result.output
    # The blocks' plain vectors, under the plain encoder's id: no folder of the per-turn encoder's own.
    assert [p.name for p in (data / CACHE_DIRNAME).iterdir()] == [plain.id] == [per_turn.single_id]
    cached = EmbeddingCache(data / CACHE_DIRNAME, plain).lookup([text_hash(b) for b in blocks])
    assert len(cached) == len(blocks)
    again = runner.invoke(app, ["embed", str(data), "--per-turn"])  # the default, said
    assert again.exit_code == 0 and "0 new texts encoded" in again.output, again.output
    vectors = EmbeddingCache(data / CACHE_DIRNAME, per_turn).embed(texts.states[:4])
    np.testing.assert_allclose(vectors, per_turn.encode(texts.states[:4]), atol=1e-6)


def test_a_policy_trains_saves_and_plays_per_turn_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = learn_data.pipeline_run()["data"]
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(data), "--out", str(run), "--steps", "10", "--batch-size", "8"])
    assert result.exit_code == 0, result.output
    meta = json.loads((run / "policy.json").read_text())
    assert meta["per_turn"] is True and meta["encoder"]["per_turn"] is True
    assert meta["encoder"]["id"].endswith("-perturn")
    policy = Policy.load(run)  # the encoder is rebuilt per turn from policy.json alone
    assert policy.encoder.per_turn and policy.state_settings.per_turn
    policy.reset("Repair the pipeline")
    observation = {"text": "stage load failed", "candidates": ["retry load", "skip load"]}
    assert policy.act(observation) in (0, 1)
    history = EpisodeHistory("Repair the pipeline")
    state = policy.render(history, "stage load failed")
    np.testing.assert_allclose(policy.memo.embed([state]), policy.encoder.encode([state]), atol=1e-6)
    result = runner.invoke(app, ["evaluate", str(run), "--env", "offline_agent/PipelineRepair-v0", "--episodes", "2",
                                 "--json"])
    assert result.exit_code == 0, result.output
    refused = runner.invoke(app, ["train", str(data), "--out", str(tmp_path / "r2"), "--steps", "2", "--per-turn",
                                  "--tune-encoder-layers", "1"])
    assert refused.exit_code != 0 and "Traceback" not in refused.output
    assert "--tune-encoder-layers tunes the encoder over whole state texts: add --whole-text" in refused.output


def test_per_turn_settings_round_trip_and_must_match_the_encoder(per_turn, plain):
    assert StateSettings().per_turn and StateSettings(k=2) == StateSettings(k=2, per_turn=True)
    settings = StateSettings(k=2)
    assert StateSettings.from_meta(json.loads(json.dumps(settings.to_meta()))) == settings
    assert StateSettings.from_meta({"encoder": {"per_turn": True}}).per_turn  # read from the encoder entry
    assert not StateSettings.from_meta({}).per_turn  # a checkpoint saved before the setting existed: whole text
    with pytest.raises(UserError, match=r"per_turn=True but its encoder entry says False"):
        StateSettings.from_meta({"per_turn": True, "encoder": {"per_turn": False}})
    # No budget for the whole text: each block is cut to the encoder's window on its own.
    assert settings.for_encoder(per_turn) == settings and settings.for_encoder(per_turn).max_tokens is None
    long_turns = [("x " * 300, "retry()"), ("y " * 300, "skip()")]
    state = render_state("t", long_turns, "z", settings.for_encoder(per_turn), per_turn.count_tokens)
    assert len(turn_blocks(state)) == 6  # the task, both turns and the current observation, whole
    assert per_turn.count_tokens(state) > per_turn.max_length
    with pytest.raises(ValueError, match=r"the encoder has per_turn=True but the state settings ask for False"):
        StateSettings(per_turn=False).for_encoder(per_turn)
    with pytest.raises(ValueError, match=r"the encoder has per_turn=False but the state settings ask for True"):
        StateSettings().for_encoder(plain)
    assert StateSettings(per_turn=False).for_encoder(plain).max_tokens == plain.max_length  # a whole text's budget
    with pytest.raises(UserError, match=r"per_turn \(--per-turn\) must be True or False, got 1"):
        StateSettings(per_turn=1)
