"""Playing a policy's episodes in a simulator: the rollouts that evaluation and fine-tuning's validation share.

`rollout_policy` plays a trained `Policy` (or a scripted behaviour policy given
as `behaviour:SPEC`, e.g. `behaviour:noisy:0.5`) for N episodes; episode i
resets the environment with `simulate.episode_seed(seed, i)`, the same seeds
`offline-agent simulate` uses, so a policy and the logs' behaviour policy can
be compared on identical tasks. A learned policy plays several environments in
lockstep so that each decision round costs one encoder call: the states of all
its episodes (and candidates not seen before) go through one padded batch, and
the texts seen before come from its bounded memo (`EmbeddingMemo`). Behind
safety rules, every environment is wrapped in the same `SafetyWrapper` the
fine-tuning rollouts use. `offline_agent.evaluate` summarises the outcomes;
`validation.py` scores fine-tuning's policies with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from offline_agent.envs.loading import task_text
from offline_agent.envs.safety import ALL_FORBIDDEN, add_blocked
from offline_agent.errors import UserError
from offline_agent.simulate import episode_seed

BEHAVIOUR_PREFIX = "behaviour:"


@dataclass(frozen=True)
class EpisodeOutcome:
    """One evaluated episode."""

    seed: int
    success: bool
    episode_return: float
    discounted_return: float
    steps: int
    errors: tuple[bool, ...]  # is_error of each step
    blocked: dict[str, int] = field(default_factory=dict)  # {safety rule: candidates it removed}
    safety_truncated: bool = False  # ended because the safety filter left no candidate


def discounted_return(rewards: Sequence[float], gamma: float) -> float:
    """sum_t gamma^t r_t of one episode."""
    return float(sum(r * gamma**t for t, r in enumerate(rewards)))


@dataclass
class _Playing:
    """An episode in progress in one environment slot: what its outcome needs so far."""

    index: int
    seed: int
    observation: dict[str, Any]
    history: Any  # the policy's EpisodeHistory
    rewards: list[float] = field(default_factory=list)
    errors: list[bool] = field(default_factory=list)
    blocked: dict[str, int] = field(default_factory=dict)

    def record(self, observation: dict[str, Any], reward: float, info: dict[str, Any]) -> None:
        self.observation = observation
        self.rewards.append(float(reward))
        self.errors.append(bool(info.get("is_error", False)))
        # The safety wrapper says what it removed from every observation it offers (nothing without a filter).
        add_blocked(self.blocked, info.get("safety_blocked"))

    def outcome(self, info: dict[str, Any], gamma: float) -> EpisodeOutcome:
        return EpisodeOutcome(
            seed=self.seed,
            success=bool(info.get("success", False)),
            episode_return=float(sum(self.rewards)),
            discounted_return=discounted_return(self.rewards, gamma),
            steps=len(self.rewards),
            errors=tuple(self.errors),
            blocked=self.blocked,
            safety_truncated=info.get("safety") == ALL_FORBIDDEN,
        )


def rollout_policy(
    env_spec: str,
    policy: Any,
    episodes: int,
    seed: int = 0,
    gamma: float = 0.99,
    n_envs: int = 16,
    safety: Sequence[str] = (),
    envs: Any = None,
) -> list[EpisodeOutcome]:
    """Play `episodes` episodes; `policy` is a `Policy` or the string `behaviour:SPEC`. Episode i uses reset
    seed `episode_seed(seed, i)`; outcomes come back in episode order. With `safety` (rule specs) every
    environment is behind the safety filter, as in fine-tuning: forbidden candidates are never offered.
    `envs` is a vector env to play in (a `RayVectorEnv`, for the Ray backend); by default `n_envs`
    environments in this process."""
    if episodes < 1:
        raise UserError(f"--episodes must be at least 1, got {episodes}")
    if isinstance(policy, str):
        if safety:  # its expert indices refer to the unfiltered candidates (see `offline_agent.envs.safety`)
            raise UserError(f"{policy} picks from the environment's own candidates: evaluate it without --safety")
        return _rollout_behaviour(env_spec, policy, episodes, seed, gamma)
    from offline_agent.online.vector import SyncVectorEnv

    # build_env wraps before it checks the contract, so not even that check executes a forbidden action.
    own = envs is None
    envs = SyncVectorEnv(env_spec, min(n_envs, episodes), safety) if own else envs
    try:
        return _play_episodes(envs, policy, episodes, seed, gamma)
    finally:
        if own:
            envs.close()


def _play_episodes(envs: Any, policy: Any, episodes: int, seed: int, gamma: float) -> list[EpisodeOutcome]:
    """Episodes in order over the slots of `envs`; a slot whose episode ends starts the next pending one."""
    from offline_agent.learn.policy import EpisodeHistory

    pending = list(range(episodes))[::-1]
    results: dict[int, EpisodeOutcome] = {}
    slots: list[_Playing | None] = [None] * min(envs.num_envs, episodes)

    def start(free: list[int]) -> None:
        starting = {slot: pending.pop() for slot in free if pending}
        for slot in free:
            slots[slot] = None
        seeds = {slot: episode_seed(seed, index) for slot, index in starting.items()}
        for slot, (observation, info) in envs.reset_slots(seeds).items():
            history = EpisodeHistory(task_text(info, None, observation))  # env_reset put the env's task in info
            playing = _Playing(starting[slot], seeds[slot], observation, history)
            add_blocked(playing.blocked, info.get("safety_blocked"))
            slots[slot] = playing

    start(list(range(len(slots))))
    while live := [i for i, s in enumerate(slots) if s is not None]:
        playing = [slots[i] for i in live]
        actions = policy.act_batch([p.history for p in playing], [p.observation for p in playing])
        steps = envs.play(dict(zip(live, (int(a) for a in actions), strict=True)))
        ended = []
        for i, p in zip(live, playing, strict=True):
            observation, reward, terminated, truncated, info = steps[i]
            p.record(observation, reward, info)
            if terminated or truncated:
                results[p.index] = p.outcome(info, gamma)
                ended.append(i)
        if ended:
            start(ended)
    return [results[i] for i in range(episodes)]


def _rollout_behaviour(env_spec: str, spec: str, episodes: int, seed: int, gamma: float) -> list[EpisodeOutcome]:
    from offline_agent.envs.loading import make_env
    from offline_agent.envs.policies import make_policy

    policy_fn = make_policy(spec.removeprefix(BEHAVIOUR_PREFIX), seed)
    env = make_env(env_spec)
    outcomes = []
    try:
        for index in range(episodes):
            s = episode_seed(seed, index)
            observation, info = env.reset(seed=s)
            if hasattr(policy_fn, "reset"):
                policy_fn.reset()
            rewards, errors = [], []
            done = False
            while not done:
                observation, reward, terminated, truncated, info = env.step(int(policy_fn(env, observation)))
                rewards.append(float(reward))
                errors.append(bool(info.get("is_error", False)))
                done = terminated or truncated
            outcomes.append(
                EpisodeOutcome(
                    s, bool(info.get("success", False)), float(sum(rewards)),
                    discounted_return(rewards, gamma), len(rewards), tuple(errors),
                )
            )
    finally:
        env.close()
    return outcomes
