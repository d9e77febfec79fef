"""`embed` on Ray: the same cache, hashes and vectors as the local backend, with the real packaged MiniLM encoder.

Vectors are compared with `allclose(atol=1e-5)`, not for equality: an actor runs the same forward passes as the
local encoder (shards are cut at its batch boundaries) but on one torch thread, and kernels on another number
of threads may sum in another order (differences of ~1e-7).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from offline_agent.errors import UserError
from offline_agent.text.cache import EmbeddingCache
from offline_agent.text.encoder import TextEncoder
from offline_agent.text.states import StateSettings, dataset_texts
from tests.helpers import chat_record, write_jsonl

# Eight texts a forward pass: the dataset's ~50 texts make several shards, spread over both of Ray's CPUs.
BATCH_SIZE = 8


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    # Whole texts: the Ray backend encodes the plain texts it is sent (per-turn vectors are assembled from them).
    return TextEncoder(batch_size=BATCH_SIZE, per_turn=False)


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> list[str]:
    """Every text of a 12-episode dataset (each episode its own request, three tool calls and an answer)."""
    from offline_agent.ingest import ingest

    folder = tmp_path_factory.mktemp("logs")
    records = []
    for i in range(12):
        record = chat_record(n_calls=3)
        record["messages"][1]["content"] = f"fix the nightly pipeline of shop {i}: the orders table is stale"
        records.append(record)
    ingest([write_jsonl(folder / "logs.jsonl", records)], folder / "ds")
    states, actions, candidates = dataset_texts(folder / "ds", StateSettings(k=2))
    return [*states, *actions, *candidates]


def cached(root: Path, encoder: TextEncoder) -> dict[str, np.ndarray]:
    """Hash -> vector of every row of the cache parts of `encoder` under `root`."""
    rows: dict[str, np.ndarray] = {}
    for part in EmbeddingCache(root, encoder).parts():
        table = pq.read_table(part)
        vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
        rows.update(zip(table.column("text_hash").to_pylist(), vectors, strict=True))
    return rows


@pytest.mark.ray
def test_ray_fills_the_cache_as_the_local_backend_does_and_either_backend_then_hits_it(
    local_ray, encoder, texts, tmp_path
):
    local = EmbeddingCache(tmp_path / "local", encoder)
    expected = local.embed(texts)
    on_ray = EmbeddingCache(tmp_path / "ray", encoder)
    got = on_ray.embed(texts, backend="ray")
    distinct = len(set(texts))
    assert distinct > 4 * BATCH_SIZE  # several shards
    assert (on_ray.hits, on_ray.misses) == (0, distinct)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    # The same encoder folder and part format: `train` reads either cache alike.
    assert on_ray.folder.name == local.folder.name == encoder.id
    assert (on_ray.folder / "encoder.json").read_text() == (local.folder / "encoder.json").read_text()
    assert pq.read_schema(on_ray.parts()[0]) == pq.read_schema(local.parts()[0])
    rows_local, rows_ray = cached(tmp_path / "local", encoder), cached(tmp_path / "ray", encoder)
    assert sorted(rows_ray) == sorted(rows_local) and len(rows_ray) == distinct
    for h, vector in rows_local.items():
        np.testing.assert_allclose(rows_ray[h], vector, atol=1e-5)
    parts = on_ray.parts()
    for backend in ("ray", "local"):
        again = EmbeddingCache(tmp_path / "ray", encoder)
        np.testing.assert_array_equal(again.embed(texts, backend=backend), got)
        assert (again.hits, again.misses) == (distinct, 0)
    assert EmbeddingCache(tmp_path / "ray", encoder).parts() == parts  # nothing written the second time


@pytest.mark.ray
def test_observation_view_on_ray_stores_one_view_vectors_even_when_an_actor_is_killed(
    local_ray, encoder, texts, tmp_path
):
    """One test for both, as each Ray run starts its actors (seconds on 2 cores): an observation-view encoder
    fills the plain encoder's cache, while one of its actors is killed mid-run and its shard goes to another."""
    from offline_agent.text.ray import ACTOR_PREFIX

    ray = local_ray
    viewed = TextEncoder(batch_size=BATCH_SIZE, observation_view=True, per_turn=False)
    cache = EmbeddingCache(tmp_path, viewed)
    result: dict[str, np.ndarray] = {}
    earlier = set(ray.util.list_named_actors())  # actors of earlier tests may not have gone yet
    run = threading.Thread(target=lambda: result.update(vectors=cache.embed(texts, backend="ray")))
    run.start()
    killed = None
    deadline = time.monotonic() + 60
    while killed is None and run.is_alive() and time.monotonic() < deadline:
        for name in set(ray.util.list_named_actors()) - earlier:
            if name.startswith(ACTOR_PREFIX):
                ray.kill(ray.get_actor(name))
                killed = name
                break
        time.sleep(0.01)
    run.join(timeout=120)
    assert killed is not None, "the run ended before one of its actors could be killed"
    np.testing.assert_allclose(result["vectors"], viewed.encode(texts), atol=1e-5)
    assert [p.name for p in tmp_path.iterdir()] == [encoder.id]  # the plain encoder's folder, 384-d vectors
    assert pq.read_schema(cache.parts()[0]).field("vector").type.list_size == encoder.dim
    plain = EmbeddingCache(tmp_path, encoder)
    plain.embed(texts)
    assert plain.misses == 0  # the states themselves were stored as one-view vectors
    assert len(cached(tmp_path, encoder)) == cache.misses  # every shard's vectors, the killed actor's too


def test_ray_backend_without_ray_is_a_one_line_error_naming_the_extra(monkeypatch, encoder, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as where it is not installed
    with pytest.raises(UserError, match=r"pip install 'offline-agent\[ray\]'") as error:
        EmbeddingCache(tmp_path, encoder).embed(["a text"], backend="ray")
    assert "\n" not in str(error.value)
    assert not (tmp_path / encoder.id).exists()


def test_an_unknown_backend_is_a_user_error(encoder, tmp_path):
    with pytest.raises(UserError, match="unknown --backend 'spark': use local or ray"):
        EmbeddingCache(tmp_path, encoder).embed(["a text"], backend="spark")
