"""Fine-tuning the text encoder's top layers with the learner's loss (`--tune-encoder-layers L`).

Frozen sentence embeddings blur decisions that hang on a few tokens of a long state (Logistics: a
quantity against a stock, a time against a due time; `learn/README.md` has the measurements). Training
the encoder with the Q or BC loss lets the representation keep them. Training all of it costs a forward
and backward pass through every layer for every state of every batch; training only the top L layers
costs a fraction L / n_layers of that, because the hidden states that enter layer n - L never change:
they are computed once per distinct text (`token_states`, kept as float16 without padding) and each step
runs only the top L layers, the mean pooling and the L2 norm (`EncoderTop`).

What gets a gradient: the states of the batch (current states; next states are only used in the TD
target, without gradient). Actions share the encoder's weights, so their embeddings move with it: the
table of every action's vector is recomputed without gradient every `refresh_every` steps
(`EncoderTuner.refresh_actions`). With `action_gradient` the batch's logged actions and candidates are
embedded with gradient too, at a few times the states' compute (several distinct candidate texts per
state).

The tuned layers are saved next to the policy (`RUN/encoder.safetensors`); `TextEncoder.load_tuned_layers`
puts them into a fresh copy of the base encoder at decision time (`offline_agent.text.tuning`).

Dimension letters: B batch, T tokens, D hidden width (= embedding width), N texts, V actions.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from offline_agent.errors import UserError
from offline_agent.learn.features import Batch, Features
from offline_agent.text.encoder import mean_pool, progress_bar
from offline_agent.text.tuning import LAYER_PREFIX, transformer_layers, tuned_encoder_id

ENCODER_FILE = "encoder.safetensors"


@dataclass
class EncoderTuningSettings:
    """The encoder-tuning fields of the learners that can tune it (`CQLConfig`, `BCConfig` inherit them)."""

    tune_encoder_layers: int = field(
        default=0, metadata={"help": "fine-tune the encoder's top N layers with the loss (0 = frozen features)"}
    )
    encoder_learning_rate: float = field(default=5e-5, metadata={"help": "Adam learning rate of tuned layers"})
    encoder_lora_rank: int = field(
        default=0, metadata={"help": "tune the layers through LoRA updates of this rank (0 = the layers themselves)"}
    )
    encoder_action_gradient: bool = field(
        default=False, metadata={"help": "tuned layers also learn from the batch's action texts (slower)"}
    )

    def check_encoder_tuning(self) -> None:
        """One-line errors for values that cannot work (called by the configs' `__post_init__`)."""
        if self.tune_encoder_layers < 0:
            raise UserError(
                f"tune_encoder_layers must be >= 0, got {self.tune_encoder_layers}: 0 keeps the encoder frozen, "
                "1 or 2 fine-tune its top layers"
            )
        if self.encoder_lora_rank < 0:
            raise UserError(
                f"encoder_lora_rank must be >= 0 (0 = train the layers themselves), got {self.encoder_lora_rank}"
            )
        if not self.encoder_learning_rate > 0:
            raise UserError(f"encoder_learning_rate must be > 0, got {self.encoder_learning_rate}; e.g. 5e-5")


def layer_mask(model: nn.Module, attention_mask: torch.Tensor, hidden: torch.Tensor) -> Any:
    """The attention mask in the form the model's layers take (it depends on the attention implementation).

    Uses transformers' public mask builder, the one an encoder's own forward calls, and not the model's private
    helper, whose signature changes between releases (5.25 added `position_ids`). Releases before the builder
    existed (4.x before 4.53) take an additive mask, built here because their `get_extended_attention_mask`
    is gone from 5.x.
    """
    try:
        from transformers.masking_utils import create_bidirectional_mask
    except ImportError:
        return additive_mask(attention_mask, hidden.dtype)
    return create_bidirectional_mask(config=model.config, inputs_embeds=hidden, attention_mask=attention_mask)


def additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, T) 1/0 mask -> (B, 1, 1, T) additive mask: 0 where a key may be attended, the dtype's minimum where not
    (what BERT's layers added to their attention scores in transformers 4.x)."""
    blocked = 1.0 - attention_mask[:, None, None, :].to(dtype)
    return blocked * torch.finfo(dtype).min


@dataclass
class TokenStates:
    """Hidden states of N texts at one layer, unpadded: rows offsets[i]:offsets[i+1] of `hidden` are text i."""

    hidden: torch.Tensor  # (sum of token counts, D) float16
    offsets: torch.Tensor  # (N + 1,) int64

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Texts `index` (B,) padded to their longest: hidden (B, T, D) float32 and mask (B, T) int64."""
        starts, ends = self.offsets[index], self.offsets[index + 1]
        lengths = ends - starts
        width = int(lengths.max()) if index.numel() else 0
        position = torch.arange(width)[None, :]  # (1, T)
        mask = position < lengths[:, None]  # (B, T)
        rows = torch.where(mask, starts[:, None] + position, 0)  # (B, T) rows of `hidden`, 0 in padding
        out = self.hidden[rows].float() * mask[..., None]  # (B, T, D)
        return out, mask.long()


def token_states(encoder: Any, texts: Sequence[str], n_top: int, progress: bool = False) -> TokenStates:
    """The hidden states that enter the encoder's top `n_top` layers, for each of `texts` (truncated as
    `TextEncoder.encode` truncates them)."""
    model, n_layers = encoder.model, len(transformer_layers(encoder.model))
    chunks: list[torch.Tensor] = [torch.empty(0, encoder.dim, dtype=torch.float16)] * len(texts)
    with progress_bar(progress, len(texts), "encoder states") as advance, torch.inference_mode():
        for idx, batch in encoder.tokenized_batches(texts):
            hidden = model(**batch, output_hidden_states=True).hidden_states[n_layers - n_top]  # (B, T, D)
            lengths = batch["attention_mask"].sum(1).tolist()
            for row, i in enumerate(idx):
                # Right padding (BERT tokenizers): a text's tokens are the first `length` positions.
                chunks[i] = hidden[row, : lengths[row]].to(torch.float16).cpu()
            advance(len(idx))
    offsets = torch.zeros(len(texts) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64), 0)
    return TokenStates(torch.cat(chunks) if chunks else torch.empty(0, encoder.dim, dtype=torch.float16), offsets)


class LoRALinear(nn.Module):
    """`base(x) + (alpha / r) * x A^T B^T`: a frozen Linear and a trainable rank-r update (Hu et al. 2021).

    B starts at zero, so the layer starts as `base`; `merged_weight` folds the update into one matrix,
    which is what a checkpoint keeps (decision time runs a plain encoder).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_down = nn.Parameter(torch.empty(rank, base.in_features))  # A (r, in)
        self.lora_up = nn.Parameter(torch.zeros(base.out_features, rank))  # B (out, r)
        nn.init.kaiming_uniform_(self.lora_down, a=5**0.5)  # nn.Linear's own init
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_down.T @ self.lora_up.T) * self.scale

    def merged_weight(self) -> torch.Tensor:
        return self.base.weight + self.scale * self.lora_up @ self.lora_down  # (out, in)


