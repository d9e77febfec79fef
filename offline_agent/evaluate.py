"""Evaluation before deployment: rollouts of a policy in a simulator, summarised with confidence intervals.

`evaluate` plays a run's policy (or a scripted behaviour policy given as
`behaviour:SPEC`, e.g. `behaviour:noisy:0.5`) for N episodes with
`offline_agent.online.play.rollout_policy`, the rollouts fine-tuning's validation
plays too: episode i resets the environment with `simulate.episode_seed(seed, i)`,
the same seeds `offline-agent simulate` uses, so a policy and the logs' behaviour
policy are compared on identical tasks. The encoder runs in the fastest precision
the device runs well (`encoder_precision="auto"`, the default; `resolve_precision`):
int8 with ONNX Runtime (`offline_agent.text.int8`) on CPUs with int8 instructions,
else bfloat16 where the device computes in it natively, whatever precision the policy
was trained in; "fp32", "bf16" or "int8" forces one. The off-policy estimate reads
the dataset's vectors in the precision the policy was trained in (those training
embedded and cached; `policy.trained_precision`).

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

from offline_agent.envs.safety import SafetyFilter, add_blocked
from offline_agent.errors import UserError
from offline_agent.online.play import BEHAVIOUR_PREFIX, EpisodeOutcome, rollout_policy
from offline_agent.ray_backend import check_backend, ray_session, require_ray
from offline_agent.simulate import wilson_interval

__all__ = [
    "EvalReport",
    "evaluate",
    "off_policy_value",
    "recovery_lengths",
    "summarize",
    "wilson_interval",
]

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
    # The number format the policy's encoder ran in ("auto" resolved on this machine); None for a behaviour policy
    encoder_precision: str | None = None

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


def evaluate(
    run: str | Path,
    env: str,
    episodes: int = 100,
    seed: int = 0,
    device: str = "cpu",
    encoder: Any = None,
    n_envs: int = 16,
    safety: str | Sequence[str] | None = None,
    encoder_precision: str = "auto",
    backend: str = "local",
    ray_address: str | None = None,
    ray_actors: int | None = None,
) -> EvalReport:
    """Success rate (95% Wilson interval), returns, steps and recovery of a run's policy in `env`.

    `run` is a run folder (or its policy.json), or `behaviour:SPEC` for a scripted policy
    (`behaviour:noisy:0.5`, `behaviour:expert`, ...). `safety` is the filter the rollouts run behind (specs
    as in `offline_agent.envs.safety`): None applies the rules saved with the run (a fine-tuned run's
    `--safety`; an offline run or a behaviour policy has none), a spec or list of specs replaces them, and
    `()` evaluates without any. `encoder_precision` is the rollouts' encoder's: "fp32", "bf16", "int8", or "auto" (int8
    on a CPU with int8 instructions, else bf16 where the device computes in it natively, else fp32).
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
        gamma = reported_gamma(policy.meta)
        name = f"{policy.algo} ({run_s})"
        if safety is None:
            rules = _saved_safety(policy, run_s)
    precision = None if isinstance(policy, str) else getattr(policy.encoder, "precision", "fp32")
    if backend == "local" or isinstance(policy, str):  # a behaviour policy plays one env in this process
        outcomes = rollout_policy(env, policy, episodes, seed, gamma, n_envs, rules.specs)
        return replace(summarize(outcomes, name, env, gamma, rules.specs), encoder_precision=precision)
    from offline_agent.online.ray_envs import RayVectorEnv

    with ray_session(ray_address):
        envs = RayVectorEnv(env, min(n_envs, episodes), rules.specs, ray_actors)
        try:
            outcomes = rollout_policy(env, policy, episodes, seed, gamma, safety=rules.specs, envs=envs)
        finally:
            envs.close()
    return replace(summarize(outcomes, name, env, gamma, rules.specs), ray=envs.stats(), encoder_precision=precision)


