"""The Parquet embedding cache of a dataset, and the in-memory memo of rollouts.

Every state and action text of a dataset is embedded once and kept: `EmbeddingCache` holds Parquet part files
under `ROOT/<encoder id>/` keyed by the sha256 of each text, so that a text is never encoded twice by the same
encoder. The `embed` CLI verb walks a dataset with `dataset_texts` and fills the cache at `DATASET/embeddings`.
Rollouts (evaluation, fine-tuning) embed the states they meet through `EmbeddingMemo`, a bounded in-memory
text -> vector memo that encodes each step's new texts in one call.

Dimension letters: N texts, D embedding width.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from offline_agent.errors import UserError
from offline_agent.text.states import state_views

if TYPE_CHECKING:
    from offline_agent.text.encoder import TextEncoder

#: Folder of a dataset where the CLI and the learner keep its embedding cache (derived data).
CACHE_DIRNAME = "embeddings"


def text_hash(text: str) -> str:
    """Cache key of a text: sha256 hex of its UTF-8 bytes (lone surrogates kept, as in dataset digests)."""
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


class EmbeddingCache:
    """Embeddings of texts by one encoder, kept as Parquet part files under `root/<encoder.id>/`.

    Each part has columns `text_hash` (sha256 hex of the text) and `vector`
    (fixed_size_list<float32>[D]). Parts are only ever added, each written to a
    temporary name and renamed, so concurrent writers and crashes leave whole files;
    two writers that encode the same text store it twice, and either copy is read.

    An encoder with the observation view stores nothing of its own: its vectors are assembled from the
    one-view vectors of each text and of its current observation, kept under the plain encoder's id. A
    dataset embedded without the view then needs only its observations encoded to be used with it. A per-turn
    encoder likewise stores the plain vectors of the blocks of its state texts (`per_turn_vectors`).
    """

    def __init__(self, root: str | Path, encoder: TextEncoder):
        self.root = Path(root)
        self.encoder = encoder
        # Duck-typed encoders (benchmarks' experiments) have one view and no `single_view`.
        self.single = encoder.single_view() if hasattr(encoder, "single_view") else encoder
        self.folder = self.root / self.single.id
        self.hits = 0
        self.misses = 0

    @property
    def schema(self) -> pa.Schema:
        return pa.schema(
            [
                pa.field("text_hash", pa.string(), nullable=False),
                pa.field("vector", pa.list_(pa.float32(), self.single.dim), nullable=False),
            ]
        )

    def parts(self) -> list[Path]:
        return sorted(self.folder.glob("part-*.parquet"))

    def lookup(self, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """The cached vectors of those `hashes` that are in the cache. Reads the hash column of every part and
        the vectors only of the parts that hold a wanted hash."""
        wanted = set(hashes)
        found: dict[str, np.ndarray] = {}
        for part in self.parts():
            if len(found) == len(wanted):
                break
            part_hashes = pq.read_table(part, columns=["text_hash"]).column("text_hash").to_pylist()
            rows = [i for i, h in enumerate(part_hashes) if h in wanted and h not in found]
            if not rows:
                continue
            column = pq.read_table(part, columns=["vector"]).column("vector").combine_chunks()
            width = column.type.list_size
            if width != self.single.dim:
                raise UserError(
                    f"embedding cache part {part} holds {width}-d vectors, encoder {self.single.id} gives "
                    f"{self.single.dim}-d: the file is damaged, delete it"
                )
            vectors = column.values.to_numpy(zero_copy_only=False).reshape(-1, width)  # (rows, D)
            for i in rows:
                found[part_hashes[i]] = vectors[i]
        return found

    def embed(
        self, texts: Sequence[str], progress: bool = False, backend: str = "local", ray_address: str | None = None
    ) -> np.ndarray:
        """(N, D) float32 vectors of `texts` in the order given; encodes (and stores) only uncached texts.
        `hits` and `misses` count the distinct one-view texts found and encoded.

        `backend="ray"` encodes the uncached texts on a pool of Ray actors (`offline_agent.text.ray`; the
        cache is read and written here, in the driver); `ray_address` as in `offline_agent.ray_backend`.
        """
        from offline_agent.ray_backend import check_backend, require_ray

        if check_backend(backend) == "ray":
            require_ray()  # a missing extra is reported even when every text is cached
        texts = list(texts)
        if self.single is self.encoder:
            return self._embed_one_view(texts, progress, backend, ray_address)
        return state_views(
            texts, lambda views: self._embed_one_view(views, progress, backend, ray_address),
            bool(getattr(self.encoder, "per_turn", False)), bool(getattr(self.encoder, "observation_view", False)),
        )

    def _embed_one_view(self, texts: list[str], progress: bool, backend: str, ray_address: str | None) -> np.ndarray:
        hashes = [text_hash(t) for t in texts]
        # Actions and candidates repeat a lot: each distinct text is looked up and encoded once.
        unique: dict[str, str] = {}
        for h, t in zip(hashes, texts, strict=True):
            unique.setdefault(h, t)
        found = self.lookup(list(unique))
        missing = [h for h in unique if h not in found]
        self.hits, self.misses = len(found), len(missing)
        if missing and backend == "ray":
            from offline_agent.text.ray import encode_on_ray

            # The driver stores the vectors as shards come back, a part every `PART_ROWS` (20,000) texts, so
            # that an interrupted run keeps most of its work.
            encoded = encode_on_ray(
                self.single, [unique[h] for h in missing], ray_address, progress,
                keep=lambda rows, vectors: self._write_part([missing[i] for i in rows], vectors),
            )
            found.update(zip(missing, encoded, strict=True))
        elif missing:
            to_encode = [unique[h] for h in missing]
            # Only TextEncoder takes `progress`; a duck-typed encoder needs no more than encode(texts).
            encoded = self.single.encode(to_encode, progress=True) if progress else self.single.encode(to_encode)
            self._write_part(missing, encoded)
            found.update(zip(missing, encoded, strict=True))
        out = np.empty((len(texts), self.single.dim), dtype=np.float32)
        for i, h in enumerate(hashes):
            out[i] = found[h]
        return out

    def _write_part(self, hashes: list[str], vectors: np.ndarray) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write_encoder_json()
        flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1), type=pa.float32())
        table = pa.table(
            {
                "text_hash": pa.array(hashes, pa.string()),
                "vector": pa.FixedSizeListArray.from_arrays(flat, self.single.dim),
            },
            schema=self.schema,
        )
        # Time first, so that a listing reads oldest to newest; the uuid keeps concurrent writers apart.
        name = f"part-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:12]}.parquet"
        tmp = self.folder / f".{name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, self.folder / name)
        return self.folder / name

    def _write_encoder_json(self) -> None:
        # What produced these vectors, for a human looking at the folder; the id alone keys the cache.
        path = self.folder / "encoder.json"
        if path.exists():
            return
        info = {
            "id": self.single.id,
            "path": self.single.path,
            "dim": self.single.dim,
            "max_length": self.single.max_length,
            "precision": getattr(self.single, "precision", "fp32"),
            "pooling": "mean",
            "normalize": "l2",
        }
        tmp = self.folder / f".encoder.json.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        os.replace(tmp, path)

    def __repr__(self) -> str:
        return f"EmbeddingCache({str(self.folder)!r}, parts={len(self.parts())})"


# --- memo ------------------------------------------------------------------------------------------

#: Texts an `EmbeddingMemo` keeps by default: ~75 MB of 384-d vectors plus the texts (a state text is ~1 KB),
#: more than a 24-iteration fine-tuning run or a few thousand evaluation episodes meet.
DEFAULT_MEMO_ENTRIES = 50_000


class EmbeddingMemo:
    """Text -> vector memo of one encoder, in memory, bounded: past `max_entries` texts the least recently
    used one is dropped.

    Rollouts meet each state text once or a few times and the same candidate texts over and over, and the
    encoder is most of their cost. `embed(texts)` hands the distinct texts it has not seen to the encoder in
    one `encode` call: the states of all environments of a step go through one padded forward pass, which
    on CPU encodes several times as many texts per second as one text at a time. A text's vector then depends
    (by ~1e-7, padding changes the kernels' shapes) on which texts were new together with it; what a run
    needs to repeat itself bit for bit is the memo's whole state, which `arrays()` and `load_arrays` carry
    (fine-tuning saves it with each resume checkpoint).

    With a per-turn encoder (`TextEncoder(per_turn=True)`) the memo keeps the plain vectors of the blocks of
    the state texts (`per_turn_vectors`), not of the texts: a new state brings one new block, and the memo
    holds that block's vector for every later state of the episode.

    `store` is the text -> vector dict to keep them in (least recently used first), to share one memo's
    vectors between several (policies compared on the same episodes meet the same states); by default
    its own. `hits` and `misses` count distinct texts found and encoded, `encoder_calls` the encoder calls,
    `evicted` the texts dropped to stay within the bound.
    """

    def __init__(self, encoder: Any, max_entries: int = DEFAULT_MEMO_ENTRIES, store: dict[str, Any] | None = None):
        if max_entries < 1:
            raise ValueError(f"an embedding memo holds at least 1 text, got max_entries={max_entries}")
        self.encoder = encoder
        self.max_entries = max_entries
        self.vectors: dict[str, np.ndarray] = {} if store is None else store
        self.hits = self.misses = self.encoder_calls = self.evicted = 0
        # The id the vectors are of: an encoder whose id changes (tuned layers loaded into it) invalidates them.
        self.encoder_id = getattr(encoder, "id", None)
        self.per_turn = bool(getattr(encoder, "per_turn", False))
        # What the memo's vectors are of: the plain encoder's, for blocks, when the encoder is per turn.
        self.plain = encoder.single_view() if self.per_turn else encoder

    def __len__(self) -> int:
        return len(self.vectors)

    def __contains__(self, text: object) -> bool:
        return text in self.vectors

    def __getitem__(self, text: str) -> np.ndarray:
        """The vector of a text in the memo (KeyError if it is not); a look, not a use: no count, no reordering."""
        return self.vectors[text]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(N, D) float32 vectors of `texts` in their order; the texts (or, per turn, their blocks) not in the
        memo are encoded together."""
        texts = list(texts)
        if self.per_turn:
            return state_views(texts, self._embed_memoised, True, self.encoder.observation_view)
        return self._embed_memoised(texts)

    def _embed_memoised(self, texts: list[str]) -> np.ndarray:
        if getattr(self.encoder, "id", None) != self.encoder_id:
            self.evicted += len(self.vectors)
            self.vectors.clear()
            self.encoder_id = getattr(self.encoder, "id", None)
        distinct = list(dict.fromkeys(texts))
        vectors = self.vectors
        found: dict[str, np.ndarray] = {}
        for text in distinct:
            vector = vectors.pop(text, None)
            if vector is not None:
                found[text] = vectors[text] = vector  # re-inserted: now the most recently used
        missing = [t for t in distinct if t not in found]
        self.hits += len(found)
        if missing:
            encoded = np.asarray(self.plain.encode(missing), dtype=np.float32)  # (M, D)
            self.encoder_calls += 1
            self.misses += len(missing)
            for text, vector in zip(missing, encoded, strict=True):
                # A copy: a view would keep the whole batch's array alive until its last row is evicted.
                found[text] = vectors[text] = vector.copy()
            self._evict()
        if not texts:
            return np.zeros((0, self.plain.dim), dtype=np.float32)
        return np.stack([found[t] for t in texts])

    def _evict(self) -> None:
        # A dict keeps insertion order and every use re-inserts: the first key is the least recently used.
        while len(self.vectors) > self.max_entries:
            del self.vectors[next(iter(self.vectors))]
            self.evicted += 1

    def arrays(self) -> dict[str, np.ndarray]:
        """The memo as arrays, least recently used first (`offline_agent.text.known.text_arrays`): `texts`
        (UTF-8 bytes, uint8), `offsets` (N + 1, int64: text i is texts[offsets[i]:offsets[i + 1]]) and `vectors`
        (N, D) float32."""
        from offline_agent.text.known import text_arrays

        return text_arrays(list(self.vectors), list(self.vectors.values()), int(self.plain.dim))

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the memo's texts and vectors (and their order) with those of `arrays()`."""
        from offline_agent.text.known import texts_and_vectors

        entries = list(texts_and_vectors(arrays, int(self.plain.dim)))  # checked before anything is replaced
        self.vectors.clear()
        self.vectors.update(entries)
        self._evict()

    def seed(self, arrays: dict[str, np.ndarray]) -> int:
        """Add the texts of `arrays` (as `arrays()` gives them; a checkpoint's known texts,
        `offline_agent.text.known`) that the memo does not hold, uncounted; returns how many were added."""
        from offline_agent.text.known import texts_and_vectors

        added = 0
        for text, vector in texts_and_vectors(arrays, int(self.plain.dim)):
            if text not in self.vectors:
                self.vectors[text] = vector
                added += 1
        self._evict()
        return added

    def __repr__(self) -> str:
        return (
            f"EmbeddingMemo({len(self)}/{self.max_entries} texts, hits={self.hits}, misses={self.misses}, "
            f"encoder_calls={self.encoder_calls}, evicted={self.evicted})"
        )