def add_lora(module: nn.Module, rank: int, alpha: float) -> None:
    """Freeze `module` and put a `LoRALinear` around each of its Linear layers, in place."""
    module.requires_grad_(False)
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, LoRALinear(child, rank, alpha))
        else:
            add_lora(child, rank, alpha)


class EncoderTop(nn.Module):
    """A trainable copy of the encoder's top `n_top` layers, then mean pooling and L2 norm.

    With `lora_rank` > 0 the copied layers stay frozen and each of their Linear layers gets a LoRA
    update of that rank instead (`LoRALinear`). Dropout stays off (eval mode) as when the encoder
    embeds at decision time: training then sees the vectors the policy will see, and a seeded run is
    deterministic.
    """

    def __init__(self, encoder: Any, n_top: int, lora_rank: int = 0, lora_alpha: float = 16.0):
        super().__init__()
        stack = transformer_layers(encoder.model)
        if not 1 <= n_top <= len(stack):
            raise UserError(
                f"--tune-encoder-layers must be between 1 and the encoder's {len(stack)} layers, got {n_top}"
            )
        if lora_rank < 0:
            raise UserError(f"encoder_lora_rank must be >= 0 (0 = train the layers themselves), got {lora_rank}")
        self.n_top = n_top
        self.layers = nn.ModuleList(copy.deepcopy(layer) for layer in stack[-n_top:]).requires_grad_(True)
        if lora_rank:
            add_lora(self.layers, lora_rank, lora_alpha)
        self._base = [encoder.model]  # for the mask helper only: a list keeps it out of the parameters

    def train(self, mode: bool = True) -> EncoderTop:
        return super().train(False)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, D) entering the top layers, mask (B, T) -> (B, D) unit vectors."""
        attention = layer_mask(self._base[0], mask, hidden)
        for layer in self.layers:
            out = layer(hidden, attention_mask=attention)
            hidden = out[0] if isinstance(out, tuple) else out  # transformers < 5 returns a tuple
        return mean_pool(hidden, mask)

    def layer_state(self) -> dict[str, torch.Tensor]:
        """The tuned layers' tensors under the encoder's own names (LoRA updates merged), as saved in ENCODER_FILE."""
        state = {
            name.replace(".base.", "."): t
            for name, t in self.layers.state_dict().items()
            if ".lora_" not in name
        }
        for name, module in self.layers.named_modules():
            if isinstance(module, LoRALinear):
                state[f"{name}.weight"] = module.merged_weight()
        return {f"{LAYER_PREFIX}{name}": t.detach().cpu().contiguous() for name, t in state.items()}


class EncoderTuner:
    """The trainable top of an encoder over a dataset's cached lower-layer states.

    `batch(batch, rows, features)` gives a learner's `Batch` whose state vectors come from the tuned layers
    (with gradient for the current states), and whose action table is the latest refresh.
    """

    def __init__(
        self,
        encoder: Any,
        features: Features,
        n_top: int,
        lora_rank: int = 0,
        action_gradient: bool = False,
        refresh_every: int = 20,
        progress: bool = False,
    ):
        if features.state_texts is None:
            raise ValueError("encoder tuning needs the state texts: build the features with keep_texts=True")
        if features.encoder_id != encoder.id:
            raise ValueError("features were built with another encoder than the one to tune")
        if refresh_every < 1:
            raise UserError(f"refresh_every must be >= 1, got {refresh_every}")
        self.base_id = encoder.id
        self.top = EncoderTop(encoder, n_top, lora_rank).to(encoder.device)
        self.lora_rank = lora_rank
        self.device = encoder.device
        distinct = list(dict.fromkeys(features.state_texts))
        where = {text: i for i, text in enumerate(distinct)}
        self.state_index = torch.tensor([where[t] for t in features.state_texts], dtype=torch.int64)  # (N,)
        self.states = token_states(encoder, distinct, n_top, progress)
        self.actions = token_states(encoder, features.vocab, n_top, progress)
        self.refresh_every = refresh_every
        self.action_gradient = action_gradient
        self.refresh_actions()

    def parameters(self) -> list[nn.Parameter]:
        """The trainable ones: the layers' own, or only the LoRA updates."""
        return [p for p in self.top.parameters() if p.requires_grad]

    def embed_texts(self, states: TokenStates, index: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """(B, D) vectors of texts `index` (B,) through the tuned layers, with gradient if enabled."""
        parts = []
        for start in range(0, index.shape[0], chunk):
            hidden, mask = states.gather(index[start : start + chunk])
            parts.append(self.top(hidden.to(self.device), mask.to(self.device)))
        return torch.cat(parts) if parts else torch.zeros(0, self.top_dim, device=self.device)

    @property
    def top_dim(self) -> int:
        return int(self.actions.hidden.shape[1])

    @torch.no_grad()
    def refresh_actions(self) -> None:
        """Recompute every action's vector with the current weights (no gradient)."""
        self.action_table = self.embed_texts(self.actions, torch.arange(len(self.actions))).cpu()

    def batch(
        self, batch: Batch, rows: torch.Tensor, features: Features, step: int, next_states: bool = True
    ) -> Batch:
        """`batch` (drawn by `make_batch` for `rows`) with the tuned encoder's vectors in place of the frozen ones.

        Refreshes the action table first when `step` is a multiple of `refresh_every`. With
        `action_gradient`, the logged actions and candidates of the batch are embedded afresh, with
        gradient (a few times the states' compute). Without `next_states` (BC, which has no TD target)
        the next states keep their frozen vectors.
        """
        if step % self.refresh_every == 0:
            self.refresh_actions()
        state = self.embed_texts(self.states, self.state_index[rows])  # (B, D), with gradient
        next_state = batch.next_state
        if next_states:
            with torch.no_grad():
                nxt = features.next_index[rows].clamp(min=0)  # rows without one are `done`: not bootstrapped
                next_state = self.embed_texts(self.states, self.state_index[nxt])
        table = self.action_table.to(state.device)
        if self.action_gradient:
            ids = torch.unique(torch.cat([batch.action_id, batch.cand_ids[batch.cand_ids >= 0]]))  # (U,)
            table = table.index_copy(0, ids.to(table.device), self.embed_texts(self.actions, ids))
        return replace(
            batch,
            state=state,
            next_state=next_state,
            action_table=table,  # the batch's `action` and `cand` are gathered from it
        )

    def layer_state(self) -> dict[str, torch.Tensor]:
        return self.top.layer_state()

    def describe(self) -> dict[str, Any]:
        """What policy.json records of the tuning (the tuned id is the base id and the weights' digest)."""
        return {
            "layers": self.top.n_top,
            "lora_rank": self.lora_rank,
            "action_gradient": self.action_gradient,
            "trainable_parameters": sum(p.numel() for p in self.parameters()),
            "base_id": self.base_id,
            "tuned_id": tuned_encoder_id(self.base_id, self.layer_state()),
            "state_texts": len(self.states),
            "cached_tokens": int(self.states.hidden.shape[0] + self.actions.hidden.shape[0]),
        }
