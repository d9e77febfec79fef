"""The texts a checkpoint knows: vectors of the logs' most frequent texts, saved beside the policy.

A rollout encodes every text it has not met (`EmbeddingMemo`), and a fresh one has met none. Yet most of what
it meets was in the logs the policy was trained on: the candidate actions, the `[act]` blocks of its own
choices, and many observations (status lines, error messages, tool results that recur). On the bundled
PipelineRepair logs, 254 of the 340 texts a 256-step rollout encoded from an empty memo had been embedded when
the dataset was. So `train` saves the vectors of the dataset's `MAX_KNOWN_TEXTS` most frequent texts (the
candidates and actions, and with per-turn vectors the blocks of the state texts) from its embedding cache,
and every memo of a loaded policy starts with them (`EmbeddingMemo.seed`).

They are the vectors the policy was trained on (fp32 unless `train --encoder-precision` said otherwise): a
rollout encoder in another precision meets them exactly where it would otherwise have computed its own
approximations of them.

The arrays are the memo's own format (`text_arrays`): `texts` (UTF-8 bytes, uint8), `offsets` (N + 1, int64)
and `vectors` (N, D) float32.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from offline_agent.text.states import turn_blocks

#: The most texts a checkpoint keeps vectors of: 15 MB at 384 dimensions, a few hundred KB of text besides.
MAX_KNOWN_TEXTS = 10_000


def frequent_texts(
    state_texts: Sequence[str] | None, candidates: Iterable[str], per_turn: bool, limit: int = MAX_KNOWN_TEXTS
) -> list[str]:
    """The `limit` texts a rollout is likeliest to meet, most frequent first (ties in text order): every
    candidate and logged action (`candidates`, counted once each: a decision meets its candidates), and with
    `per_turn` the blocks of `state_texts`, each counted once per state it is in."""
    counts: Counter[str] = Counter(dict.fromkeys(candidates, 1))
    if per_turn and state_texts is not None:
        for text in state_texts:
            counts.update(turn_blocks(text))
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [text for text, _ in ranked[:limit]]


def text_arrays(texts: Sequence[str], vectors: np.ndarray | Sequence[np.ndarray], dim: int) -> dict[str, np.ndarray]:
    """Texts and their vectors as arrays: `texts` (the texts' UTF-8 bytes, one after the other, uint8),
    `offsets` (N + 1, int64: text i is texts[offsets[i]:offsets[i + 1]]) and `vectors` (N, dim) float32."""
    encoded = [t.encode("utf-8", errors="surrogatepass") for t in texts]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(b) for b in encoded])
    stacked = np.stack(list(vectors)) if len(encoded) else np.zeros((0, dim), np.float32)
    return {
        "texts": np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(),
        "offsets": offsets,
        "vectors": stacked.astype(np.float32, copy=False),
    }


def texts_and_vectors(arrays: dict[str, np.ndarray], dim: int) -> Iterator[tuple[str, np.ndarray]]:
    """(text, vector) of each entry of `text_arrays`, in order; a ValueError if they do not fit `dim`."""
    raw = np.asarray(arrays["texts"], dtype=np.uint8).tobytes()
    offsets = np.asarray(arrays["offsets"], dtype=np.int64)
    vectors = np.asarray(arrays["vectors"], dtype=np.float32)
    if len(offsets) != len(vectors) + 1 or (len(vectors) and vectors.shape[1] != dim):
        raise ValueError(
            f"text arrays of {len(offsets) - 1} texts and {vectors.shape} vectors do not fit a {dim}-d encoder"
        )
    for i, vector in enumerate(vectors):
        yield raw[offsets[i] : offsets[i + 1]].decode("utf-8", errors="surrogatepass"), vector.copy()
