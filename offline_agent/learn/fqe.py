"""Fitted Q evaluation: the value of a policy estimated from held-out logs alone.

FQE (Le et al. 2019) fits Q^pi of a fixed target policy pi by regression on
logged transitions, with targets that follow pi at the next state:

    y = r + gamma * (1 - d) * sum_{a' in C(s')} pi(a'|s') Qtarget(s', a')

and estimates the policy's value as the mean over the split's episodes of
`V(s0) = sum_a pi(a|s0) Q(s0, a)` at their first state. pi is the learned
policy over each step's candidates (greedy by default, what `evaluate` plays;
or softmax(Q / tau)); the candidates are the logged ones plus the logged
action, or the whole vocabulary where the log has none. Run on the test split,
it tells what a policy is worth before it meets a simulator or a user; the
quality benchmark reports it next to the simulator's answer. With `resample`,
the fit sees a bootstrap resample of the split's episodes instead of the split
(still valued at every first state of the split): fits on several resamples
show how much the estimate owes to which episodes the split happened to hold.

Dimension letters: B batch, C candidate slots, D embedding width, n rows of the split.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from offline_agent.determinism import deterministic_torch
from offline_agent.errors import UserError
from offline_agent.learn.cql import OnStep, check_common, policy_probs, polyak_update
from offline_agent.learn.features import SPLITS, Features, step_candidates
from offline_agent.learn.networks import QNetwork

METRICS = ("loss/fqe", "fqe/value")


@dataclass
class FQEConfig:
    steps: int = field(default=2000, metadata={"help": "gradient steps"})
    batch_size: int = field(default=256, metadata={"help": "transitions per gradient step"})
    learning_rate: float = field(default=3e-4, metadata={"help": "Adam learning rate"})
    gamma: float = field(default=0.99, metadata={"help": "discount factor, in [0, 1]"})
    tau: float = field(default=0.1, metadata={"help": "temperature of the evaluated softmax policy (greedy=False)"})
    greedy: bool = field(default=True, metadata={"help": "evaluate the greedy policy (what `evaluate` plays)"})
    target_update_rate: float = field(
        default=0.05, metadata={"help": "Polyak rate of the target net (fast: the evaluated policy is fixed)"}
    )
    hidden: int = field(default=256, metadata={"help": "hidden width of the FQE Q network"})
    split: str = field(default="test", metadata={"help": "split of held-out episodes to evaluate on"})
    resample: bool = field(
        default=False,
        metadata={"help": "fit on a bootstrap resample of the split's episodes (drawn with the seed), not the split"},
    )
    seed: int = field(default=0, metadata={"help": "seed of initialisation and batch sampling"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})
    log_every: int = field(default=50, metadata={"help": "record metrics every N steps"})

    def __post_init__(self) -> None:
        check_common(self)
        if self.split not in SPLITS:
            raise UserError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")


@dataclass(frozen=True)
class FQEResult:
    value: float  # mean estimated V^pi(s0) over the split's episodes
    episode_values: torch.Tensor  # (E_split,) V^pi(s0) per episode
    behaviour_value: float  # mean discounted return of the logged episodes (what the logs' policy got)
    episodes: int
    history: list[dict[str, float]]


def fqe_target(
    reward: torch.Tensor, done: torch.Tensor, gamma: float, q_next: torch.Tensor, pi_next: torch.Tensor
) -> torch.Tensor:
    """`y = r + gamma * (1 - d) * sum_a' pi(a'|s') Q(s', a')`.

    reward, done: (B,); q_next: (B, C) target-network Q at s' (any value in masked slots);
    pi_next: (B, C) the evaluated policy's probabilities, 0 in masked slots. Returns (B,).
    """
    v_next = (pi_next * torch.nan_to_num(q_next, neginf=0.0)).sum(1)  # (B, C) -> (B,)
    return reward + gamma * (1.0 - done) * v_next


@torch.no_grad()
def candidate_q(
    network: torch.nn.Module, features: Features, rows: torch.Tensor, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q of `network` at the steps `rows` (n,) over their deterministic candidate sets (`step_candidates`):
    candidate ids (n, C), mask (n, C), Q (n, C) (-inf in masked slots)."""
    ids, mask = step_candidates(features, rows)
    return ids, mask, q_over(network, features, rows, ids, mask, chunk)


@torch.no_grad()
def q_over(
    network: torch.nn.Module, features: Features, rows: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
    chunk: int = 1024,
) -> torch.Tensor:
    """(n, C) Q of `network` at the steps `rows` (n,) over the candidate ids (n, C) where `mask`, else -inf."""
    device = next(network.parameters()).device
    q = torch.empty(ids.shape, dtype=torch.float32)
    for start in range(0, rows.shape[0], chunk):
        sl = slice(start, start + chunk)
        state = features.state_emb[rows[sl]].to(device)
        cand = features.action_emb[ids[sl].clamp(min=0)].to(device)  # (b, C) -> (b, C, D)
        pair = None
        if getattr(network, "pair_dim", 0):
            table = features.grounding_table()
            pair = table.lookup(rows[sl], torch.where(mask[sl], ids[sl], -1), remember=False).to(device)
        q[sl] = network.q_values(state, cand, mask[sl].to(device), pair).cpu()  # (b, C)
    return q


