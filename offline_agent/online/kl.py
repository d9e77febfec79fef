"""The KL term that keeps fine-tuning near the offline policy: its exact value, and the controllers of its weight.

Fine-tuning maximises `r - beta * KL(pi(.|s) || pi_ref(.|s))` per step, pi_ref the
frozen offline policy. Over a candidate set the KL is a finite sum, so it is
computed exactly (no k1/k3 sample estimator is needed, unlike token-level RLHF):
`KL = sum_{a in C(s)} pi(a|s) (log pi(a|s) - log pi_ref(a|s))`, padding slots
excluded. beta is either fixed or adapted after each rollout by the
proportional controller of Ziegler et al. 2019 ("Fine-Tuning Language Models
from Human Preferences", sec. 2.2), which moves it so that the mean per-step KL
of a rollout tracks a target:

    e = clip(KL / target - 1, -0.2, 0.2);   beta <- beta * (1 + e * n_steps / horizon)

Dimension letters: B rows (steps), C candidate slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log softmax over the valid candidates: logits (B, C) float, mask (B, C) bool -> (B, C), -inf where masked.

    A row needs at least one valid slot (the rollout guarantees it: the safety filter always leaves one).
    """
    return torch.log_softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


def exact_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(pi || pi_ref) per row, summed over the valid candidates.

    logp, ref_logp: (B, C) log-probabilities (-inf where masked); mask: (B, C) bool -> (B,) >= 0.
    Masked slots are zeroed *before* any product: 0 * -inf is nan, in the value and in the gradient
    (`torch.where` after the product would still send nan gradients back).
    """
    logp, ref_logp = logp.masked_fill(~mask, 0.0), ref_logp.masked_fill(~mask, 0.0)
    return (mask * logp.exp() * (logp - ref_logp)).sum(-1)


def entropy(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Entropy of pi per row: logp (B, C) (-inf where masked), mask (B, C) bool -> (B,); masked as in `exact_kl`."""
    logp = logp.masked_fill(~mask, 0.0)
    return -(mask * logp.exp() * logp).sum(-1)


@dataclass
class FixedKLController:
    """beta stays where the user put it (`--beta B`)."""

    beta: float

    def update(self, kl: float, n_steps: int) -> None:
        """Nothing to adapt: the signature matches `AdaptiveKLController.update`."""

    def state(self) -> dict[str, float]:
        return {"beta": self.beta}


@dataclass
class AdaptiveKLController:
    """Ziegler et al. 2019's proportional controller of beta (`--target-kl X`).

    `update(kl, n_steps)` after each rollout: beta grows while the measured KL is above `target` and
    shrinks while it is below, by at most 20% of `n_steps / horizon` per update, so a rollout of a
    `horizon` steps can move beta by 20% at most and a noisy KL estimate cannot make it jump.

    The horizon is 1,000 env steps, not Ziegler's 10,000 samples: their rollouts were tens of
    thousands of samples, ours are a few hundred steps (4 envs x 128), and with 10,000 a whole
    20-iteration run could move beta by about 20%: the KL ran at 5-10x its target while beta stayed
    put (`benchmarks/online.py`, 40 iterations on PipelineRepair). With 1,000 a persistent 2x miss
    moves beta by about 2.6x in ten such iterations.
    """

    beta: float
    target: float
    horizon: int = 1_000

    def __post_init__(self) -> None:
        if not self.target > 0:
            raise ValueError(f"target KL must be > 0, got {self.target}")
        if self.horizon < 1:
            raise ValueError(f"KL horizon must be >= 1, got {self.horizon}")

    def update(self, kl: float, n_steps: int) -> None:
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + error * n_steps / self.horizon

    def state(self) -> dict[str, float]:
        return {"beta": self.beta, "target": self.target, "horizon": self.horizon}