def reported_gamma(meta: dict[str, Any]) -> float:
    """The discount a policy's simulated returns are reported at: that of the logs it learned from (policy.json's
    `dataset.gamma`), whatever its learner bootstrapped with, so that policies of every learner compare; a
    checkpoint older than that entry trained at the dataset's discount, its config's."""
    dataset = meta.get("dataset") or {}
    return float(dataset.get("gamma", meta.get("config", {}).get("gamma", 0.99)))


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
    fqe_value: float  # estimated discounted value of the policy at the split's first states (the fit on the split)
    behaviour_value: float  # discounted return the logged episodes actually got
    gamma: float
    fqe_ci95: tuple[float, float] = (math.nan, math.nan)  # over the split's first states and the refits (fqe_interval)
    fqe_runs: int = 0  # FQE refits on bootstrap resamples of the split's episodes, one per seed
    coverage: float = math.nan  # share of the policy's choices logged in one of the k most similar states
    coverage_k: int = 10
    # The value whatever the policy does where the logs do not show its choice: the 2.5% point of the fits that
    # assume the logs' lowest return there and the 97.5% point of those that assume the highest (learn/fqe.py).
    fqe_bounds: tuple[float, float] = (math.nan, math.nan)
    # How well the run's value network (learn/value.py) predicts the split's episodes' success: ROC AUC of the
    # first step's predicted return with a bootstrap interval over the episodes, and of every step's; nan for a
    # run without one or a split without both outcomes.
    value_auc: float = math.nan
    value_auc_ci95: tuple[float, float] = (math.nan, math.nan)
    value_auc_per_step: float = math.nan
    fqe_grounding: bool = False  # FQE's Q read each (state, action) pair's grounding (learn/grounding.py)
    # The lowest and highest discounted return from any logged step, at `gamma`: where the bounds' fits assume
    # the logs' worst and best, and outside which an FQE value claims what no logged episode got.
    logged_returns: tuple[float, float] = (math.nan, math.nan)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fqe_ci95"] = list(self.fqe_ci95)
        out["value_auc_ci95"] = list(self.value_auc_ci95)
        out["fqe_bounds"] = list(self.fqe_bounds)
        out["logged_returns"] = list(self.logged_returns)
        out["doubts"] = fqe_doubts(self.coverage, self.episodes, self.fqe_value, self.logged_returns)
        return out


#: Below this coverage the report warns that FQE extrapolates (`learn/confidence.py`).
LOW_COVERAGE = 0.5
#: Below this many held-out episodes the report warns that FQE's value is not one to act on, whatever the
#: coverage: from test splits of 14-16 episodes (150 logs) it missed the simulated value by 0.08-0.40 (an
#: earlier run's PipelineRepair policy by 0.15 at a coverage of 0.81: 0.591 against 0.736); from 55-90 episodes
#: by at most 0.19, and by at most 0.046 where the coverage was high (benchmarks/results/fqe_coverage.md,
#: 2026-12-07). 50 is a line between the two, not a measured optimum.
FEW_EPISODES = 50


def digits_below(value: float, line: float) -> str:
    """`value` with as many decimals as it takes (2 at least) to read below `line` when it is below: 0.497
    against 0.5 is "0.497", where "0.50 < 0.5" would read as a contradiction; a value at or above the line
    keeps 2."""
    digits = 2
    while value < line and round(value, digits) >= line and digits < 6:
        digits += 1
    return f"{value:.{digits}f}"


#: How far (as a share of the logs' range of returns) an FQE value may lie outside that range before the report
#: says so: a fit's noise can overshoot by a little; on tau-bench airline (returns in [0, 1]) an extrapolating fit
#: reached 1.05 on fp32 vectors and 32.3 on int8 ones.
OUTSIDE_RETURNS = 0.01


