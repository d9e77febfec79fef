"""Embedding on Ray: the texts an embedding cache lacks, encoded by a pool of Ray actors.

`EmbeddingCache.embed(..., backend="ray")` looks its texts up in the driver and hands the uncached ones to
`encode_on_ray`. They are cut into shards at the encoder's own batch boundaries (`batch_positions`), so every
forward pass an actor runs is one the local backend would run, and a text gets the vector it gets locally (up
to float rounding: kernels on another number of threads may sum in another order). Each actor loads the
encoder once, from the driver's constructor arguments (model folder, max_length, batch size, precision,
device), never from a pickled model, and reports its encoder id, which must be the driver's: a node with
another model at that path would otherwise fill the cache with foreign vectors. Shards go to whichever actor is
free; a shard whose actor dies goes to another (a new one when none is left), up to `MAX_ATTEMPTS` times. The
vectors come back to the driver, which writes them into the cache as they arrive.

Ray is imported only inside functions here, and this module only by `--backend ray`.
"""

from __future__ import annotations

import math
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from offline_agent.errors import UserError
from offline_agent.ray_backend import ray_session
from offline_agent.text.encoder import TextEncoder, batch_positions, progress_bar

#: Shards per actor: enough that an actor which is slow (or dies) does not hold the run up at its end, few enough
#: that the per-call overhead (a few ms) stays small beside a shard's encoding.
SHARDS_PER_ACTOR = 4
#: Texts of finished shards the driver gathers before writing a cache part: a part per shard would leave
#: thousands of small files that every later lookup opens; one at the very end would lose a crashed run's work.
PART_ROWS = 20_000
#: Name prefix of the encoder actors: `offline-agent-embed-<run>-<i>`.
ACTOR_PREFIX = "offline-agent-embed"
#: Tries of one shard (its actor died each time) before the run gives up.
MAX_ATTEMPTS = 3


class EncoderWorker:
    """A `TextEncoder` in a Ray actor, loaded once: encodes the shards (lists of texts) sent to it."""

    def __init__(self, settings: dict[str, Any]):
        import ray
        import torch

        # As many torch threads as the CPUs Ray reserved for this actor: more would contend with the other
        # actors on the node, and Ray's default OMP_NUM_THREADS=1 would leave a multi-CPU actor on one core.
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        torch.set_num_threads(max(1, int(cpus)))
        self.encoder = TextEncoder(**settings)

    def encode(self, texts: list[str]) -> tuple[str, np.ndarray]:
        """(encoder id, (N, D) float32 vectors of `texts`)."""
        return self.encoder.single_id, self.encoder.encode(texts)


def encoder_settings(encoder: TextEncoder) -> dict[str, Any]:
    """The constructor arguments that rebuild `encoder` in another process: what each actor is sent."""
    if not isinstance(encoder, TextEncoder):
        raise UserError(f"--backend ray embeds with a TextEncoder (a local model folder), not {type(encoder).__name__}")
    if encoder.tuned_layers:
        raise UserError(
            f"--backend ray cannot embed with encoder {encoder.id}: its fine-tuned layers are not in its model "
            "folder; embed with --backend local"
        )
    if encoder.observation_view or encoder.per_turn:
        # The embedding cache hands over the plain encoder's texts (`single_view`); the views are assembled there.
        raise ValueError("encode_on_ray takes a one-view encoder: pass encoder.single_view()")
    return {
        "path": encoder.path,
        # Ray shows a GPU actor only the GPU it reserved for it, as cuda:0, whichever the driver uses.
        "device": "cuda" if encoder.device.startswith("cuda") else encoder.device,
        "max_length": encoder.max_length,
        "batch_size": encoder.batch_size,
        "precision": encoder.precision,
        "per_turn": False,  # the actors encode the plain texts they are sent (blocks, per turn)
    }


def shard_positions(texts: list[str], batch_size: int, n_shards: int) -> list[list[int]]:
    """Positions in `texts` of about `n_shards` shards, each a run of whole forward passes of `batch_positions`
    (longest texts first). An actor's encoder sorts a shard the same way (the sort is stable and the shard
    already in order) and so cuts it into the same passes: the same padding as the local backend."""
    target = max(1, math.ceil(len(texts) / max(1, n_shards)))
    shards: list[list[int]] = []
    current: list[int] = []
    for batch in batch_positions(texts, batch_size):
        current.extend(batch)
        if len(current) >= target:
            shards.append(current)
            current = []
    if current:
        shards.append(current)
    return shards


