"""Evaluation before deployment: rollouts of a policy in a simulator, summarised with confidence intervals.

`rollout_policy` plays a trained `Policy` (or a scripted behaviour policy given
as `behaviour:SPEC`, e.g. `behaviour:noisy:0.5`) for N episodes; episode i
resets the environment with `simulate.episode_seed(seed, i)`, the same seeds
`offline-agent simulate` uses, so a policy and the logs' behaviour policy can
be compared on identical tasks. A learned policy plays several environments in
lockstep so that each decision round costs one encoder call: the states of all
its episodes (and candidates not seen before) go through one padded batch, and
the texts seen before come from its bounded memo (`EmbeddingMemo`). With
`encoder_precision="bf16"` the encoder runs in bfloat16 (`TextEncoder`), about
twice as fast on CPUs with bf16 instructions, for a policy trained on fp32
vectors too.

`summarize` turns the episodes into the report: success rate with its 95%
Wilson interval, mean return (and discounted return, what FQE estimates), mean
steps, and recovery: after an action that produced an error observation, how
many steps it took until a step without error (`recovery_lengths`).
`off_policy_value` is the estimate from held-out logs alone (FQE).

A learned policy is evaluated behind the safety rules saved with its run (a
fine-tuned run keeps its `--safety` in policy.json), unless told otherwise: the
environments are wrapped in the same `SafetyWrapper` the fine-tuning rollouts
use, so the policy is scored on what it would be allowed to do, and the report
counts what the filter blocked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from offline_agent.envs.loading import task_text
from offline_agent.errors import UserError
from offline_agent.online.safety import ALL_FORBIDDEN, SafetyFilter, add_blocked
from offline_agent.ray_backend import check_backend, ray_session, require_ray
from offline_agent.simulate import episode_seed, wilson_interval

__all__ = [
    "EpisodeOutcome",
    "EvalReport",
    "evaluate",
    "off_policy_value",
    "recovery_lengths",
    "rollout_policy",
    "summarize",
    "wilson_interval",
]

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


@dataclass(frozen=True)
class EvalReport:
    policy: str
    env: str
    episodes: int
    successes: int
    success_rate: float
    ci95: tuple[float, float]
    mean_return: float
    mean_discounted_return: float
    gamma: float
    mean_steps: float
    error_rate: float  # error steps / steps
    recoveries: int  # error runs followed by a step without error
    unrecovered: int  # error runs the episode ended in
    mean_retries_to_recover: float | None  # mean length of recovered error runs, None when none
    safety: tuple[str, ...] = ()  # the safety rules the rollouts ran behind
    # Candidates the filter removed, counted per rule as fine-tuning's `safety/blocked` is (a candidate two
    # rules forbid counts twice); blocked_actions is their sum.
    blocked_actions: int = 0
    blocked_by_rule: dict[str, int] = field(default_factory=dict)
    safety_truncated: int = 0  # episodes ended because every candidate was forbidden
    # With --backend ray: actors, and actors replaced with the environments and steps replayed (RayVectorEnv)
    ray: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ci95"] = list(self.ci95)
        return out


# --- pure functions --------------------------------------------------------------------------------


def recovery_lengths(is_error: Sequence[bool]) -> tuple[list[int], int]:
    """Steps from each error to the next step without error, and the number of errors never recovered from.

    `is_error` holds one flag per step of an episode. A run of consecutive error steps starting at step i
    and followed by a clean step j counts once, with length j - i (1 = the next action worked); a run
    that lasts to the end of the episode is unrecovered.
    """
    lengths: list[int] = []
    start: int | None = None
    for t, err in enumerate(is_error):
        if err and start is None:
            start = t
        elif not err and start is not None:
            lengths.append(t - start)
            start = None
    return lengths, int(start is not None)


def discounted_return(rewards: Sequence[float], gamma: float) -> float:
    """sum_t gamma^t r_t of one episode."""
    return float(sum(r * gamma**t for t, r in enumerate(rewards)))


def summarize(
    outcomes: Sequence[EpisodeOutcome], policy: str, env: str, gamma: float, safety: Sequence[str] = ()
) -> EvalReport:
    n = len(outcomes)
    if n == 0:
        raise UserError("no episodes were evaluated: pass --episodes 1 or more")
    successes = sum(o.success for o in outcomes)
    lengths: list[int] = []
    unrecovered = 0
    for o in outcomes:
        ls, u = recovery_lengths(o.errors)
        lengths.extend(ls)
        unrecovered += u
    steps = sum(o.steps for o in outcomes)
    blocked: dict[str, int] = {}
    for o in outcomes:
        add_blocked(blocked, o.blocked)
    return EvalReport(
        policy=policy,
        env=env,
        episodes=n,
        successes=successes,
        success_rate=successes / n,
        ci95=wilson_interval(successes, n),
        mean_return=float(np.mean([o.episode_return for o in outcomes])),
        mean_discounted_return=float(np.mean([o.discounted_return for o in outcomes])),
        gamma=gamma,
        mean_steps=steps / n,
        error_rate=sum(sum(o.errors) for o in outcomes) / max(steps, 1),
        recoveries=len(lengths),
        unrecovered=unrecovered,
        mean_retries_to_recover=float(np.mean(lengths)) if lengths else None,
        safety=tuple(safety),
        blocked_actions=sum(blocked.values()),
        blocked_by_rule=blocked,
        safety_truncated=sum(o.safety_truncated for o in outcomes),
    )


# --- rollouts --------------------------------------------------------------------------------------


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
        if safety:  # its expert indices refer to the unfiltered candidates (see `offline_agent.online.safety`)
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


def evaluate(
    run: str | Path,
    env: str,
    episodes: int = 100,
    seed: int = 0,
    device: str = "cpu",
    encoder: Any = None,
    n_envs: int = 16,
    safety: str | Sequence[str] | None = None,
    encoder_precision: str = "fp32",
    backend: str = "local",
    ray_address: str | None = None,
    ray_actors: int | None = None,
) -> EvalReport:
    """Success rate (95% Wilson interval), returns, steps and recovery of a run's policy in `env`.

    `run` is a run folder (or its policy.json), or `behaviour:SPEC` for a scripted policy
    (`behaviour:noisy:0.5`, `behaviour:expert`, ...). `safety` is the filter the rollouts run behind (specs
    as in `offline_agent.online.safety`): None applies the rules saved with the run (a fine-tuned run's
    `--safety`; an offline run or a behaviour policy has none), a spec or list of specs replaces them, and
    `()` evaluates without any. `encoder_precision` is the rollouts' encoder's ("fp32" or "bf16").
    `backend="ray"` runs the environments in `ray_actors` Ray actors (see `offline_agent.ray_backend` for
    `ray_address`); the policy plays here, and the episodes are the same as with the local backend.
    """
    run_s = str(run)
    check_backend(backend)
    if backend == "ray":
        require_ray()  # before a model is loaded
    rules = SafetyFilter.from_spec(safety)  # first, so that a bad spec fails before a model is loaded
    if run_s.startswith(BEHAVIOUR_PREFIX):
        gamma = 0.99
        policy: Any = run_s
        name = run_s
    else:
        from offline_agent.learn.policy import Policy

        policy = Policy.load(run, encoder=encoder, device=device, precision=encoder_precision)
        gamma = float(policy.meta.get("config", {}).get("gamma", 0.99))
        name = f"{policy.algo} ({run_s})"
        if safety is None:
            rules = _saved_safety(policy, run_s)
    if backend == "local" or isinstance(policy, str):  # a behaviour policy plays one env in this process
        outcomes = rollout_policy(env, policy, episodes, seed, gamma, n_envs, rules.specs)
        return summarize(outcomes, name, env, gamma, rules.specs)
    from offline_agent.online.ray_envs import RayVectorEnv

    with ray_session(ray_address):
        envs = RayVectorEnv(env, min(n_envs, episodes), rules.specs, ray_actors)
        try:
            outcomes = rollout_policy(env, policy, episodes, seed, gamma, safety=rules.specs, envs=envs)
        finally:
            envs.close()
    return replace(summarize(outcomes, name, env, gamma, rules.specs), ray=envs.stats())


def _saved_safety(policy: Any, run: str) -> SafetyFilter:
    try:
        return policy.safety
    except UserError as exc:  # e.g. a judge module importable where the run was tuned but not here
        raise UserError(
            f"{run}: the safety rules saved with it cannot be applied ({exc}); pass --safety SPEC to replace "
            "them or --no-safety to evaluate without them"
        ) from None


# --- off-policy ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffPolicyReport:
    policy: str
    dataset: str
    split: str
    episodes: int
    fqe_value: float  # estimated discounted value of the policy at the split's first states (mean over runs)
    behaviour_value: float  # discounted return the logged episodes actually got
    gamma: float
    fqe_ci95: tuple[float, float] = (math.nan, math.nan)  # bootstrap over the split's episodes and the FQE runs
    fqe_runs: int = 1  # FQE fits, one per seed
    coverage: float = math.nan  # share of the policy's choices logged in one of the k most similar states
    coverage_k: int = 10

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fqe_ci95"] = list(self.fqe_ci95)
        return out


#: Below this coverage the report warns that FQE extrapolates (`learn/confidence.py`).
LOW_COVERAGE = 0.5


def off_policy_value(
    run: str | Path,
    dataset: str | Path,
    steps: int = 1500,
    seed: int = 0,
    device: str = "cpu",
    encoder: Any = None,
    split: str = "test",
    runs: int = 3,
    coverage_k: int = 10,
) -> OffPolicyReport:
    """FQE estimate of a run's (greedy) policy on the held-out split of `dataset`, fitted `runs` times (seeds
    `seed`, `seed + 1`, ...), with a bootstrap 95% interval over the split's episodes and the runs, and the
    coverage of the policy's choices by the logs of the other splits (`learn/confidence.py`)."""
    import torch

    from offline_agent.learn.confidence import action_coverage, bootstrap_interval
    from offline_agent.learn.features import SPLITS, build_features
    from offline_agent.learn.fqe import FQEConfig, fitted_q_evaluation, policy_distribution
    from offline_agent.learn.policy import Policy

    if runs < 1:
        raise UserError(f"--fqe-runs must be at least 1, got {runs}")
    policy = Policy.load(run, encoder=encoder, device=device)
    gamma = float(policy.meta.get("config", {}).get("gamma", 0.99))
    features = build_features(dataset, policy.encoder, k=policy.k, keep_opening=policy.keep_opening)
    results = []
    for r in range(runs):
        config = FQEConfig(steps=steps, gamma=gamma, seed=seed + r, device=device, split=split, tau=policy.tau)
        results.append(fitted_q_evaluation(features, policy.network, config))
        if not math.isfinite(results[-1].value):
            raise UserError("FQE diverged (non-finite value): try fewer --fqe-steps or a smaller learning rate")
    values = np.stack([result.episode_values.numpy() for result in results])  # (runs, episodes)
    rows = features.rows(split)
    ids, _, probs = policy_distribution(policy.network, features, rows, policy.tau, greedy=True)
    chosen = ids.gather(1, probs.argmax(1, keepdim=True))[:, 0]  # (n,) the greedy policy's action ids
    logged = torch.nonzero(features.split != SPLITS.index(split)).flatten()  # the other splits' steps
    coverage = math.nan
    if logged.numel():
        coverage = action_coverage(
            features.state_emb[rows], chosen, features.state_emb[logged], features.action_id[logged], coverage_k
        )
    return OffPolicyReport(
        policy=f"{policy.algo} ({run})",
        dataset=str(dataset),
        split=split,
        episodes=results[0].episodes,
        fqe_value=float(values.mean()),
        behaviour_value=results[0].behaviour_value,
        gamma=gamma,
        fqe_ci95=bootstrap_interval(values, seed=seed),
        fqe_runs=runs,
        coverage=coverage,
        coverage_k=coverage_k,
    )