def outside_logged_returns(value: float, logged_returns: tuple[float, float]) -> bool:
    """Whether `value` lies further than `OUTSIDE_RETURNS` of their width outside the logs' [lowest, highest]
    discounted return; False where either is unknown (nan)."""
    low, high = logged_returns
    slack = OUTSIDE_RETURNS * (high - low)
    return bool(value < low - slack or value > high + slack)  # False for any nan


def fqe_doubt_reasons(
    coverage: float,
    episodes: int,
    value: float = math.nan,
    logged_returns: tuple[float, float] = (math.nan, math.nan),
) -> list[tuple[str, str]]:
    """Why an FQE value should not be acted on, as (the fact, what it means) pairs; empty when no warning
    applies. `fqe_doubts` words them for a user; a table can show the facts alone."""
    reasons = []
    if outside_logged_returns(value, logged_returns):
        low, high = logged_returns
        fact = f"the value {value:.3f} lies outside the logs' discounted returns ({low:.3f} to {high:.3f})"
        reasons.append((fact, "the fit extrapolated past anything the logs hold"))
    if coverage < LOW_COVERAGE:
        fact = f"coverage {digits_below(coverage, LOW_COVERAGE)} < {LOW_COVERAGE}"
        reasons.append((fact, "FQE extrapolates to actions the logs rarely show there"))
    if episodes < FEW_EPISODES:
        fact = f"only {episodes} held-out episodes (< {FEW_EPISODES})"
        reasons.append((fact, "too few to act on, whatever the interval"))
    return reasons


