"""A rollout's storage and its episode statistics: what `PPOTrainer.collect_rollout` fills and reports.

The storage is preallocated with its shape, `(num_steps, num_envs)` (CleanRL's layout), and every rollout
overwrites it; `flatten` hands the update its `(T * N)` rows. `EpisodeStats` counts what the rollout's
finished episodes and the safety filter did, as the `charts/*` and `safety/*` metrics of an iteration.

Dimension letters: T rollout steps per environment, N environments, B rows (T * N), C candidate slots,
D embedding width, P grounding features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from offline_agent.envs.safety import ALL_FORBIDDEN, SafetyFilter, add_blocked
from offline_agent.learn.grounding import PAIR_DIM
from offline_agent.online.self_imitation import Step


@dataclass(frozen=True)
class RolloutBatch:
    """A rollout's observations and sampling record, flattened to rows on the update's device."""

    state: torch.Tensor  # (B, D)
    cands: torch.Tensor  # (B, C, D)
    mask: torch.Tensor  # (B, C) bool
    pair: torch.Tensor | None  # (B, C, P), None unless the policy is grounded
    actions: torch.Tensor  # (B,) long
    logprobs: torch.Tensor  # (B,) log pi_old(a|s)
    ref_values: torch.Tensor  # (B,) V_ref(s)
    ref_logps: torch.Tensor  # (B, C) log pi_ref over the candidates


class RolloutStorage:
    """`num_steps` steps of `num_envs` environments: observations as tensors, what the policy sampled, and
    the rewards it got."""

    def __init__(self, num_steps: int, num_envs: int, max_candidates: int, dim: int, grounded: bool):
        T, N, C, D = num_steps, num_envs, max_candidates, dim
        self.obs_state = torch.zeros(T, N, D)
        self.obs_cands = torch.zeros(T, N, C, D)
        self.obs_pair = torch.zeros(T, N, C, PAIR_DIM) if grounded else None
        self.masks = torch.zeros(T, N, C, dtype=torch.bool)
        self.actions = torch.zeros(T, N, dtype=torch.long)
        self.logprobs = torch.zeros(T, N)
        self.values = torch.zeros(T, N)
        self.ref_values = torch.zeros(T, N)
        self.ref_logps = torch.zeros(T, N, C)  # log pi_ref over the candidates, -inf in padding slots
        self.rewards = torch.zeros(T, N)  # r + shaping - beta * KL
        self.scores = torch.zeros(T, N)  # r, the environment's reward
        self.shaping = torch.zeros(T, N)  # W * (gamma * Phi(s') - Phi(s)), 0 without subgoal_shaping
        self.kls = torch.zeros(T, N)
        self.dones = torch.zeros(T, N)

    def store(
        self,
        t: int,
        state: torch.Tensor,
        cands: torch.Tensor,
        mask: torch.Tensor,
        pair: torch.Tensor | None,
        sampled: dict[str, torch.Tensor],
    ) -> None:
        """Step t's observations (N rows) and what `PPOTrainer.policy_step` sampled there."""
        self.obs_state[t], self.obs_cands[t], self.masks[t] = state, cands, mask
        if self.obs_pair is not None:
            self.obs_pair[t] = pair
        self.actions[t], self.logprobs[t], self.values[t] = sampled["action"], sampled["logprob"], sampled["value"]
        self.ref_values[t], self.ref_logps[t], self.kls[t] = sampled["ref_value"], sampled["ref_logp"], sampled["kl"]

    def step(self, t: int, env: int, pair: torch.Tensor | None) -> Step:
        """Step t of environment `env`, copied out (the next rollout overwrites the storage while the episode
        may still be open); `pair` (N, C, P) is step t's grounding, as the featurizer gave it."""
        return Step(
            self.obs_state[t, env].clone(), self.obs_cands[t, env].clone(), self.masks[t, env].clone(),
            None if pair is None else pair[env].clone(), self.ref_values[t, env].clone(),
            int(self.actions[t, env]), float(self.rewards[t, env]),
        )

    def flatten(self, device: torch.device) -> RolloutBatch:
        """The rollout as B = T * N rows on `device`."""
        C, D = self.obs_cands.shape[2], self.obs_cands.shape[3]
        return RolloutBatch(
            state=self.obs_state.reshape(-1, D).to(device),  # (T, N, D) -> (B, D)
            cands=self.obs_cands.reshape(-1, C, D).to(device),  # (T, N, C, D) -> (B, C, D)
            mask=self.masks.reshape(-1, C).to(device),  # (T, N, C) -> (B, C)
            pair=None if self.obs_pair is None else self.obs_pair.reshape(-1, C, PAIR_DIM).to(device),  # (B, C, P)
            actions=self.actions.reshape(-1).to(device),  # (T, N) -> (B,)
            logprobs=self.logprobs.reshape(-1).to(device),
            ref_values=self.ref_values.reshape(-1).to(device),
            ref_logps=self.ref_logps.reshape(-1, C).to(device),  # (T, N, C) -> (B, C)
        )


def blocked_metric_names(safety: SafetyFilter) -> list[str]:
    """The `safety/blocked/<rule>` names of a filter's rules (one per tool of a deny rule), all reported
    every iteration, zeros included."""
    names = []
    for rule in safety.rules:
        tools = getattr(rule, "tools", None)
        names += [f"deny:{t}" for t in sorted(tools)] if tools is not None else [rule.spec]
    return names


class EpisodeStats:
    """The episodes a rollout finished and the candidates the safety filter removed on the way."""

    def __init__(self, safety: SafetyFilter):
        self.blocked: dict[str, int] = dict.fromkeys(blocked_metric_names(safety), 0)
        self.successes: list[bool] = []
        self.returns: list[float] = []
        self.lengths: list[int] = []
        self.safety_truncated = 0  # episodes ended because every candidate was forbidden

    def add_blocked(self, info: dict[str, Any] | None) -> None:
        """Count the candidates the filter removed before an observation (`info["safety_blocked"]`)."""
        add_blocked(self.blocked, (info or {}).get("safety_blocked"))

    def end_episode(self, info: dict[str, Any], episode_return: float, length: int) -> None:
        """An episode ended with the step whose info is `info`."""
        self.successes.append(bool(info.get("success", False)))
        self.returns.append(episode_return)
        self.lengths.append(length)
        self.safety_truncated += info.get("safety") == ALL_FORBIDDEN

    def metrics(self) -> dict[str, float]:
        """`charts/*` over the finished episodes (NaN where none finished) and `safety/*` counts."""
        nan = float("nan")
        return {
            "charts/success_rate": float(np.mean(self.successes)) if self.successes else nan,
            "charts/episode_return": float(np.mean(self.returns)) if self.returns else nan,
            "charts/episode_length": float(np.mean(self.lengths)) if self.lengths else nan,
            "charts/episodes": float(len(self.successes)),
            "safety/blocked": float(sum(self.blocked.values())) if self.blocked else 0.0,
            "safety/truncated": float(self.safety_truncated),
            **{f"safety/blocked/{name}": float(n) for name, n in self.blocked.items()},
        }
