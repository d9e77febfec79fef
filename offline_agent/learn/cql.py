"""Conservative Q-learning over candidate actions: the math in one file, its config next to it.

For a logged transition (s, a, r, s', d) and the candidate actions C(s) of s:

    y    = r + gamma * (1 - d) * Qtarget(s', a*),  a* = argmax_{a' in C(s')} Q(s', a')   (double Q)
    TD   = sum_k (Q_k(s, a) - y)^2                                                       (both heads)
    CQL  = alpha * sum_k [logsumexp_{a' in C(s) + {a}} Q_k(s, a') - Q_k(s, a)]
    loss = TD + CQL

Q and Qtarget are `QNetwork`s with twin heads (min over heads as the value; the target net follows the
online one by Polyak averaging). The conservative term pushes down the values of the actions the log did
not take at s relative to the one it did, which keeps the greedy policy near the data where the data
says nothing. With `cal_ql` (Nakamoto et al. 2023, Cal-QL; on by default), the pushed-down values are
floored at the Monte-Carlo return of the logged episode from s, `max(Q(s, a'), G(s))`, so that
conservatism never drives values below what the behaviour policy is known to achieve. The policy is
`pi(a|s) = softmax_{a in C(s)} Q(s, a) / tau`.

Why the floor is on by default: without it, the values of actions the log rarely took at a state sink
far below the returns (to -2..-12 where returns lie in [0, 1]), while an action that ends the episode
at once (a destructive tool call, closing a ticket early) keeps its value pinned at its reward by a TD
target with nothing to bootstrap. In states the log never saw, that terminal action then looks best:
plain CQL's greedy policy on PipelineRepair chose `drop_table` or `skip_stage` with probability ~1.0
in every episode it failed. The floor keeps values on the scale of the returns (`learn/README.md` has
the measurements).

Why gamma is 0.95 by default, not 0.99: the simulators, like most agent tasks, pay one reward at the end
and offer harmless calls that change nothing (a lookup, a status check). Under gamma 0.99 stalling with such
a call costs 1% of the value per step, less than the learned values' own error, so a greedy policy that has
done everything but close a ticket looked up the account again until the customer left: CustomerSupport
0.53, against 0.72 at 0.95 (offline-quality benchmark, 3 seeds; PipelineRepair 0.97 -> 0.99, Logistics
0.61 -> 0.67 with it). 0.95 still sees ~20 steps ahead, more than an expert's episodes take.

Dimension letters: B batch, C candidate slots, D embedding width, K heads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from offline_agent.determinism import deterministic_torch
from offline_agent.errors import UserError
from offline_agent.learn.encoder_tuning import EncoderTuner, EncoderTuningSettings
from offline_agent.learn.features import Batch, Features, make_batch
from offline_agent.learn.grounding import PAIR_DIM
from offline_agent.learn.networks import FactorisedQNetwork, QNetwork, masked

#: Called after each gradient step with the step number and, on log steps, the metric record.
OnStep = Callable[[int, dict[str, float] | None], None]

#: Hidden width of each head when none is asked for. The factorised head was measured at 128 (the
#: offline-quality benchmark's width, where it matched the pairwise head); the pairwise head keeps its 256.
DEFAULT_HIDDEN = {"factorised": 128, "pairwise": 256}

#: Discount of the learners' TD targets (see the module docstring for why not 0.99).
DEFAULT_GAMMA = 0.95

#: Metric names written to RUN/metrics.parquet (a stable contract).
METRICS = ("loss/total", "loss/td", "loss/cql", "loss/mc", "q/data_mean", "q/ood_gap", "q/target_mean")


@dataclass
class CQLConfig(EncoderTuningSettings):
    """Settings of a CQL run; `__post_init__` rejects values that cannot work, naming the fix."""

    steps: int = field(default=2000, metadata={"help": "gradient steps"})
    batch_size: int = field(default=256, metadata={"help": "transitions per gradient step"})
    learning_rate: float = field(default=3e-4, metadata={"help": "Adam learning rate"})
    gamma: float = field(default=DEFAULT_GAMMA, metadata={"help": "discount factor, in [0, 1]"})
    alpha: float = field(default=1.0, metadata={"help": "weight of the conservative term, >= 0 (0 = plain DQN)"})
    tau: float = field(default=0.1, metadata={"help": "temperature of the policy softmax(Q / tau), > 0"})
    target_update_rate: float = field(default=0.005, metadata={"help": "Polyak rate of the target net, (0, 1]"})
    head: Literal["factorised", "pairwise"] = field(
        default="factorised",
        metadata={"help": "factorised: state and action towers and a small per-pair head (fast); "
                  "pairwise: an MLP over every (state, candidate) pair (the earlier design)"},
    )
    hidden: int | None = field(
        default=None,
        metadata={"help": "hidden width of each Q head: of each tower (factorised, default 128) or of the pair MLP "
                  "(pairwise, default 256)"},
    )
    rank: int = field(default=64, metadata={"help": "width R of the towers' outputs (factorised head)"})
    pair_hidden: int = field(default=32, metadata={"help": "width G of the per-pair layers (factorised head)"})
    n_heads: int = field(default=2, metadata={"help": "Q heads (2 = twin Q with min)"})
    cal_ql: bool = field(default=True, metadata={"help": "floor pushed-down values at the MC return"})
    mc_weight: float = field(
        default=0.0,
        metadata={"help": "weight of an auxiliary regression of Q(s, a) of the logged action on its Monte-Carlo "
                  "return; >= 0, 0 = off"},
    )
    n_sampled_candidates: int = field(
        default=16, metadata={"help": "candidates sampled for steps whose log has none"}
    )
    state_adapter: bool = field(default=False, metadata={"help": "train a residual adapter on phi(s)"})
    action_adapter: bool = field(default=False, metadata={"help": "train a residual adapter on psi(a)"})
    grounding: bool = field(
        default=True, metadata={"help": "score each candidate with its grounding in the episode (grounding.py)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of initialisation and batch sampling"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})
    log_every: int = field(default=10, metadata={"help": "record metrics every N steps"})

    def __post_init__(self) -> None:
        check_common(self)
        self.check_encoder_tuning()
        if self.alpha < 0:
            raise UserError(f"alpha must be >= 0, got {self.alpha}: use e.g. --alpha 1.0 (0 turns CQL into DQN)")
        if not self.mc_weight >= 0:
            raise UserError(f"mc_weight must be >= 0, got {self.mc_weight}: e.g. --mc-weight 1.0 (0 turns it off)")
        if not 0.0 < self.target_update_rate <= 1.0:
            raise UserError(f"target_update_rate must be in (0, 1], got {self.target_update_rate}; e.g. 0.005")
        if self.n_heads < 1:
            raise UserError(f"n_heads must be >= 1, got {self.n_heads}; 2 gives twin Q")
        if self.head not in ("factorised", "pairwise"):
            raise UserError(f"head must be factorised or pairwise, got {self.head!r}")
        if self.hidden is None:
            self.hidden = DEFAULT_HIDDEN[self.head]
        for name in ("hidden", "rank", "pair_hidden"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")


def check_common(config: Any) -> None:
    """Checks every learner's config shares (steps, batch size, learning rate, gamma, tau if it has one, device)."""
    if config.steps < 1:
        raise UserError(f"steps must be >= 1, got {config.steps}; e.g. --steps 2000")
    if config.batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {config.batch_size}; e.g. --batch-size 256")
    if not config.learning_rate > 0:
        raise UserError(f"learning_rate must be > 0, got {config.learning_rate}; e.g. 3e-4")
    if not 0.0 <= config.gamma <= 1.0:
        raise UserError(f"gamma must be in [0, 1], got {config.gamma}; e.g. 0.99")
    if hasattr(config, "tau") and not config.tau > 0:  # the value network (`value.py`) has no policy
        raise UserError(f"tau (policy temperature) must be > 0, got {config.tau}; e.g. 0.1, or 1.0 for BC")
    if not (config.device == "cpu" or config.device.startswith("cuda")):
        raise UserError(f"device must be cpu, cuda or cuda:N, got {config.device!r}")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {config.device}: no CUDA device is available here; use --device cpu")


