"""d3rlpy's DiscreteCQL on our features: the reference implementation our CQL is compared with.

The bridge exports the train split to a d3rlpy `MDPDataset` (observations =
phi(s), actions = ids into the dataset's action vocabulary, rewards,
terminals = `terminated`, timeouts = the last step of an episode that did not
terminate), trains `DiscreteCQL` with its discrete action set = the whole
vocabulary, and copies the trained Q function into a `VocabQNetwork`, a plain
torch module saved as safetensors like every other policy, so loading it
never needs d3rlpy or pickle.

Differences from our CQL that the comparison is about: d3rlpy's logsumexp runs
over the whole vocabulary rather than the candidates of the step, and at
decision time its values are restricted to the step's candidates, an unknown
candidate scored as its nearest vocabulary action by embedding (see
`VocabQNetwork`). Its optimiser settings are matched to ours (Adam, same
learning rate and batch size, a hard target update every 1/target_update_rate
steps, the horizon of our Polyak rate) instead of d3rlpy's Atari defaults.

d3rlpy never writes to the working directory: it gets a logger adapter that
keeps its metrics in memory, which become the run's metrics.parquet.

Dimension letters: N steps, D embedding width, V vocabulary size.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from offline_agent.errors import UserError
from offline_agent.learn.cql import DEFAULT_GAMMA, OnStep, check_common, train_rows
from offline_agent.learn.features import Features
from offline_agent.learn.networks import VocabQNetwork

#: d3rlpy's metric names -> ours (the same contract as offline_agent.learn.cql.METRICS).
METRIC_NAMES = {"loss": "loss/total", "td_loss": "loss/td", "conservative_loss": "loss/cql_penalty"}


@dataclass
class D3rlpyCQLConfig:
    """Settings of a d3rlpy DiscreteCQL run, matched to `CQLConfig` where the two share a meaning."""

    steps: int = field(default=2000, metadata={"help": "gradient steps"})
    batch_size: int = field(default=256, metadata={"help": "transitions per gradient step"})
    learning_rate: float = field(default=3e-4, metadata={"help": "Adam learning rate"})
    gamma: float = field(default=DEFAULT_GAMMA, metadata={"help": "discount factor, in [0, 1]"})
    alpha: float = field(default=1.0, metadata={"help": "weight of the conservative term, >= 0"})
    tau: float = field(default=0.1, metadata={"help": "temperature of the policy softmax(Q / tau), > 0"})
    target_update_interval: int = field(default=200, metadata={"help": "steps between hard target copies"})
    hidden: int = field(default=256, metadata={"help": "width of the two hidden layers"})
    seed: int = field(default=0, metadata={"help": "seed of d3rlpy (numpy, torch, random)"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})
    log_every: int = field(default=10, metadata={"help": "record metrics every N steps"})

    def __post_init__(self) -> None:
        check_common(self)
        if self.alpha < 0:
            raise UserError(f"alpha must be >= 0, got {self.alpha}: use e.g. --alpha 1.0")
        if self.target_update_interval < 1:
            raise UserError(f"target_update_interval must be >= 1, got {self.target_update_interval}")


def import_d3rlpy() -> Any:
    """d3rlpy, imported quietly: it imports the unmaintained `gym` package, which prints a banner."""
    devnull = open(os.devnull, "w")  # noqa: SIM115
    stdout, stderr = sys.stdout, sys.stderr
    try:
        sys.stdout = sys.stderr = devnull
        import d3rlpy
    except ImportError:
        raise UserError("--algo d3rlpy-cql needs d3rlpy: `pip install d3rlpy==2.8.1`") from None
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        devnull.close()
    # d3rlpy logs every step's metrics at INFO through structlog; keep only its warnings.
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    return d3rlpy


def to_mdp_dataset(features: Features, rows: torch.Tensor) -> Any:
    """A d3rlpy `MDPDataset` of the steps `rows` (n,) (whole episodes, contiguous, in order)."""
    d3rlpy = import_d3rlpy()
    rows_np = rows.numpy()
    episode = features.episode_index[rows].numpy()
    last = np.ones(rows_np.shape[0], dtype=bool)
    last[:-1] = episode[1:] != episode[:-1]
    terminated = features.terminated[rows].numpy() & last
    return d3rlpy.dataset.MDPDataset(
        observations=features.state_emb[rows].numpy(),  # (n, D)
        actions=features.action_id[rows].numpy().reshape(-1, 1),  # (n, 1) vocab ids
        rewards=features.reward[rows].numpy().reshape(-1, 1),
        terminals=terminated.astype(np.float32),
        timeouts=(last & ~terminated).astype(np.float32),
        action_space=d3rlpy.ActionSpace.DISCRETE,
        action_size=features.n_actions,
    )


def make_algo(config: D3rlpyCQLConfig) -> Any:
    d3rlpy = import_d3rlpy()
    return d3rlpy.algos.DiscreteCQLConfig(
        learning_rate=config.learning_rate,
        batch_size=config.batch_size,
        gamma=config.gamma,
        alpha=config.alpha,
        target_update_interval=config.target_update_interval,
        encoder_factory=d3rlpy.models.VectorEncoderFactory(hidden_units=[config.hidden, config.hidden]),
    ).create(device="cuda:0" if config.device == "cuda" else "cpu:0" if config.device == "cpu" else config.device)


def _metrics_adapter_factory(history: list[dict[str, float]]) -> Any:
    """A d3rlpy logger adapter factory that appends each committed metric record to `history`, and writes
    no file (d3rlpy's default writes ./d3rlpy_logs)."""
    d3rlpy = import_d3rlpy()
    from d3rlpy.logging import LoggerAdapter, LoggerAdapterFactory

    class Adapter(LoggerAdapter):
        def __init__(self) -> None:
            self.record: dict[str, float] = {}

        def write_params(self, params: dict[str, Any]) -> None:
            pass

        def before_write_metric(self, epoch: int, step: int) -> None:
            self.record = {"step": step}

        def write_metric(self, epoch: int, step: int, name: str, value: float) -> None:
            if name in METRIC_NAMES:
                self.record[METRIC_NAMES[name]] = float(value)

        def after_write_metric(self, epoch: int, step: int) -> None:
            history.append(self.record)

        def save_model(self, epoch: int, algo: Any) -> None:
            pass

        def close(self) -> None:
            pass

        def watch_model(self, epoch: int, step: int) -> None:
            pass

    class Factory(LoggerAdapterFactory):
        def create(self, algo: Any, experiment_name: str, n_steps_per_epoch: int) -> Adapter:
            return Adapter()

    del d3rlpy
    return Factory()


def train_d3rlpy_cql(
    features: Features, config: D3rlpyCQLConfig, on_step: OnStep | None = None
) -> tuple[VocabQNetwork, list[dict[str, float]]]:
    """Train d3rlpy's DiscreteCQL on the train split; return its Q function as a `VocabQNetwork` and metrics."""
    d3rlpy = import_d3rlpy()
    d3rlpy.seed(config.seed)
    dataset = to_mdp_dataset(features, train_rows(features))
    algo = make_algo(config)
    history: list[dict[str, float]] = []

    def callback(algo: Any, epoch: int, total_step: int) -> None:
        if on_step is not None:
            logged = history[-1] if history and history[-1]["step"] == total_step else None
            on_step(total_step, logged)

    algo.fit(
        dataset,
        n_steps=config.steps,
        n_steps_per_epoch=config.steps,
        # at least one commit: d3rlpy's fitter fails on a run shorter than its logging interval
        logging_steps=min(config.log_every, config.steps),
        logging_strategy=d3rlpy.LoggingStrategy.STEPS,
        logger_adapter=_metrics_adapter_factory(history),
        show_progress=False,
        save_interval=config.steps + 1,
        callback=callback,
    )
    for record in history:
        if "loss/cql_penalty" in record:
            record["loss/cql"] = config.alpha * record.pop("loss/cql_penalty")
    return export_network(algo, features, config.hidden), history


def export_network(algo: Any, features: Features, hidden: int) -> VocabQNetwork:
    """Copy a trained DiscreteCQL's Q function (n_critics = 1) into a `VocabQNetwork` with the vocabulary's
    embeddings, checking that every weight found its place."""
    q_funcs = algo.impl.modules.q_funcs
    if len(q_funcs) != 1:
        raise ValueError(f"expected one d3rlpy critic, got {len(q_funcs)}")
    renamed = {}
    for name, value in q_funcs[0].state_dict().items():
        # d3rlpy: _encoder._layers.{0,2}.{weight,bias}, _fc.{weight,bias}
        renamed[name.replace("_encoder._layers.", "encoder.").replace("_fc.", "fc.")] = value.detach().cpu()
    net = VocabQNetwork(features.dim, features.n_actions, hidden)
    renamed["vocab_emb"] = features.action_emb.clone()
    net.load_state_dict(renamed, strict=True)
    return net.eval()
