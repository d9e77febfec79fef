"""What a text encoder needs of its fine-tuned top layers: where they sit, and the id they give it.

`offline_agent.learn.encoder_tuning` trains an encoder's top layers with the learner's loss and saves them next
to the policy (`RUN/encoder.safetensors`, tensors named `layers.<i>.<name>`); `TextEncoder.load_tuned_layers`
puts them into a fresh copy of the base encoder at decision time, and the encoder's id becomes
`<base id>-tuned-<digest of the weights>`, so that embedding caches of the base and the tuned encoder
never mix.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from offline_agent.errors import UserError

#: Prefix of the tuned layers' tensors in a run's encoder file: `layers.<i>.<name>` for the i-th of the top L.
LAYER_PREFIX = "layers."


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of transformer blocks: the ModuleList with `num_hidden_layers` entries."""
    n = getattr(model.config, "num_hidden_layers", None)
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and n is not None and len(m) == n]
    if not stacks:
        raise UserError(
            f"cannot find the transformer layers of encoder {type(model).__name__} (no list of "
            f"{n} blocks): --tune-encoder-layers supports BERT-like encoders; train with frozen features"
        )
    return stacks[0]


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 hex of tensors by name (bytes, dtype, shape): names a tuned encoder in its id."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}\x00{t.dtype}\x00{tuple(t.shape)}\x00".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tuned_encoder_id(base_id: str, state: dict[str, torch.Tensor]) -> str:
    return f"{base_id}-tuned-{weights_digest(state)[:12]}"
