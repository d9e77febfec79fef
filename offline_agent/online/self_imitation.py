"""Self-imitation (Oh et al. 2018): learn again from the fine-tuning run's own successful episodes.

PPO learns from a rollout once and forgets it. Where a sampled episode succeeds by taking, at a few states,
a call the greedy policy would not take, PPO raises that call's probability by a step that the KL penalty
soon takes back, and the greedy policy keeps its wrong call. Self-imitation keeps the steps of recent
successful episodes in a buffer and, after each PPO update, takes minibatch steps on

    L_sil = mean(-log pi(a|s) * max(R - V(s), 0))

with R the discounted return from that step to the episode's end (the same rewards PPO's advantages use:
score, shaping and KL penalty) and V the current value head: an action is imitated only as far as it did
better than the policy's own expectation, so a success the policy already expects adds nothing.

The buffer lives in the trainer and in the resume state. Each environment's episode so far ("open") is
kept beside it until the episode ends; open episodes are dropped where the trainer resets every
environment (at checkpoints), so a resume needs only the buffer itself.

Dimension letters: B rows, C candidate slots, D embedding width, P grounding features, K buffer capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from offline_agent.rewards import discounted_returns


def self_imitation_loss(logp_taken: torch.Tensor, returns: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`mean(-log pi(a|s) * max(R - V(s), 0))`; logp_taken, returns, values: (B,). The weight carries no
    gradient: V is the baseline here, trained by PPO's value loss only."""
    weight = (returns - values).clamp(min=0.0).detach()
    return -(logp_taken * weight).mean()


@dataclass
class Step:
    """One decision of an open episode, as the rollout stored it."""

    state: torch.Tensor  # (D,)
    cands: torch.Tensor  # (C, D)
    mask: torch.Tensor  # (C,) bool
    pair: torch.Tensor | None  # (C, P)
    ref_value: torch.Tensor  # () V_ref(s), the value head's input where it is a residual
    action: int
    reward: float  # score + shaping - beta * KL, as in PPO's rewards


class SuccessBuffer:
    """The steps of the most recent successful episodes, at most `capacity` of them (oldest overwritten)."""

    NAMES = ("state", "cands", "mask", "pair", "ref_value", "action", "returns")

    def __init__(self, capacity: int, num_envs: int, candidates: int, dim: int, pair_dim: int | None):
        self.capacity = capacity
        self.state = torch.zeros(capacity, dim)  # (K, D)
        self.cands = torch.zeros(capacity, candidates, dim)  # (K, C, D)
        self.mask = torch.zeros(capacity, candidates, dtype=torch.bool)  # (K, C)
        self.pair = torch.zeros(capacity, candidates, pair_dim) if pair_dim else None  # (K, C, P)
        self.ref_value = torch.zeros(capacity)
        self.action = torch.zeros(capacity, dtype=torch.long)
        self.returns = torch.zeros(capacity)
        self.size = 0  # rows filled
        self.next = 0  # the row the next step goes to
        self.open: list[list[Step]] = [[] for _ in range(num_envs)]

    def record(self, env: int, step: Step) -> None:
        self.open[env].append(step)

    def end_episode(self, env: int, success: bool, gamma: float) -> int:
        """Close environment `env`'s episode: keep its steps if it succeeded. Returns the steps kept."""
        steps, self.open[env] = self.open[env], []
        if not success or not steps:
            return 0
        rewards = np.array([s.reward for s in steps])
        returns = torch.from_numpy(discounted_returns(rewards, np.zeros(len(steps)), gamma).astype(np.float32))
        for step, episode_return in zip(steps[-self.capacity :], returns[-self.capacity :], strict=True):
            row = self.next
            self.state[row], self.cands[row], self.mask[row] = step.state, step.cands, step.mask
            if self.pair is not None:
                self.pair[row] = step.pair
            self.ref_value[row], self.action[row], self.returns[row] = step.ref_value, step.action, episode_return
            self.next = (row + 1) % self.capacity
            self.size = min(self.size + 1, self.capacity)
        return min(len(steps), self.capacity)

    def drop_open(self) -> None:
        """Forget every open episode (the environments were reset under them)."""
        self.open = [[] for _ in self.open]

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n row indices drawn uniformly (with replacement) from the filled rows: (n,) long."""
        return torch.randint(self.size, (n,), generator=generator)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffer's K rows and its cursor (size, next row) for the resume state (`load` reads them back)."""
        out = {name: getattr(self, name) for name in self.NAMES if getattr(self, name) is not None}
        return {**out, "cursor": torch.tensor([self.size, self.next], dtype=torch.long)}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.NAMES:
            if getattr(self, name) is not None:
                getattr(self, name).copy_(tensors[name])
        self.size, self.next = (int(v) for v in tensors["cursor"])
        self.drop_open()