def encode_on_ray(
    encoder: TextEncoder,
    texts: list[str],
    ray_address: str | None = None,
    progress: bool = False,
    keep: Callable[[list[int], np.ndarray], None] | None = None,
) -> np.ndarray:
    """(N, D) float32 vectors of `texts` by one-view `encoder`, encoded by a pool of Ray actors.

    The pool has one actor per free CPU of the cluster (per free GPU with a cuda device), at most one per
    shard. `keep(positions, vectors)` is called in the driver with the vectors of finished shards, every
    `PART_ROWS` texts and once at the end (also when the run fails part-way): the embedding cache writes them.
    """
    settings = encoder_settings(encoder)
    out = np.empty((len(texts), encoder.dim), dtype=np.float32)
    if not texts:
        return out
    kept_rows: list[int] = []
    kept_vectors: list[np.ndarray] = []

    def flush() -> None:
        rows, vectors = list(kept_rows), kept_vectors[:]
        kept_rows.clear()
        kept_vectors.clear()
        if keep is not None and rows:
            keep(rows, np.concatenate(vectors))

    with ray_session(ray_address) as ray, progress_bar(progress, len(texts), "encoding on ray") as advance:
        from ray.exceptions import RayActorError

        gpu = encoder.device.startswith("cuda")
        free = int(ray.available_resources().get("GPU" if gpu else "CPU", 0))
        # A busy cluster still gets one actor, which waits for a CPU.
        shards = shard_positions(texts, encoder.batch_size, max(1, free) * SHARDS_PER_ACTOR)
        worker = ray.remote(EncoderWorker)
        run = uuid.uuid4().hex[:8]
        actors: list[Any] = []

        def start_actor() -> Any:
            # Named, so that `ray list actors` says what they are (and a test can find one to kill).
            name = f"{ACTOR_PREFIX}-{run}-{len(actors)}"
            actors.append(
                worker.options(name=name, num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0).remote(settings)
            )
            return actors[-1]

        idle = [start_actor() for _ in range(max(1, min(free, len(shards))))]
        todo = deque(range(len(shards)))
        attempts = [0] * len(shards)
        running: dict[Any, tuple[int, Any]] = {}  # result ref -> (shard, actor)
        try:
            while todo or running:
                if todo and not idle and not running:  # every actor has died: start another
                    idle.append(start_actor())
                while todo and idle:
                    shard, actor = todo.popleft(), idle.pop()
                    attempts[shard] += 1
                    running[actor.encode.remote([texts[i] for i in shards[shard]])] = (shard, actor)
                [ref], _ = ray.wait(list(running), num_returns=1)
                shard, actor = running.pop(ref)
                try:
                    worker_id, vectors = ray.get(ref)
                except RayActorError as exc:
                    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                    cause = lines[-1][:300] if lines else type(exc).__name__
                    # A model that does not load is no accident another actor would escape: stop at once.
                    if exc.actor_init_failed:
                        raise UserError(
                            f"a Ray worker could not load the encoder from {encoder.path} ({cause}): install the "
                            "same model at that path on every node"
                        ) from None
                    if attempts[shard] >= MAX_ATTEMPTS:
                        raise UserError(
                            f"Ray actors encoding with {encoder.path} died {MAX_ATTEMPTS} times on one shard; "
                            f"last: {cause}"
                        ) from None
                    todo.appendleft(shard)  # to another actor; the dead one is not used again
                    continue
                if worker_id != encoder.single_id:
                    raise UserError(
                        f"a Ray worker loaded encoder {worker_id} from {encoder.path}, the driver has "
                        f"{encoder.single_id}: install the same model at that path on every node"
                    )
                idle.append(actor)
                out[shards[shard]] = vectors
                kept_rows.extend(shards[shard])
                kept_vectors.append(vectors)
                if len(kept_rows) >= PART_ROWS:
                    flush()
                advance(len(shards[shard]))
        finally:
            flush()
            for actor in actors:
                ray.kill(actor)  # frees their CPUs now, in a Ray that outlives this call
    return out
