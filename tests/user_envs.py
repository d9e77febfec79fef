"""Environments as a user would write them, for the `module.path:factory` specs of the env tests.

`CountTo` follows the contract (and has no `expert_action`); the other factories break it in one way each.
"""

from __future__ import annotations

import gymnasium as gym
from gymnasium import spaces

from offline_agent.envs.base import observation_space


class CountTo(gym.Env):
    """Say "up" until the counter reaches `target`, then "done"; a tool call `reset_counter` sets it back to 0."""

    metadata = {"render_modes": []}

    def __init__(self, target: int = 3, max_steps: int = 12, explode_after_resets: int | None = None):
        self.target, self.max_steps = target, max_steps
        self.explode_after_resets = explode_after_resets
        self.resets = 0
        self.observation_space = observation_space()
        self.action_space = spaces.Discrete(3)
        self.candidates = ("up", "done", {"name": "reset_counter", "arguments": {"to": 0}})

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.resets += 1
        self.count, self.steps = 0, 0
        return {"text": "count is 0", "candidates": self.candidates}, {"task": f"count to {self.target}"}

    def step(self, action):
        if self.explode_after_resets is not None and self.resets > self.explode_after_resets:
            raise RuntimeError("simulator crashed")
        self.steps += 1
        choice = self.candidates[int(action)]
        is_error = False
        if choice == "up":
            self.count += 1
        elif choice == "done":
            is_error = self.count != self.target
        else:
            self.count = 0
        terminated = choice == "done" and not is_error
        truncated = not terminated and self.steps >= self.max_steps
        text = f"count is {self.count}" + (" (not there yet)" if is_error else "")
        info = {"success": terminated, "is_error": is_error, "sub_goals_done": min(self.count, self.target)}
        return {"text": text, "candidates": self.candidates}, float(terminated), terminated, truncated, info


def make_count_to(target: int = 3, **kwargs) -> CountTo:
    return CountTo(target=target, **kwargs)


def make_raising() -> gym.Env:
    raise RuntimeError("simulator licence server unreachable")


def make_not_an_env() -> int:
    return 42


class StringObservation(CountTo):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "count is 0", {}


def make_string_observation() -> gym.Env:
    return StringObservation()


class BadCandidates(CountTo):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return {"text": "count is 0", "candidates": ("up", {"tool": "oops"})}, {}


def make_bad_candidates() -> gym.Env:
    return BadCandidates()


class TooManyCandidates(CountTo):
    def __init__(self):
        super().__init__()
        self.action_space = spaces.Discrete(2)


def make_too_many_candidates() -> gym.Env:
    return TooManyCandidates()


class NoSuccessInfo(CountTo):
    def step(self, action):
        observation, reward, terminated, truncated, info = super().step(action)
        info.pop("success")
        return observation, reward, terminated, truncated, info


def make_no_success_info() -> gym.Env:
    # truncates after one step, so the contract check's single step sees an episode end without `success`
    return NoSuccessInfo(max_steps=1)
