"""Behaviour cloning over candidate actions, and filtered BC: the baselines CQL has to beat.

BC scores candidates with the same network as CQL (`QNetwork`, one head) and
trains it as a classifier: cross-entropy of the logged action against the
other candidates of its step,

    loss = -log softmax_{a' in C(s) + {a}} f(s, a')[a]

so its scores are logits and its policy is softmax(f / tau) with tau = 1.
Filtered BC (the "%BC" of Chen et al. 2021) clones only the episodes whose
return is in the top `filter_fraction` of the train split: on mixed-quality
logs it imitates the better episodes without learning values at all.

Dimension letters: B batch, C candidate slots, D embedding width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offline_agent.determinism import deterministic_torch
from offline_agent.errors import UserError
from offline_agent.learn.cql import OnStep, check_common, optimizer_for, train_rows
from offline_agent.learn.encoder_tuning import EncoderTuner, EncoderTuningSettings
from offline_agent.learn.features import Features, make_batch
from offline_agent.learn.grounding import PAIR_DIM
from offline_agent.learn.networks import QNetwork, masked

METRICS = ("loss/bc", "policy/data_prob")


@dataclass
class BCConfig(EncoderTuningSettings):
    """Settings of a BC run; `filter_fraction` < 1 makes it filtered BC."""

    steps: int = field(default=2000, metadata={"help": "gradient steps"})
    batch_size: int = field(default=256, metadata={"help": "steps per gradient step"})
    learning_rate: float = field(default=3e-4, metadata={"help": "Adam learning rate"})
    gamma: float = field(default=0.99, metadata={"help": "unused by BC; kept so configs share their checks"})
    tau: float = field(default=1.0, metadata={"help": "temperature of softmax(logits / tau); 1 = as trained"})
    hidden: int = field(default=256, metadata={"help": "hidden width of the scoring network"})
    filter_fraction: float = field(
        default=1.0, metadata={"help": "clone only episodes in this top fraction of return (1 = plain BC)"}
    )
    n_sampled_candidates: int = field(default=16, metadata={"help": "candidates sampled where the log has none"})
    grounding: bool = field(
        default=True, metadata={"help": "score each candidate with its grounding in the episode (grounding.py)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of initialisation and batch sampling"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})
    log_every: int = field(default=10, metadata={"help": "record metrics every N steps"})

    def __post_init__(self) -> None:
        check_common(self)
        self.check_encoder_tuning()
        if not 0.0 < self.filter_fraction <= 1.0:
            raise UserError(
                f"filter_fraction must be in (0, 1], got {self.filter_fraction}: e.g. 0.2 clones the best 20% "
                "of episodes, 1.0 is plain BC"
            )


def bc_loss(logit_data: torch.Tensor, logit_cand: torch.Tensor, cand_mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logged action: logit_data (B,), logit_cand (B, C), cand_mask (B, C) -> (B,)."""
    logits = torch.cat([logit_data[:, None], masked(logit_cand, cand_mask)], 1)  # (B, 1 + C)
    return torch.logsumexp(logits, 1) - logit_data


def top_episode_rows(features: Features, rows: torch.Tensor, fraction: float) -> torch.Tensor:
    """The subset of `rows` (n,) whose episode's return is in the top `fraction` of their episodes.

    Ties at the cut are all kept (a sparse 0/1 return would otherwise be cut at random).
    """
    if fraction >= 1.0:
        return rows
    episodes = torch.unique(features.episode_index[rows])
    returns = features.episode_return[episodes]
    n_keep = max(1, int(round(fraction * episodes.shape[0])))
    cut = torch.sort(returns, descending=True).values[n_keep - 1]
    kept = episodes[returns >= cut]
    return rows[torch.isin(features.episode_index[rows], kept)]


@deterministic_torch()  # a seed alone is not reproducible on several CPU threads
def train_bc(
    features: Features, config: BCConfig, on_step: OnStep | None = None, tuner: EncoderTuner | None = None
) -> tuple[QNetwork, list[dict[str, float]]]:
    """Train a one-head `QNetwork` as a classifier of the logged action. Returns it and its metric rows.

    With a `tuner`, the encoder's top layers are trained with the same loss (see `train_cql`)."""
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    rows = top_episode_rows(features, train_rows(features), config.filter_fraction)
    grounding = features.grounding_table() if config.grounding else None
    net = QNetwork(features.dim, config.hidden, n_heads=1, pair_dim=PAIR_DIM if config.grounding else 0)
    net = net.to(config.device)
    optimizer = optimizer_for(net, config, tuner)
    history: list[dict[str, float]] = []
    for step in range(1, config.steps + 1):
        pick = rows[torch.randint(rows.shape[0], (config.batch_size,), generator=generator)]
        batch = make_batch(features, pick, generator, config.n_sampled_candidates, grounding=grounding)
        if tuner is not None:
            batch = tuner.batch(batch, pick, features, step, next_states=False)
        batch = batch.to(config.device)
        cand_all = torch.cat([batch.action[:, None, :], batch.cand], 1)  # (B, 1 + C, D)
        logits = net.all_heads(batch.state, cand_all, batch.pair)[0]  # (1, B, 1 + C) -> (B, 1 + C)
        loss = bc_loss(logits[:, 0], logits[:, 1:], batch.cand_mask).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        record = None
        if step % config.log_every == 0 or step == config.steps:
            record = {"step": step, "loss/bc": loss.item(), "policy/data_prob": float(torch.exp(-loss.detach()))}
            history.append(record)
        if on_step is not None:
            on_step(step, record)
    return net.eval(), history