# --- the math --------------------------------------------------------------------------------------


def double_q_action(q_next_online: torch.Tensor, next_mask: torch.Tensor) -> torch.Tensor:
    """a* = argmax over the valid candidates of s' by the online network: (B, C), (B, C) bool -> (B,) int64."""
    return masked(q_next_online, next_mask).argmax(1)


def td_target(reward: torch.Tensor, done: torch.Tensor, gamma: float, v_next: torch.Tensor) -> torch.Tensor:
    """`y = r + gamma * (1 - d) * v_next`, all (B,); rows with d = 1 ignore v_next (it may be -inf or nan)."""
    v_next = torch.where(done > 0, torch.zeros_like(v_next), v_next)
    return reward + gamma * (1.0 - done) * v_next


def double_q_target(
    reward: torch.Tensor,
    done: torch.Tensor,
    gamma: float,
    q_next_online: torch.Tensor,
    q_next_target: torch.Tensor,
    next_mask: torch.Tensor,
) -> torch.Tensor:
    """Double-Q TD target `y = r + gamma * (1 - d) * Qtarget(s', argmax_{a'} Qonline(s', a'))`.

    reward, done: (B,) float32; q_next_online, q_next_target: (B, C) float32 over the candidates of s';
    next_mask: (B, C) bool. Returns y (B,). `cql_loss` computes the same target but evaluates the target
    network at a* only, instead of at every candidate.
    """
    a_star = double_q_action(q_next_online, next_mask)[:, None]  # (B, 1)
    return td_target(reward, done, gamma, q_next_target.gather(1, a_star).squeeze(1))


