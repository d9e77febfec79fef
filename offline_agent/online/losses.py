"""The math of PPO over candidate actions, as pure functions: GAE, the clipped surrogate loss, a policy's
expected value over its candidates, and potential-based shaping on an environment's sub-goals.

Sub-goal shaping (`subgoal_shaping` W, off by default): each step's reward also gets
`W * (gamma * Phi(s') - Phi(s))` with `Phi = sub_goals_done / sub_goals_total` from the environment's info
(0 after an episode's last step). It telescopes, so the best policy is unchanged, but a step that completes a
sub-goal (a Logistics delivery, a CustomerSupport problem explained) is credited at once, and the step that
ends an episode short of its goal gives that credit back. Measured with the runs above (same CQL checkpoints
and settings, W = 1, one seed, greedy success on 50 episodes from seed 1000):
- Logistics at tau 0.5: 0/50 without shaping, **18/50** with it (offline 15/50). Sampled success still stayed
  low (0-8%, 18% once), but deliveries now carried signal. The KL stayed at 0.01-0.14 a step instead of
  drifting to ~1;
- Logistics at the checkpoint's tau 0.1: 16/50 without, 21/50 with (a difference within one run's noise);
- CustomerSupport at tau 0.5: 40/50 without, 41/50 with;
- PipelineRepair at tau 0.5: 48/50 without, 50/50 with (offline 44/50);
- Logistics at tau 0.1, continued to 48 iterations (24,576 env steps): back to 16/50; its sampled success
  stayed at 0.2-0.4 throughout, so PPO at this budget does not move Logistics at either temperature;
- CustomerSupport at tau 0.5 with shaping, continued to 48 iterations: 34/50, below its 41/50 after 24;
- Logistics at tau 0.3 with shaping: **26/50** (0.52 [0.39, 0.65]), the best Logistics run so far; its sampled
  success rose from 0.07 to 0.2-0.5 an iteration and the KL stayed at 0.01-0.13 (not run without shaping).
Shaping stays off by default: it needs an environment that reports sub-goals, and only the tau 0.5 Logistics
run depended on it.

Dimension letters: T rollout steps per environment, N environments, B rows (T * N or a minibatch),
C candidate slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    next_value: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over a rollout of N environments.

    rewards, values: (T, N) float32; dones: (T, N) float32, 1 where step t ended its episode (the
    observation after it belongs to a new episode); next_value: (N,) V of the observation after step T-1.
    `delta_t = r_t + gamma * V_{t+1} * (1 - d_t) - V_t`, `A_t = delta_t + gamma * lam * (1 - d_t) * A_{t+1}`.
    Returns (advantages, returns = advantages + values), both (T, N).
    """
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        next_values = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_values * not_done - values[t]
        last = delta + gamma * lam * not_done * last
        advantages[t] = last
    return advantages, advantages + values


@dataclass(frozen=True)
class PolicyLoss:
    """The clipped surrogate loss of a minibatch and its diagnostics."""

    loss: torch.Tensor  # () differentiable
    clipfrac: float  # share of rows whose ratio left [1 - clip, 1 + clip]
    approx_kl: float  # k3 estimate of KL(pi_old || pi_new): mean((r - 1) - log r)


def clipped_policy_loss(
    new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip: float
) -> PolicyLoss:
    """PPO's clipped objective, as a loss: `mean(max(-A r, -A clip(r, 1 - clip, 1 + clip)))`, r = pi_new / pi_old.

    new_logp, old_logp, advantages: (B,) float32 (log-probabilities of the actions taken).
    """
    log_ratio = new_logp - old_logp
    ratio = log_ratio.exp()
    loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)).mean()
    with torch.no_grad():
        clipfrac = float(((ratio - 1.0).abs() > clip).float().mean())
        approx_kl = float(((ratio - 1.0) - log_ratio).mean())
    return PolicyLoss(loss, clipfrac, approx_kl)


def expected_value(logp: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """V(s) = sum_a pi(a|s) Q(s, a) over valid candidates: logp, q (B, C) (-inf where masked), mask (B, C) -> (B,)."""
    return (mask * logp.masked_fill(~mask, 0.0).exp() * q.masked_fill(~mask, 0.0)).sum(-1)


def subgoal_potential(info: dict[str, Any] | None) -> float:
    """Phi of the state after a step: the share of its episode's sub-goals done (`sub_goals_done /
    sub_goals_total` of the step's info), 0 where the environment does not report them."""
    done, total = (info or {}).get("sub_goals_done"), (info or {}).get("sub_goals_total")
    return float(done) / float(total) if done is not None and total else 0.0


def shaping_reward(potential: np.ndarray, next_potential: np.ndarray, done: np.ndarray, gamma: float) -> np.ndarray:
    """Potential-based shaping (Ng, Harada & Russell 1999) of N steps: `gamma * Phi(s') * (1 - done) - Phi(s)`.

    potential, next_potential: (N,) Phi before and after each step; done: (N,) bool (terminated or truncated:
    GAE does not bootstrap past either). Phi of the state after an episode's last step is 0, so an episode's
    shaping terms sum (discounted) to -Phi(s_0): the best policy is unchanged, but a step that completes a
    sub-goal is credited at once, and the step that ends an episode short of its goal gives back what was
    credited.
    """
    return gamma * np.where(done, 0.0, next_potential) - potential


def normalize(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / (std + 1e-8); a single row is left centred only."""
    if x.numel() < 2:
        return x - x.mean()
    return (x - x.mean()) / (x.std() + 1e-8)
