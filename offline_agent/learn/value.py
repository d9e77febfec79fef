"""The logs' own value: what the logged agent's episodes go on to return from a step, learned for prediction.

A run's policy network (CQL's Q) is the value of the policy CQL learns, pushed down wherever the logs are
silent: the right thing to act on and the wrong thing to predict with. As a predictor of whether a logged
episode succeeds it was worse on real logs than a logistic regression on the task's embedding (first-state
ROC AUC 0.50-0.71, `benchmarks/results/real_logs_auc.md`), and the one change that made it predict better,
an auxiliary regression of the same heads on the logged returns (`--mc-weight 5`), cost the simulators'
policies most of their success (0.97 -> 0.25 on PipelineRepair).

So a run trains a second, separate network for prediction (`train --value-head`, on by default): the value
of the *logged* agent, Q_beta(s, a), regressed on the discounted Monte-Carlo return G that each logged step's
episode went on to get:

    loss = mean_b (Q_beta(s_b, a_b) - G_b)^2          (logged steps of the train split)

It never touches the policy. It scores what `advise` reports as a situation's predicted return, and what
`evaluate --dataset` reports as the ROC AUC of the run's values for the held-out episodes' success: how much
of the logs' outcomes a value learned from them can tell in advance.

The network is a `FactorisedQNetwork` with one head and no grounding: it reads the state and action vectors
only, so it is scored on any dataset's features. Its weights go to `value.safetensors` in the run folder
(`offline_agent.learn.policy`).

Dimension letters: B batch, D embedding width, n scored steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offline_agent.determinism import deterministic_torch
from offline_agent.errors import UserError
from offline_agent.learn.cql import OnStep, check_common, train_rows
from offline_agent.learn.features import Features
from offline_agent.learn.networks import FactorisedQNetwork

#: Metric names of the value network's training, written beside the policy's in RUN/metrics.parquet.
METRICS = ("value/loss",)


@dataclass
class ValueConfig:
    """Settings of the value network's training; `__post_init__` rejects values that cannot work."""

    steps: int = field(default=1500, metadata={"help": "gradient steps"})
    batch_size: int = field(default=128, metadata={"help": "logged steps per gradient step"})
    learning_rate: float = field(default=3e-4, metadata={"help": "Adam learning rate"})
    gamma: float = field(default=0.99, metadata={"help": "discount of the returns it predicts, in [0, 1]"})
    hidden: int = field(default=128, metadata={"help": "hidden width of its towers"})
    seed: int = field(default=0, metadata={"help": "seed of initialisation and batch sampling"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})
    log_every: int = field(default=10, metadata={"help": "record the loss every N steps"})

    def __post_init__(self) -> None:
        check_common(self)
        if self.hidden < 1:
            raise UserError(f"the value network's hidden width must be >= 1, got {self.hidden}")


def value_loss(predicted: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """`mean (Q_beta(s, a) - G)^2`: predicted (B,) values of the logged steps, returns (B,) their Monte-Carlo
    returns. Returns ()."""
    return (predicted - returns).pow(2).mean()


def logged_values(network: torch.nn.Module, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """(B,) value of each logged step: state (B, D), action (B, D) its logged action's vector."""
    mask = torch.ones(state.shape[0], 1, dtype=torch.bool, device=state.device)
    return network.q_values(state, action[:, None, :], mask)[:, 0]


@deterministic_torch()  # a seed alone is not reproducible on several CPU threads
def train_value(
    features: Features, config: ValueConfig, on_step: OnStep | None = None
) -> tuple[FactorisedQNetwork, list[dict[str, float]]]:
    """Train the value network on the train split's logged steps: (network in eval mode, one metric row per
    log step). Deterministic for a given seed and device."""
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    returns = features.returns_to_go(config.gamma)
    rows = train_rows(features)
    network = FactorisedQNetwork(features.dim, config.hidden, n_heads=1).to(config.device)
    optimizer = torch.optim.Adam(network.parameters(), lr=config.learning_rate, fused=True)
    history: list[dict[str, float]] = []
    for step in range(1, config.steps + 1):
        pick = rows[torch.randint(rows.shape[0], (config.batch_size,), generator=generator)]
        state = features.state_emb[pick].to(config.device)
        action = features.action_emb[features.action_id[pick]].to(config.device)
        loss = value_loss(logged_values(network, state, action), returns[pick].to(config.device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        record = None
        if step % config.log_every == 0 or step == config.steps:
            record = {"step": step, METRICS[0]: float(loss.detach())}
            history.append(record)
        if on_step is not None:
            on_step(step, record)
    return network.eval(), history


@torch.no_grad()
def predicted_returns(
    network: torch.nn.Module, features: Features, rows: torch.Tensor, chunk: int = 4096
) -> torch.Tensor:
    """(n,) the value network's predicted return of the logged steps `rows` (n,)."""
    device = next(network.parameters()).device
    out = torch.empty(rows.shape[0], dtype=torch.float32)
    for start in range(0, rows.shape[0], chunk):
        sl = rows[start : start + chunk]
        state = features.state_emb[sl].to(device)
        action = features.action_emb[features.action_id[sl]].to(device)
        out[start : start + chunk] = logged_values(network, state, action).cpu()
    return out