def conservative_penalty(
    q_data: torch.Tensor, q_cand: torch.Tensor, cand_mask: torch.Tensor, floor: torch.Tensor | None = None
) -> torch.Tensor:
    """`logsumexp_{a' in C(s) + {a}} Q(s, a') - Q(s, a)` per row, before the weight alpha.

    q_data: (B,) Q of the logged action; q_cand: (B, C) Q of the other candidates; cand_mask: (B, C) bool
    (False for padding and for the logged action's own slot, so it is counted once). floor: (B,) or None;
    with Cal-QL the other candidates enter as `max(Q, floor)` (the Monte-Carlo return). Returns (B,) >= 0.
    A leading heads dimension (K, B) / (K, B, C) broadcasts against mask and floor.
    """
    if floor is not None:
        q_cand = torch.maximum(q_cand, floor[:, None])
    q_all = torch.cat([q_data[..., None], masked(q_cand, cand_mask)], -1)  # (..., B, 1 + C)
    return torch.logsumexp(q_all, -1) - q_data


def monte_carlo_loss(q_data: torch.Tensor, return_to_go: torch.Tensor) -> torch.Tensor:
    """`(Q(s, a) - G)^2` per head and row: q_data (K, B) of the logged action, return_to_go (B,) its
    discounted return in the log. Returns (K, B).

    TD carries a reward at an episode's last step back one step per target update, so on long episodes with
    few of them (real logs: tens of steps, a few hundred episodes) the first state's value has barely heard
    of the outcome when training stops. The logged return tells every step at once what became of its
    episode: a supervised signal under the Bellman one, as in the Monte-Carlo targets of Cal-QL's floor.
    """
    return (q_data - return_to_go[None, :]).pow(2)


