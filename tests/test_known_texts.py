"""A checkpoint's known texts: the fp32 vectors of the logs' most frequent texts, that every memo of the loaded
policy starts with (`offline_agent.text.known`).

Real components: the packaged MiniLM, the bundled PipelineRepair logs and a CQL policy trained on six of their
episodes (`learn_data.pipeline_run`), and PipelineRepair-v0.
"""

from __future__ import annotations

import learn_data
import numpy as np
import pytest

from offline_agent.learn.policy import Policy, load_checkpoint, load_known_texts
from offline_agent.online.play import rollout_policy
from offline_agent.text.cache import CACHE_DIRNAME, EmbeddingCache, EmbeddingMemo
from offline_agent.text.known import MAX_KNOWN_TEXTS, frequent_texts, text_arrays, texts_and_vectors
from offline_agent.text.states import StateSettings, dataset_texts, turn_blocks

PIPELINE = "offline_agent/PipelineRepair-v0"


@pytest.fixture(scope="module")
def pipeline():
    return learn_data.pipeline_run()


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    yield


def test_frequent_texts_rank_blocks_by_the_states_they_are_in_then_by_text():
    states = [
        "Task: fix it\n[obs] build failed",
        "Task: fix it\n[obs] build failed\n[act] retry\n[obs] ok",
        "Task: other\n[obs] build failed",
    ]
    # "[obs] build failed" is in 3 states, "Task: fix it" in 2, the rest in 1; candidates count once each.
    assert frequent_texts(states, ["retry", "skip"], per_turn=True) == [
        "[obs] build failed", "Task: fix it", "Task: other", "[act] retry", "[obs] ok", "retry", "skip",
    ]
    assert frequent_texts(states, ["retry", "skip"], per_turn=True, limit=2) == ["[obs] build failed", "Task: fix it"]
    # Whole-text vectors: a memo keeps whole states, which seldom recur; only the candidates are worth keeping.
    assert frequent_texts(states, ["skip", "retry"], per_turn=False) == ["retry", "skip"]


def test_text_arrays_round_trip_in_order_with_any_unicode():
    texts = ["b", "[obs] café ☕", "lone \ud800 surrogate", ""]
    vectors = np.arange(8, dtype=np.float32).reshape(4, 2)
    arrays = text_arrays(texts, vectors, 2)
    back = list(texts_and_vectors(arrays, 2))
    assert [t for t, _ in back] == texts
    np.testing.assert_array_equal(np.stack([v for _, v in back]), vectors)
    with pytest.raises(ValueError, match="do not fit a 3-d encoder"):
        list(texts_and_vectors(arrays, 3))


def test_train_keeps_the_fp32_vectors_of_every_candidate_and_of_the_logs_blocks(pipeline):
    _, meta = load_checkpoint(pipeline["run"])
    known = load_known_texts(pipeline["run"], meta)
    assert known is not None
    texts, vectors = zip(*texts_and_vectors(known, 384), strict=True)
    assert meta["known_texts"] == len(texts) <= MAX_KNOWN_TEXTS
    encoder = learn_data.encoder()
    plain = encoder.single_view()
    logs = dataset_texts(pipeline["data"], StateSettings.from_meta(meta).for_encoder(encoder), plain.count_tokens)
    blocks = {block for state in logs.states for block in turn_blocks(state)}
    assert set(texts) == blocks | set(logs.candidates) | set(logs.actions)  # six episodes: under the limit
    # The vectors are the dataset cache's, which the policy was trained on.
    cached = EmbeddingCache(pipeline["data"] / CACHE_DIRNAME, plain).embed(list(texts))
    np.testing.assert_array_equal(np.stack(vectors), cached)


def test_a_loaded_policy_meets_the_logs_texts_without_encoding_them_and_acts_as_with_an_empty_memo(pipeline):
    seeded, empty = Policy.load(pipeline["run"]), Policy.load(pipeline["run"], known_texts=False)
    assert len(seeded.memo) == load_checkpoint(pipeline["run"])[1]["known_texts"] and len(empty.memo) == 0
    outcomes = rollout_policy(PIPELINE, seeded, 4, seed=0, n_envs=4)
    assert outcomes == rollout_policy(PIPELINE, empty, 4, seed=0, n_envs=4)  # the same episodes, step for step
    assert seeded.memo.misses < empty.memo.misses / 2  # most texts of the episodes were in the logs
    # Another memo of the policy (a fine-tuning run's rollouts, its validation) starts with them too.
    assert len(seeded.seed_memo(EmbeddingMemo(seeded.encoder))) == len(load_known_texts(
        pipeline["run"], seeded.meta)["vectors"])


def test_a_memo_seeded_twice_keeps_what_it_holds(pipeline):
    policy = Policy.load(pipeline["run"], known_texts=False)
    first = policy.memo.embed(["[obs] a text of no log"])
    known = load_known_texts(pipeline["run"], policy.meta)
    assert policy.memo.seed(known) == len(known["vectors"])
    assert policy.memo.seed(known) == 0  # nothing new: the texts are held already
    np.testing.assert_array_equal(policy.memo.embed(["[obs] a text of no log"]), first)
    assert (policy.memo.hits, policy.memo.misses) == (1, 1)  # seeding counts neither