def policy_distribution(
    network: torch.nn.Module,
    features: Features,
    rows: torch.Tensor,
    tau: float,
    greedy: bool,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The evaluated policy at the steps `rows` (n,): candidate ids (n, C), mask (n, C), probabilities (n, C)."""
    ids, mask, q = candidate_q(network, features, rows, chunk)
    if greedy:
        return ids, mask, torch.nn.functional.one_hot(q.argmax(1), ids.shape[1]).float()
    return ids, mask, policy_probs(q, mask, tau)


@deterministic_torch()  # a seed alone is not reproducible on several CPU threads
def fitted_q_evaluation(
    features: Features, network: torch.nn.Module, config: FQEConfig, on_step: OnStep | None = None
) -> FQEResult:
    """Estimate the value of the policy of `network` (any `q_values` module) on `config.split`."""
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    rows = features.rows(config.split)
    firsts = features.first_rows(config.split)
    if rows.numel() == 0:
        raise UserError(
            f"the dataset has no episodes in its {config.split} split: FQE needs held-out episodes "
            "(ingest more logs, or pass another split)"
        )
    if config.resample:
        rows = resample_episodes(features.episode_index, rows, generator)
    # The policy is fixed: its distribution at every next state and every first state is computed once.
    nxt = features.next_index[rows]
    done = (features.terminated[rows] | (nxt < 0)).float()
    nxt = nxt.clamp(min=0)
    next_ids, next_mask, next_pi = policy_distribution(network, features, nxt, config.tau, config.greedy)
    first_ids, first_mask, first_pi = policy_distribution(network, features, firsts, config.tau, config.greedy)

    q_net = QNetwork(features.dim, config.hidden, n_heads=1).to(config.device)
    target_net = copy.deepcopy(q_net).requires_grad_(False)
    optimizer = torch.optim.Adam(q_net.parameters(), lr=config.learning_rate)
    emb, dev = features.action_emb, config.device
    history: list[dict[str, float]] = []
    for step in range(1, config.steps + 1):
        pick = torch.randint(rows.shape[0], (config.batch_size,), generator=generator)  # (B,) into rows
        r = rows[pick]
        with torch.no_grad():
            q_next = target_net.q_values(
                features.state_emb[nxt[pick]].to(dev), emb[next_ids[pick].clamp(min=0)].to(dev), next_mask[pick].to(dev)
            )  # (B, C)
            y = fqe_target(features.reward[r].to(dev), done[pick].to(dev), config.gamma, q_next, next_pi[pick].to(dev))
        q = q_net.all_heads(features.state_emb[r].to(dev), emb[features.action_id[r]][:, None, :].to(dev))[0, :, 0]
        loss = (q - y).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        polyak_update(target_net, q_net, config.target_update_rate)
        record = None
        if step % config.log_every == 0 or step == config.steps:
            value = _first_state_values(q_net, features, firsts, first_ids, first_mask, first_pi).mean()
            record = {"step": step, "loss/fqe": loss.item(), "fqe/value": float(value)}
            history.append(record)
        if on_step is not None:
            on_step(step, record)
    values = _first_state_values(q_net, features, firsts, first_ids, first_mask, first_pi)
    behaviour = float(features.returns_to_go(config.gamma)[firsts].mean())
    return FQEResult(float(values.mean()), values, behaviour, int(firsts.numel()), history)


def resample_episodes(episode_index: torch.Tensor, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A bootstrap resample of the episodes that `rows` (n,) belong to: as many episodes as there are, drawn
    with replacement, each contributing all its rows once per draw. Returns the rows, repeated (m,)."""
    episodes, of_row = torch.unique(episode_index[rows], return_inverse=True)  # (E,), (n,) into episodes
    draws = torch.randint(episodes.numel(), (episodes.numel(),), generator=generator)  # (E,)
    times = torch.bincount(draws, minlength=episodes.numel())  # (E,) how often each episode was drawn
    return rows.repeat_interleave(times[of_row])


@torch.no_grad()
def _first_state_values(
    q_net: QNetwork,
    features: Features,
    firsts: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    pi: torch.Tensor,
) -> torch.Tensor:
    """(E,) V(s0) = sum_a pi(a|s0) Q(s0, a) at each episode's first state."""
    device = next(q_net.parameters()).device
    q = q_net.q_values(
        features.state_emb[firsts].to(device), features.action_emb[ids.clamp(min=0)].to(device), mask.to(device)
    ).cpu()
    return (pi * torch.nan_to_num(q, neginf=0.0)).sum(1)