def policy_probs(q: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """pi(a|s) = softmax(Q / tau) over valid candidates: q (B, C), mask (B, C) -> (B, C), 0 where masked."""
    return torch.softmax(masked(q, mask) / tau, dim=1)


@torch.no_grad()
def polyak_update(target: torch.nn.Module, online: torch.nn.Module, rate: float) -> None:
    """target <- (1 - rate) * target + rate * online, parameter by parameter (one fused call)."""
    torch._foreach_lerp_(list(target.parameters()), list(online.parameters()), rate)


@dataclass(frozen=True)
class CQLLoss:
    """The loss of one batch and its parts as named scalars: the metric record of a step."""

    total: torch.Tensor
    td: float
    cql: float
    mc: float
    q_data_mean: float
    q_ood_gap: float
    q_target_mean: float

    def metrics(self) -> dict[str, float]:
        return dict(
            zip(
                METRICS,
                (float(self.total.detach()), self.td, self.cql, self.mc, self.q_data_mean, self.q_ood_gap,
                 self.q_target_mean),
                strict=True,
            )
        )


def q_network(config: CQLConfig, dim: int, pair_dim: int) -> FactorisedQNetwork | QNetwork:
    """The Q network a CQL config asks for, with fresh weights."""
    adapters = {"state_adapter": config.state_adapter, "action_adapter": config.action_adapter}
    if config.head == "pairwise":
        return QNetwork(dim, config.hidden, config.n_heads, pair_dim=pair_dim, **adapters)
    return FactorisedQNetwork(
        dim, config.hidden, config.n_heads, config.rank, config.pair_hidden, pair_dim=pair_dim, **adapters
    )


def cql_loss(q_net: torch.nn.Module, target_net: torch.nn.Module, batch: Batch, config: CQLConfig) -> CQLLoss:
    """TD (both heads) + alpha * conservative penalty (both heads) on one batch."""
    # Candidates as ids into the action table: each distinct action's block is computed once.
    ids = torch.cat([batch.action_id[:, None], batch.cand_ids.clamp(min=0)], 1)  # (B, 1 + C)
    shared = {}
    if isinstance(q_net, FactorisedQNetwork) and batch.action_table.shape[0] <= ids.numel():
        # A small vocabulary: the action tower runs once over all of it, for s and (detached) for s'.
        shared["table_vectors"] = q_net.action_vectors(batch.action_table)  # (K, V, R + G)
    q = q_net.all_heads_by_id(batch.state, batch.action_table, ids, batch.pair, **shared)  # (K, B, 1 + C)
    q_data, q_cand = q[:, :, 0], q[:, :, 1:]  # (K, B), (K, B, C)
    with torch.no_grad():
        shared = {name: t.detach() for name, t in shared.items()}
        q_next = q_net.all_heads_by_id(
            batch.next_state, batch.action_table, batch.next_cand_ids, batch.next_pair, **shared
        )  # (K, B, C')
        a_star = double_q_action(q_next.min(0).values, batch.next_mask)  # (B,)
        rows = torch.arange(a_star.shape[0])
        next_id = batch.next_cand_ids[rows, a_star][:, None]  # (B, C') -> (B, 1)
        next_pair = None if batch.next_pair is None else batch.next_pair[rows, a_star][:, None]  # (B, 1, P)
        v_next = target_net.all_heads_by_id(batch.next_state, batch.action_table, next_id, next_pair)
        v_next = v_next.min(0).values[:, 0]  # (K, B, 1) -> (B,)
        y = td_target(batch.reward, batch.done, config.gamma, v_next)
    td = (q_data - y[None, :]).pow(2).mean(1).sum()  # (K, B) -> (K,) -> ()
    floor = batch.return_to_go if config.cal_ql else None
    penalty = conservative_penalty(q_data, q_cand, batch.cand_mask, floor)  # (K, B)
    cql = config.alpha * penalty.mean(1).sum()  # (K, B) -> ()
    total, mc = td + cql, torch.zeros(())
    if config.mc_weight > 0:
        mc = config.mc_weight * monte_carlo_loss(q_data, batch.return_to_go).mean(1).sum()  # (K, B) -> ()
        total = total + mc
    with torch.no_grad():
        q_min = q.min(0).values  # (K, B, 1 + C) -> (B, 1 + C)
        n_other = batch.cand_mask.sum()
        other_mean = (q_min[:, 1:] * batch.cand_mask).sum() / n_other.clamp(min=1)
        gap = float(q_min[:, 0].mean() - other_mean) if n_other > 0 else 0.0
    return CQLLoss(
        total=total,
        td=float(td.detach()),
        cql=float(cql.detach()),
        mc=float(mc.detach()),
        q_data_mean=float(q_min[:, 0].mean()),
        q_ood_gap=gap,
        q_target_mean=float(y.mean()),
    )


# --- training --------------------------------------------------------------------------------------


def train_rows(features: Features) -> torch.Tensor:
    """Rows of the train split; a dataset without any is a user error."""
    rows = features.rows("train")
    if rows.numel() == 0:
        raise UserError(
            f"the dataset has no steps in its train split ({features.n_steps} steps in all): "
            "ingest more episodes or re-split it"
        )
    return rows


def optimizer_for(net: torch.nn.Module, config: Any, tuner: EncoderTuner | None) -> torch.optim.Adam:
    """Adam over the network, and over the tuned encoder layers (at their own, smaller rate) if any."""
    groups: list[dict[str, Any]] = [{"params": list(net.parameters())}]
    if tuner is not None:
        groups.append({"params": list(tuner.parameters()), "lr": config.encoder_learning_rate})
    # One fused kernel for every parameter: the default loops over parameters in Python, which costs as
    # much as a small network's backward pass.
    return torch.optim.Adam(groups, lr=config.learning_rate, fused=True)


@deterministic_torch()  # a seed alone is not reproducible on several CPU threads
def train_cql(
    features: Features, config: CQLConfig, on_step: OnStep | None = None, tuner: EncoderTuner | None = None
) -> tuple[torch.nn.Module, list[dict[str, float]]]:
    """Train a twin-Q network (`config.head`) on the train split: the online network and one metric row per
    log step.

    `on_step(step, record)` is called after every step (record is None between log steps), for progress bars.
    With a `tuner` (`offline_agent.learn.encoder_tuning`), the states' vectors come from the encoder's
    fine-tuned top layers, which the same loss trains.

    Deterministic for a given seed and device: batches come from a seeded generator.
    """
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    return_to_go = features.returns_to_go(config.gamma)
    rows = train_rows(features)
    grounding = features.grounding_table() if config.grounding else None
    q_net = q_network(config, features.dim, PAIR_DIM if config.grounding else 0).to(config.device)
    target_net = copy.deepcopy(q_net).requires_grad_(False)
    optimizer = optimizer_for(q_net, config, tuner)
    history: list[dict[str, float]] = []
    for step in range(1, config.steps + 1):
        pick = rows[torch.randint(rows.shape[0], (config.batch_size,), generator=generator)]
        batch = make_batch(features, pick, generator, config.n_sampled_candidates, return_to_go, grounding)
        if tuner is not None:
            batch = tuner.batch(batch, pick, features, step)
        loss = cql_loss(q_net, target_net, batch.to(config.device), config)
        optimizer.zero_grad(set_to_none=True)
        loss.total.backward()
        optimizer.step()
        polyak_update(target_net, q_net, config.target_update_rate)
        record = None
        if step % config.log_every == 0 or step == config.steps:
            record = {"step": step, **loss.metrics()}
            history.append(record)
        if on_step is not None:
            on_step(step, record)
    return q_net.eval(), history
