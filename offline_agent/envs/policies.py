"""Scripted behaviour policies: who acts in the simulators when we generate logs or need a baseline.

A policy is a callable `policy(env, observation) -> index of a candidate`, made
from a short spec by `make_policy`:

- `expert`: the simulator's privileged oracle (`env.unwrapped.expert_action()`);
- `random`: a uniformly random candidate;
- `noisy:EPS`: the expert, except that with probability EPS it picks a random candidate;
- `flaky:EPS` (and `llm-like`, which is `flaky:0.35`): the expert, except that with probability EPS it
  makes the mistakes LLM agents make in production logs: it repeats a call that just failed, sends
  malformed arguments, or picks another wrong call (now and then a harmful one).

Policies hold their own seeded `random.Random`, so a rollout is reproducible from
(environment seed, policy seed). A policy with memory has a `reset()` that
rollouts call at the start of each episode.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from offline_agent.envs.base import EXPERT, MALFORMED
from offline_agent.errors import UserError

PolicyFn = Callable[[gym.Env, dict[str, Any]], int]

POLICY_SPECS = "expert, random, noisy:EPS, flaky:EPS or llm-like (EPS a probability, e.g. noisy:0.5)"
LLM_LIKE_EPS = 0.35


def make_policy(spec: str, seed: int | None = 0) -> PolicyFn:
    """A behaviour policy from its spec (see the module docstring); a bad spec raises `UserError`."""
    name, _, arg = spec.strip().partition(":")
    if name == "expert" and not arg:
        return ExpertPolicy()
    if name == "random" and not arg:
        return RandomPolicy(seed)
    if name == "llm-like" and not arg:
        return FlakyPolicy(LLM_LIKE_EPS, seed)
    if name in ("noisy", "flaky"):
        eps = _probability(spec, arg)
        return NoisyPolicy(eps, seed) if name == "noisy" else FlakyPolicy(eps, seed)
    raise UserError(f"unknown policy {spec!r}: expected {POLICY_SPECS}")


def _probability(spec: str, arg: str) -> float:
    try:
        eps = float(arg)
    except ValueError:
        eps = -1.0
    if not 0.0 <= eps <= 1.0:
        raise UserError(f"policy {spec!r}: EPS must be a probability between 0 and 1, e.g. noisy:0.5")
    return eps


def _expert_index(env: gym.Env) -> int:
    oracle = getattr(env.unwrapped, "expert_action", None)
    if oracle is None:
        raise UserError(
            f"the expert policy needs an environment with an expert_action() method; "
            f"{type(env.unwrapped).__name__} has none: use --policy random, or add the method"
        )
    return int(oracle())


class RandomPolicy:
    """A uniformly random candidate."""

    def __init__(self, seed: int | None = 0):
        self.rng = random.Random(seed)

    def __call__(self, env: gym.Env, observation: dict[str, Any]) -> int:
        return self.rng.randrange(len(observation["candidates"]))


class ExpertPolicy:
    """The environment's privileged oracle."""

    def __call__(self, env: gym.Env, observation: dict[str, Any]) -> int:
        return _expert_index(env)


class NoisyPolicy:
    """The expert with probability 1 - eps, else a uniformly random candidate (possibly the expert's)."""

    def __init__(self, eps: float, seed: int | None = 0):
        self.eps = eps
        self.rng = random.Random(seed)

    def __call__(self, env: gym.Env, observation: dict[str, Any]) -> int:
        if self.rng.random() < self.eps:
            return self.rng.randrange(len(observation["candidates"]))
        return _expert_index(env)


class FlakyPolicy:
    """The expert with probability 1 - eps; otherwise an LLM-like mistake.

    The mistakes, in the order they are tried: repeat the previous call if it failed and is still
    offered (agents loop on a failing call), send a malformed call if one is offered, pick any other
    candidate than the expert's. Outside the built-in simulators, which label their candidates, the
    last two fall back to a random candidate.
    """

    def __init__(self, eps: float, seed: int | None = 0):
        self.eps = eps
        self.rng = random.Random(seed)
        self.previous: Any = None

    def reset(self) -> None:
        self.previous = None

    def __call__(self, env: gym.Env, observation: dict[str, Any]) -> int:
        candidates = observation["candidates"]
        index = self._choose(env, candidates)
        self.previous = candidates[index]
        return index

    def _choose(self, env: gym.Env, candidates: Any) -> int:
        if self.rng.random() >= self.eps:
            return _expert_index(env)
        failed_last = getattr(env.unwrapped, "last_is_error", False)
        if failed_last and self.previous in candidates and self.rng.random() < 0.7:
            return list(candidates).index(self.previous)
        kinds = getattr(env.unwrapped, "candidate_kinds", ())
        malformed = [i for i, k in enumerate(kinds) if k == MALFORMED]
        if malformed and self.rng.random() < 0.5:
            return self.rng.choice(malformed)
        wrong = [i for i, k in enumerate(kinds) if k != EXPERT]
        return self.rng.choice(wrong) if wrong else self.rng.randrange(len(candidates))