def fqe_doubts(
    coverage: float,
    episodes: int,
    value: float = math.nan,
    logged_returns: tuple[float, float] = (math.nan, math.nan),
) -> list[str]:
    """Why an FQE value should not be acted on, in the user's words; empty when no warning applies."""
    return [f"{fact}: {meaning}" for fact, meaning in fqe_doubt_reasons(coverage, episodes, value, logged_returns)]


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
    bounds: bool = True,
    grounding: bool = False,
) -> OffPolicyReport:
    """FQE estimate of a run's (greedy) policy on the held-out split of `dataset`: the fit on the split (seed
    `seed`), with a 95% interval over the split's first states and `runs` refits on bootstrap resamples of its
    episodes (seeds `seed`, `seed + 1`, ...; `fqe_interval`), and the coverage of the policy's choices by the
    logs of the other splits (`learn/confidence.py`). With `bounds`, `runs` fits each (at least one), on every
    logged transition, assume the logs' lowest and highest return where they do not show the policy's choice,
    and bracket its value at the split's first states whatever it does there (`fqe_bounds`). With `grounding`
    every fit's Q reads each (state, action) pair's grounding, as the policies do (not the default: on the
    simulators it covered fewer settings, `benchmarks/results/fqe_coverage.md`)."""
    import torch

    from offline_agent.learn.confidence import action_coverage, bootstrap_interval, fqe_interval
    from offline_agent.learn.features import SPLITS, build_features
    from offline_agent.learn.fqe import FQEConfig, fitted_q_evaluation, policy_choices
    from offline_agent.learn.policy import Policy, load_value_network

    if runs < 0:
        raise UserError(f"--fqe-runs must be 0 or more, got {runs}")
    policy = Policy.load(run, encoder=encoder, device=device)
    features = build_features(dataset, policy.encoder, policy.state_settings)
    gamma = features.gamma  # values on the logs are reported at the discount of their returns
    # The greedy policy's choice at every logged step, scored once for all the fits below.
    choices = policy_choices(policy.network, features, torch.arange(features.n_steps), policy.tau, greedy=True)

    def fit(fit_seed: int, resample: bool, unlogged: str = "extrapolate") -> Any:
        # The bounds fit every logged transition: the more of the logs they see, the fewer of the policy's
        # choices they must bound (on the test split alone they spanned nearly [0, 1] in all six benchmark
        # settings, benchmarks/results/fqe_coverage_testsplit_bounds.md). The estimate keeps to the held-out split.
        config = FQEConfig(
            steps=steps, gamma=gamma, seed=fit_seed, device=device, split=split, tau=policy.tau, resample=resample,
            unlogged=unlogged, fit_on="split" if unlogged == "extrapolate" else "all", grounding=grounding,
        )
        result = fitted_q_evaluation(features, policy.network, config, choices=choices)
        if not math.isfinite(result.value):
            raise UserError("FQE diverged (non-finite value): try fewer --fqe-steps or a smaller learning rate")
        return result

    def episode_values(results: list[Any]) -> np.ndarray:
        return np.stack([result.episode_values.numpy() for result in results])  # (fits, episodes)

    # The value is the fit on the split itself. Refits on resamples show how much it owes to which episodes the
    # split happens to hold; their mean is no estimate: a resample has about 63% of the distinct episodes, and
    # FQE on fewer extrapolates more (PipelineRepair: refits 0.71, the split's fit 0.88, simulated 0.87).
    estimate = fit(seed, resample=False)
    refits = [fit(seed + r, resample=True) for r in range(runs)]
    fqe_bounds = (math.nan, math.nan)
    if bounds:
        low, high = ([fit(seed + r, runs > 1, side) for r in range(max(runs, 1))] for side in ("low", "high"))
        fqe_bounds = (bootstrap_interval(episode_values(low), seed=seed)[0],
                      bootstrap_interval(episode_values(high), seed=seed)[1])
    rows = features.rows(split)
    chosen = choices[0][rows, 0]  # (n,) the greedy policy's action ids
    logged = torch.nonzero(features.split != SPLITS.index(split)).flatten()  # the other splits' steps
    coverage = math.nan
    if logged.numel():
        coverage = action_coverage(
            features.state_emb[rows], chosen, features.state_emb[logged], features.action_id[logged], coverage_k
        )
    value_network = load_value_network(run, device)
    value_auc = ValueAUC() if value_network is None else value_auc_on(value_network, features, split, seed)
    return OffPolicyReport(
        policy=f"{policy.algo} ({run})",
        dataset=str(dataset),
        split=split,
        episodes=estimate.episodes,
        fqe_value=estimate.value,
        behaviour_value=estimate.behaviour_value,
        gamma=gamma,
        fqe_ci95=fqe_interval(estimate.episode_values.numpy(), episode_values(refits) if refits else None),
        fqe_runs=runs,
        coverage=coverage,
        coverage_k=coverage_k,
        fqe_bounds=fqe_bounds,
        value_auc=value_auc.first_step,
        value_auc_ci95=value_auc.ci95,
        value_auc_per_step=value_auc.per_step,
        fqe_grounding=grounding,
        logged_returns=features.return_range(gamma),
    )


@dataclass(frozen=True)
class ValueAUC:
    """ROC AUC of a value network's predicted returns for episode success (nan where it cannot be told)."""

    first_step: float = math.nan
    ci95: tuple[float, float] = (math.nan, math.nan)
    per_step: float = math.nan


def value_auc_on(network: Any, features: Any, split: str, seed: int = 0) -> ValueAUC:
    """How well `network`'s predicted returns (`learn/value.py`) tell the `split`'s successful episodes from the
    others: at each episode's first step (with a bootstrap interval over the episodes) and at every step."""
    import torch

    from offline_agent.learn.confidence import auc_interval, roc_auc
    from offline_agent.learn.value import predicted_returns

    def scored(rows: Any) -> tuple[np.ndarray, np.ndarray]:
        success = features.episode_success[features.episode_index[rows]].numpy()
        known = ~np.isnan(success)
        return predicted_returns(network, features, rows[torch.from_numpy(known)]).numpy(), success[known] > 0.5

    first, first_success = scored(features.first_rows(split))
    steps, step_success = scored(features.rows(split))
    return ValueAUC(roc_auc(first, first_success), auc_interval(first, first_success, seed=seed),
                    roc_auc(steps, step_success))
