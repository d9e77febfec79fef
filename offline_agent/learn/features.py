"""Features: a trajectory dataset turned into tensors once, at one boundary, for every offline learner.

Per step: the state embedding phi(s), the id of the action in the dataset's
action vocabulary, reward, `terminated`, the row of the next step (-1 at an
episode's end), the ids of the step's logged candidates, the discounted
Monte-Carlo return-to-go (Cal-QL's floor) and the episode's split. Per
vocabulary entry: the action embedding psi(a). The vocabulary is every distinct
canonical action text the dataset holds, logged or offered as a candidate.

Embeddings come from `offline_agent.text` through the dataset's embedding
cache (`DATASET/embeddings/<encoder id>/`), so a second run over the same
dataset encodes nothing. Learners then draw `Batch`es of rows with
`make_batch`, which is where steps without logged candidates get theirs: M
actions sampled from the vocabulary and from the batch's own actions.

Dimension letters: N steps, E episodes, D embedding width, V vocabulary size,
C candidate slots of a step, B batch rows, M sampled candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.compute as pc
import torch

from offline_agent.errors import UserError
from offline_agent.rewards import discounted_returns
from offline_agent.text.states import StateSettings

if TYPE_CHECKING:
    from offline_agent.dataset import TrajectoryDataset
    from offline_agent.learn.grounding import GroundingTable

SPLITS = ("train", "valid", "test")
STEP_COLUMNS = ["episode_id", "step", "action", "reward", "return_to_go", "terminated", "candidates"]


@dataclass
class Features:
    """A dataset as tensors (CPU); rows aligned with `TrajectoryDataset.steps_table()`."""

    state_emb: torch.Tensor  # (N, D) float32
    action_emb: torch.Tensor  # (V, D) float32
    vocab: list[str]  # V canonical action texts, sorted
    action_id: torch.Tensor  # (N,) int64 into vocab
    reward: torch.Tensor  # (N,) float32
    terminated: torch.Tensor  # (N,) bool
    next_index: torch.Tensor  # (N,) int64, -1 on the last step of an episode
    candidate_ids: torch.Tensor  # (N, C) int64 into vocab, -1 in empty slots
    has_candidates: torch.Tensor  # (N,) bool: the log knew this step's candidates
    return_to_go: torch.Tensor  # (N,) float32, discounted with `gamma`
    split: torch.Tensor  # (N,) int64 code into SPLITS
    episode_index: torch.Tensor  # (N,) int64 into episode_ids
    step: torch.Tensor  # (N,) int64
    episode_ids: list[str]  # E
    episode_return: torch.Tensor  # (E,) float32, undiscounted
    episode_success: torch.Tensor  # (E,) float32, nan where the log has no outcome
    episode_split: torch.Tensor  # (E,) int64 code into SPLITS
    encoder_id: str
    state_settings: StateSettings  # how the state texts were rendered (as `for_encoder` fixed them)
    gamma: float
    state_texts: list[str] | None = None  # N: what grounding and encoder tuning read (keep_texts)
    cache_hits: int = 0  # distinct texts found in the embedding cache when these features were built
    cache_misses: int = 0  # distinct texts that had to be encoded
    _grounding: GroundingTable | None = field(default=None, repr=False)

    def grounding_table(self) -> GroundingTable:
        """The grounding of (step, vocabulary action) pairs (`offline_agent.learn.grounding`), built on first use
        and shared by every learner that trains on these features."""
        from offline_agent.learn.grounding import GroundingTable

        if self._grounding is None:
            if self.state_texts is None:
                raise ValueError("grounding reads the state texts: build the features with keep_texts=True")
            self._grounding = GroundingTable(self.state_texts, self.vocab, self.action_id, self.episode_index)
        return self._grounding

    @property
    def n_steps(self) -> int:
        return int(self.state_emb.shape[0])

    @property
    def dim(self) -> int:
        return int(self.state_emb.shape[1])

    @property
    def n_actions(self) -> int:
        return len(self.vocab)

    def rows(self, split: str | None = None) -> torch.Tensor:
        """(n,) int64 row indices of a split (all rows for None)."""
        if split is None:
            return torch.arange(self.n_steps)
        return torch.nonzero(self.split == SPLITS.index(split)).squeeze(1)

    def first_rows(self, split: str | None = None) -> torch.Tensor:
        """(n,) int64 rows of the first step of each episode of a split."""
        first = torch.ones(self.n_steps, dtype=torch.bool)
        first[1:] = self.episode_index[1:] != self.episode_index[:-1]
        if split is not None:
            first &= self.split == SPLITS.index(split)
        return torch.nonzero(first).squeeze(1)

    def returns_to_go(self, gamma: float) -> torch.Tensor:
        """(N,) float32 Monte-Carlo return-to-go under `gamma` (the dataset's own column when gamma matches)."""
        if abs(gamma - self.gamma) < 1e-12:
            return self.return_to_go
        rtg = discounted_returns(self.reward.numpy(), self.episode_index.numpy(), gamma)
        return torch.from_numpy(rtg.astype(np.float32))

    def return_range(self, gamma: float) -> tuple[float, float]:
        """The lowest and highest discounted return-to-go of any logged step under `gamma`: what FQE's bounds
        assume where the logs are silent, and outside which `evaluate` doubts an FQE value."""
        returns = self.returns_to_go(gamma)
        return float(returns.min()), float(returns.max())

    def describe(self) -> dict[str, Any]:
        """Sizes, for run summaries."""
        return {
            "steps": self.n_steps,
            "episodes": len(self.episode_ids),
            "actions": self.n_actions,
            "dim": self.dim,
            "candidate_slots": int(self.candidate_ids.shape[1]),
            "steps_with_candidates": int(self.has_candidates.sum()),
            "train_steps": int((self.split == 0).sum()),
            "test_steps": int((self.split == 2).sum()),
        }


def build_features(
    ds: TrajectoryDataset | str | Path,
    encoder: Any,
    state_settings: StateSettings | None = None,
    cache_root: str | Path | None = None,
    progress: bool = False,
    keep_texts: bool = True,
) -> Features:
    """Embed a dataset's states and actions (through its embedding cache) and gather its columns as tensors.

    `encoder` is a `TextEncoder` or anything with `id`, `dim`, `max_length`, `encode(texts)` (and,
    optionally, `count_tokens`, which makes the state text fit the encoder's window). The states are
    rendered with `state_settings` (None: the defaults) as the encoder fixes them (`StateSettings.for_encoder`):
    its window is their token budget, whatever `max_tokens` the settings given hold.
    """
    from offline_agent.dataset import TrajectoryDataset
    from offline_agent.text.cache import CACHE_DIRNAME, EmbeddingCache
    from offline_agent.text.states import dataset_texts

    if not isinstance(ds, TrajectoryDataset):
        ds = TrajectoryDataset.open(ds)
    state_settings = (state_settings or StateSettings()).for_encoder(encoder)
    steps = ds.steps_table(columns=STEP_COLUMNS)
    if steps.num_rows == 0:
        raise UserError(
            f"dataset {ds.path} has no actions (0 steps): an offline learner needs logged decisions; "
            "ingest logs with assistant actions or tool calls"
        )
    texts = dataset_texts(ds, state_settings, getattr(encoder, "count_tokens", None))
    cols = steps.select(["episode_id", "step", "reward", "return_to_go", "terminated"]).to_pydict()
    actions = steps.column("action").to_pylist()
    vocab = sorted(set(actions) | set(texts.candidates))
    action_index = {a: i for i, a in enumerate(vocab)}

    # One pass over the cache for states and actions together (each lookup reads every part's hashes).
    cache = EmbeddingCache(Path(cache_root) if cache_root else ds.path / CACHE_DIRNAME, encoder)
    vectors = torch.from_numpy(cache.embed(texts.states + vocab, progress=progress))  # (N + V, D)
    state_emb, action_emb = vectors[: steps.num_rows], vectors[steps.num_rows :]

    episodes = ds.episodes_table().select(["episode_id", "return", "success", "split"]).to_pydict()
    episode_pos = {e: i for i, e in enumerate(episodes["episode_id"])}
    episode_index = np.fromiter((episode_pos[e] for e in cols["episode_id"]), np.int64, steps.num_rows)
    episode_split = np.array([SPLITS.index(s) for s in episodes["split"]], dtype=np.int64)
    candidate_ids, has_candidates = _candidate_matrix(steps.column("candidates"), action_index)
    return Features(
        state_emb=state_emb.contiguous(),
        action_emb=action_emb.contiguous(),
        vocab=vocab,
        action_id=torch.tensor([action_index[a] for a in actions], dtype=torch.int64),
        reward=torch.tensor(cols["reward"], dtype=torch.float32),
        terminated=torch.tensor(cols["terminated"], dtype=torch.bool),
        next_index=torch.from_numpy(_next_index(episode_index)),
        candidate_ids=torch.from_numpy(candidate_ids),
        has_candidates=torch.from_numpy(has_candidates),
        return_to_go=torch.tensor(cols["return_to_go"], dtype=torch.float32),
        split=torch.from_numpy(episode_split[episode_index]),
        episode_index=torch.from_numpy(episode_index),
        step=torch.tensor(cols["step"], dtype=torch.int64),
        episode_ids=episodes["episode_id"],
        episode_return=torch.tensor(episodes["return"], dtype=torch.float32),
        episode_success=torch.tensor(
            [float("nan") if s is None else float(s) for s in episodes["success"]], dtype=torch.float32
        ),
        episode_split=torch.from_numpy(episode_split),
        encoder_id=encoder.id,
        state_settings=state_settings,
        gamma=ds.gamma,
        state_texts=texts.states if keep_texts else None,
        cache_hits=cache.hits,
        cache_misses=cache.misses,
    )


def _next_index(episode_index: np.ndarray) -> np.ndarray:
    """(N,) int64: the next row within the same episode, -1 on an episode's last row (rows are contiguous)."""
    n = episode_index.shape[0]
    nxt = np.arange(1, n + 1, dtype=np.int64)
    last = np.ones(n, dtype=bool)
    last[:-1] = episode_index[1:] != episode_index[:-1]
    nxt[last] = -1
    return nxt


def _candidate_matrix(column: Any, action_index: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """The `candidates` list column as (N, C) int64 vocab ids (-1 padded, duplicates dropped) and (N,) bool."""
    has = np.asarray(pc.is_valid(column).to_numpy(zero_copy_only=False), dtype=bool)
    lists = column.to_pylist()
    rows = [list(dict.fromkeys(c)) if c is not None else [] for c in lists]
    width = max((len(r) for r in rows), default=0)
    ids = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = [action_index[a] for a in r]
    has &= np.array([len(r) > 0 for r in rows], dtype=bool)
    return ids, has


# --- batches ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """B transitions with their candidate sets, as the losses take them (all on one device).

    The data action is never among `cand` (its slots are masked out): losses add it explicitly, so that
    a logsumexp over "candidates and the data action" counts it once.
    """

    state: torch.Tensor  # (B, D)
    action_id: torch.Tensor  # (B,) int64
    cand_ids: torch.Tensor  # (B, C) int64, -1 where empty
    cand_mask: torch.Tensor  # (B, C) bool
    reward: torch.Tensor  # (B,) float32
    done: torch.Tensor  # (B,) float32: 1 where there is no next state to bootstrap from
    next_state: torch.Tensor  # (B, D)
    next_cand_ids: torch.Tensor  # (B, C') int64 next step's candidates and its logged action, 0 where empty
    next_mask: torch.Tensor  # (B, C') bool
    return_to_go: torch.Tensor  # (B,) float32
    # The dataset's action embeddings, which every id above indexes: the next step's candidates are kept
    # as ids, so that a network can score each distinct action once (`QNetwork.all_heads_by_id`).
    action_table: torch.Tensor  # (V, D)
    # Grounding of each (state, action) pair (`grounding.py`), only for networks that read it.
    pair: torch.Tensor | None = None  # (B, 1 + C, P): the data action, then `cand`'s slots
    next_pair: torch.Tensor | None = None  # (B, C', P), aligned with next_cand_ids

    def __post_init__(self) -> None:
        b = self.state.shape[0]
        assert self.state.ndim == 2 and self.cand_ids.ndim == 2 and self.action_table.ndim == 2
        assert self.cand_ids.shape == self.cand_mask.shape and self.next_cand_ids.shape == self.next_mask.shape
        assert all(t.shape[0] == b for t in (self.action_id, self.reward, self.done, self.return_to_go))
        assert self.cand_mask.dtype == torch.bool and self.next_mask.dtype == torch.bool
        if self.pair is not None:
            assert self.pair.shape[:2] == (b, 1 + self.cand_ids.shape[1]) and self.next_pair is not None
            assert self.next_pair.shape[:2] == self.next_cand_ids.shape

    # Embeddings of the data action and the candidates are gathered only when asked for: CQL scores by id
    # (`all_heads_by_id`) and never needs the (B, C, D) copy, which cost more than its network's forward.
    @property
    def action(self) -> torch.Tensor:
        """(B, D) embedding of the data action."""
        return self.action_table[self.action_id]

    @property
    def cand(self) -> torch.Tensor:
        """(B, C, D) embeddings of the other candidates (empty slots hold action 0; `cand_mask` hides them)."""
        return self.action_table[self.cand_ids.clamp(min=0)]

    def to(self, device: str | torch.device) -> Batch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{name: None if v is None else v.to(device) for name, v in values.items()})


def candidate_sets(
    features: Features, rows: torch.Tensor, batch_actions: torch.Tensor, generator: torch.Generator, m: int
) -> torch.Tensor:
    """(B, max(C, M)) int64 candidate ids of `rows`; rows without logged candidates get M sampled ones.

    Sampled candidates are half uniform over the vocabulary, half drawn from `batch_actions` (B',)
    (actions other steps actually took, which are the likelier alternatives), so that the conservative
    term has something to push down even where the log never said what else was possible.
    """
    ids = features.candidate_ids[rows]  # (B, C)
    missing = ~features.has_candidates[rows]  # (B,)
    if not bool(missing.any()):
        return ids
    b, width = ids.shape[0], max(ids.shape[1], m)
    ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=-1)  # (B, C) -> (B, max(C, M))
    from_vocab = torch.randint(features.n_actions, (b, m - m // 2), generator=generator)
    from_batch = batch_actions[torch.randint(batch_actions.shape[0], (b, m // 2), generator=generator)]
    sampled = torch.nn.functional.pad(torch.cat([from_vocab, from_batch], 1), (0, width - m), value=-1)
    return torch.where(missing[:, None], sampled, ids)


def make_batch(
    features: Features,
    rows: torch.Tensor,
    generator: torch.Generator,
    n_sampled: int = 16,
    return_to_go: torch.Tensor | None = None,
    grounding: GroundingTable | None = None,
) -> Batch:
    """The transitions of `rows` (B,) with their candidate sets (see `Batch`).

    `return_to_go` (N,) replaces the dataset's column (a learner with another gamma than the dataset's).
    With `grounding` (`Features.grounding_table()`), the batch carries each pair's grounding too.
    """
    action_id = features.action_id[rows]  # (B,)
    cand_ids = candidate_sets(features, rows, action_id, generator, n_sampled)  # (B, C)
    cand_mask = (cand_ids >= 0) & (cand_ids != action_id[:, None])

    nxt = features.next_index[rows]  # (B,)
    has_next = nxt >= 0
    nxt = nxt.clamp(min=0)  # rows without a next step read row 0; `done` zeroes their bootstrap
    next_action = features.action_id[nxt]  # (B,)
    next_ids = candidate_sets(features, nxt, action_id, generator, n_sampled)  # (B, C')
    # The logged next action is always a valid choice at s'; it gets its own slot unless already offered.
    next_action_new = ~(next_ids == next_action[:, None]).any(1, keepdim=True)  # (B, 1)
    next_ids = torch.cat([next_ids, next_action[:, None]], 1)  # (B, C') -> (B, C'+1)
    next_mask = torch.cat([next_ids[:, :-1] >= 0, next_action_new], 1)

    pair = next_pair = None
    if grounding is not None:
        pair = grounding.lookup(rows, torch.cat([action_id[:, None], cand_ids], 1))  # (B, 1 + C, P)
        next_pair = grounding.lookup(nxt, torch.where(next_mask, next_ids, -1))  # (B, C'+1, P)
    emb = features.action_emb
    return Batch(
        state=features.state_emb[rows],
        action_id=action_id,
        cand_ids=cand_ids,
        cand_mask=cand_mask,
        reward=features.reward[rows],
        # A truncated episode's last step has no logged next state: it is not bootstrapped either.
        done=(features.terminated[rows] | ~has_next).float(),
        next_state=features.state_emb[nxt],
        next_cand_ids=next_ids.clamp(min=0),  # (B, C'+1)
        next_mask=next_mask,
        return_to_go=(features.return_to_go if return_to_go is None else return_to_go)[rows],
        action_table=emb,
        pair=pair,
        next_pair=next_pair,
    )


def step_candidates(features: Features, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic candidate sets for scoring logged steps (FQE, diagnostics): the logged candidates and
    the logged action; where the log has no candidates, the whole vocabulary.

    Returns ids (B, C) int64 and mask (B, C) bool.
    """
    action_id = features.action_id[rows]  # (B,)
    ids = features.candidate_ids[rows]  # (B, C)
    new = ~(ids == action_id[:, None]).any(1, keepdim=True)  # (B, 1)
    ids = torch.cat([ids, action_id[:, None]], 1)  # (B, C) -> (B, C+1)
    mask = torch.cat([ids[:, :-1] >= 0, new], 1)
    missing = ~features.has_candidates[rows]
    if not bool(missing.any()):
        return ids, mask
    # Without logged candidates the policy may choose any known action.
    width = max(ids.shape[1], features.n_actions)
    ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=-1)
    mask = torch.nn.functional.pad(mask, (0, width - mask.shape[1]), value=False)
    every = torch.nn.functional.pad(torch.arange(features.n_actions), (0, width - features.n_actions), value=-1)
    ids = torch.where(missing[:, None], every[None, :], ids)
    mask = torch.where(missing[:, None], (every >= 0)[None, :], mask)
    return ids, mask
