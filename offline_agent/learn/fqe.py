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

With `grounding` (off by default) FQE's Q also reads what the policies read beside the vectors: each
pair's grounding in its episode (`offline_agent.learn.grounding`: whether a call's values come from the
conversation, whether it was made before). Without it, FQE values a call that types the code on the
screen and one that types a made-up code alike, so on a task decided by that it cannot tell a policy that
does the one from a policy that does the other (`tests/test_grounding.py`). On the simulators it did not
help: its interval covered the simulated value in 5 of 9 settings against 7 without, and its value
missed by 0.170 on average against 0.129 (`benchmarks/results/fqe_coverage.md`).

What the logs cannot tell is what follows an action they never show in states
like the one at hand: there FQE's Q extrapolates, and its estimate is a guess
(the bootstrap above measures the guess's variance, not its error). With
`unlogged="low"` or `"high"` the fit assumes the worst or the best instead
(partial identification, as Manski bounds): wherever the greedy policy's
choice at s' (or at a first state) is not the logged action of one of the k
most similar states among the transitions it fits, its value is replaced by
the lowest or the highest discounted return the logs hold,

    y = r + gamma * (1 - d) * (logged nearby ? Qtarget(s', pi(s')) : bound)

so the two fits bracket what the policy could be worth whatever it does where
the logs are silent. The wider the bracket, the more of the estimate is
extrapolation. `fit_on="all"` fits every logged transition (still valued at
the split's first states): what `evaluate` does for the bounds, which on the
test split alone spanned nearly the whole range of returns.

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
from offline_agent.learn.grounding import PAIR_DIM
from offline_agent.learn.networks import FactorisedQNetwork, QNetwork, masked

METRICS = ("loss/fqe", "fqe/value")
#: What a fit assumes where the logs do not show the policy's choice: its own Q, or a bound.
UNLOGGED = ("extrapolate", "low", "high")


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
    unlogged: str = field(
        default="extrapolate",
        metadata={"help": "where the logs do not show the greedy policy's choice near a state: extrapolate (the "
                  "estimate), or assume the logs' low or high return there (the bounds)"},
    )
    support_k: int = field(default=10, metadata={"help": "similar states a choice is looked for in (unlogged)"})
    grounding: bool = field(
        default=False,
        metadata={"help": "score each (state, action) pair with its grounding in the episode (grounding.py), as the "
                  "policies do"},
    )
    fit_on: str = field(
        default="split",
        metadata={"help": "the transitions FQE regresses on (and looks for the policy's choices in): the split's "
                  "(split) or every logged one (all); its value is taken at the split's first states either way"},
    )
    seed: int = field(default=0, metadata={"help": "seed of initialisation and batch sampling"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})
    log_every: int = field(default=50, metadata={"help": "record metrics every N steps"})

    def __post_init__(self) -> None:
        check_common(self)
        if self.split not in SPLITS:
            raise UserError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.unlogged not in UNLOGGED:
            raise UserError(f"unlogged must be one of {', '.join(UNLOGGED)}, got {self.unlogged!r}")
        if self.unlogged != "extrapolate" and not self.greedy:
            raise UserError("FQE bounds (unlogged low or high) are defined for the greedy policy: pass greedy=True")
        if self.fit_on not in ("split", "all"):
            raise UserError(f"fit_on must be split or all, got {self.fit_on!r}")
        if self.support_k < 1:
            raise UserError(f"support_k must be >= 1, got {self.support_k}")


@dataclass(frozen=True)
class FQEResult:
    value: float  # mean estimated V^pi(s0) over the split's episodes
    episode_values: torch.Tensor  # (E_split,) V^pi(s0) per episode
    behaviour_value: float  # mean discounted return of the logged episodes (what the logs' policy got)
    episodes: int
    history: list[dict[str, float]]


def fqe_target(
    reward: torch.Tensor,
    done: torch.Tensor,
    gamma: float,
    q_next: torch.Tensor,
    pi_next: torch.Tensor,
    unlogged: torch.Tensor | None = None,
    bound: float = 0.0,
) -> torch.Tensor:
    """`y = r + gamma * (1 - d) * sum_a' pi(a'|s') Q(s', a')`, with `bound` in place of that sum where
    `unlogged` (B,) bool is True (the policy's choice at s' is not in the logs near s').

    reward, done: (B,); q_next: (B, C) target-network Q at s' (any value in masked slots);
    pi_next: (B, C) the evaluated policy's probabilities, 0 in masked slots. Returns (B,).
    """
    v_next = (pi_next * torch.nan_to_num(q_next, neginf=0.0)).sum(1)  # (B, C) -> (B,)
    if unlogged is not None:
        v_next = torch.where(unlogged, torch.full_like(v_next, bound), v_next)
    return reward + gamma * (1.0 - done) * v_next


def only_chosen(
    ids: torch.Tensor, mask: torch.Tensor, pi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy policy's distribution cut to its choice: the slot of `pi` (n, C) with the most mass, as ids,
    mask and probabilities of shape (n, 1); `fqe_target` gives the same value on either."""
    slot = pi.argmax(1, keepdim=True)  # (n, 1)
    return ids.gather(1, slot), mask.gather(1, slot), pi.gather(1, slot)


def policy_choices(
    network: torch.nn.Module, features: Features, rows: torch.Tensor, tau: float, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The evaluated policy at the steps `rows` as FQE reads it: `policy_distribution`, and for a greedy
    policy only its choice (`only_chosen`): the target network then scores that pair alone instead of every
    candidate (its pass over all of them took half of FQE's time)."""
    ids, mask, pi = policy_distribution(network, features, rows, tau, greedy)
    return only_chosen(ids, mask, pi) if greedy else (ids, mask, pi)


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
    # A factorised head's action tower runs once over the vocabulary, not once per slot: on logs without
    # candidates every step's slots are the whole vocabulary.
    table_vectors = None
    if isinstance(network, FactorisedQNetwork):
        table_vectors = network.action_vectors(features.action_emb.to(device))  # (K, V, R + G)
    for start in range(0, rows.shape[0], chunk):
        sl = slice(start, start + chunk)
        state = features.state_emb[rows[sl]].to(device)
        pair = None
        if getattr(network, "pair_dim", 0):
            table = features.grounding_table()
            pair = table.lookup(rows[sl], torch.where(mask[sl], ids[sl], -1)).to(device)
        if table_vectors is not None:
            heads = network.all_heads_by_id(state, features.action_emb, ids[sl].clamp(min=0).to(device), pair,
                                            table_vectors)  # (K, b, C)
            q[sl] = masked(heads.min(0).values, mask[sl].to(device)).cpu()
        else:
            cand = features.action_emb[ids[sl].clamp(min=0)].to(device)  # (b, C) -> (b, C, D)
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
    features: Features,
    network: torch.nn.Module,
    config: FQEConfig,
    on_step: OnStep | None = None,
    choices: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> FQEResult:
    """Estimate the value of the policy of `network` (any `q_values` module) on `config.split`.

    `choices`: `policy_choices` at every row of `features`, for a caller that fits several times (refits,
    bounds) with one policy and config.tau / config.greedy: each fit then reads them instead of scoring its
    states again, which on logs without candidates (the whole vocabulary at every step) took a third of
    `evaluate --dataset`."""
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    firsts = features.first_rows(config.split)
    if firsts.numel() == 0:
        raise UserError(
            f"the dataset has no episodes in its {config.split} split: FQE needs held-out episodes "
            "(ingest more logs, or pass another split)"
        )
    fit_rows = features.rows(config.split if config.fit_on == "split" else None)
    rows = resample_episodes(features.episode_index, fit_rows, generator) if config.resample else fit_rows
    # The policy is fixed: its distribution at every next state and every first state is computed once.
    if choices is not None and choices[0].shape[0] != features.n_steps:
        raise ValueError(f"choices hold {choices[0].shape[0]} rows, the features {features.n_steps}")

    def policy_at(at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if choices is not None:
            ids, mask, pi = choices
            return ids[at], mask[at], pi[at]
        return policy_choices(network, features, at, config.tau, config.greedy)

    nxt = features.next_index[rows]
    done = (features.terminated[rows] | (nxt < 0)).float()
    nxt = nxt.clamp(min=0)
    next_ids, next_mask, next_pi = policy_at(nxt)
    first_ids, first_mask, first_pi = policy_at(firsts)
    next_unlogged = first_unlogged = None
    bound = 0.0
    if config.unlogged != "extrapolate":
        next_unlogged = unlogged_choices(features, nxt, next_ids, next_pi, fit_rows, config.support_k)
        first_unlogged = unlogged_choices(features, firsts, first_ids, first_pi, fit_rows, config.support_k)
        lowest, highest = features.return_range(config.gamma)
        bound = lowest if config.unlogged == "low" else highest

    # With grounding, FQE's Q reads what the policy's does: a policy that chooses by whether a call's values
    # come from the conversation, or by what was already done, is valued by a Q that can see it too.
    table = features.grounding_table() if config.grounding else None
    fit_pair = next_pair = first_pair = None
    if table is not None:
        fit_pair = table.lookup(rows, features.action_id[rows][:, None])  # (n, 1, P)
        next_pair = table.lookup(nxt, torch.where(next_mask, next_ids, -1))  # (n, C, P)
        first_pair = table.lookup(firsts, torch.where(first_mask, first_ids, -1))  # (E, C, P)
    q_net = QNetwork(features.dim, config.hidden, n_heads=1, pair_dim=PAIR_DIM if table else 0).to(config.device)
    target_net = copy.deepcopy(q_net).requires_grad_(False)
    optimizer = torch.optim.Adam(q_net.parameters(), lr=config.learning_rate)
    emb, dev = features.action_emb, config.device
    history: list[dict[str, float]] = []
    for step in range(1, config.steps + 1):
        pick = torch.randint(rows.shape[0], (config.batch_size,), generator=generator)  # (B,) into rows
        r = rows[pick]
        with torch.no_grad():
            next_state, next_cand = features.state_emb[nxt[pick]].to(dev), emb[next_ids[pick].clamp(min=0)].to(dev)
            q_next = target_net.q_values(
                next_state, next_cand, next_mask[pick].to(dev), None if next_pair is None else next_pair[pick].to(dev)
            )  # (B, C)
            y = fqe_target(
                features.reward[r].to(dev), done[pick].to(dev), config.gamma, q_next, next_pi[pick].to(dev),
                None if next_unlogged is None else next_unlogged[pick].to(dev), bound,
            )
        pair = None if fit_pair is None else fit_pair[pick].to(dev)  # (B, 1, P)
        action = emb[features.action_id[r]][:, None, :].to(dev)  # (B, 1, D)
        q = q_net.all_heads(features.state_emb[r].to(dev), action, pair)[0, :, 0]
        loss = (q - y).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        polyak_update(target_net, q_net, config.target_update_rate)
        record = None
        if step % config.log_every == 0 or step == config.steps:
            value = _first_state_values(q_net, features, firsts, first_ids, first_mask, first_pi, first_pair)
            value = _bounded(value, first_unlogged, bound).mean()
            record = {"step": step, "loss/fqe": loss.item(), "fqe/value": float(value)}
            history.append(record)
        if on_step is not None:
            on_step(step, record)
    values = _first_state_values(q_net, features, firsts, first_ids, first_mask, first_pi, first_pair)
    values = _bounded(values, first_unlogged, bound)
    behaviour = float(features.returns_to_go(config.gamma)[firsts].mean())
    return FQEResult(float(values.mean()), values, behaviour, int(firsts.numel()), history)


def unlogged_choices(
    features: Features, rows: torch.Tensor, ids: torch.Tensor, pi: torch.Tensor, logged_rows: torch.Tensor, k: int
) -> torch.Tensor:
    """(n,) bool: at the steps `rows` (n,), is the greedy policy's choice (the slot of `pi` (n, C) that holds its
    mass, an id of `ids` (n, C)) missing from the logged actions of the `k` states of `logged_rows` most similar
    to each?"""
    from offline_agent.learn.confidence import logged_nearby

    chosen = ids.gather(1, pi.argmax(1, keepdim=True))[:, 0]  # (n,)
    logged = features.state_emb[logged_rows], features.action_id[logged_rows]
    return ~logged_nearby(features.state_emb[rows], chosen, *logged, k)


def _bounded(values: torch.Tensor, unlogged: torch.Tensor | None, bound: float) -> torch.Tensor:
    """`values` (E,) with `bound` where `unlogged` (E,) holds (no change without it)."""
    return values if unlogged is None else torch.where(unlogged, torch.full_like(values, bound), values)


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
    pair: torch.Tensor | None = None,
) -> torch.Tensor:
    """(E,) V(s0) = sum_a pi(a|s0) Q(s0, a) at each episode's first state (`pair` (E, C, P): their grounding)."""
    device = next(q_net.parameters()).device
    q = q_net.q_values(
        features.state_emb[firsts].to(device), features.action_emb[ids.clamp(min=0)].to(device), mask.to(device),
        None if pair is None else pair.to(device),
    ).cpu()
    return (pi * torch.nan_to_num(q, neginf=0.0)).sum(1)
