"""Rollouts of a policy in an environment, and the logs they leave, in the format real agent stacks write.

`rollout` runs episodes and returns one `EpisodeResult` per episode (success,
return, steps, errors, retries, recoveries); evaluation code reuses it.
`simulate` does the same with a behaviour policy and writes each episode as one
line of OpenAI chat-format JSON (see `episode_record`), so that simulated logs
go through the same ingestion path as production logs. Episode `i` of a run
with seed `s` resets the environment with `episode_seed(s, i)` and the policy is
seeded with `s`, so a run is reproducible from its seed.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import orjson

from offline_agent.actions import TOOL_CALL, canonical_action, parse_action
from offline_agent.envs.loading import task_text
from offline_agent.envs.policies import PolicyFn
from offline_agent.errors import UserError

# Info keys that are written elsewhere in a log record (or are not per-step facts).
_INFO_SKIP = ("is_error", "success", "task")


@dataclass
class EpisodeResult:
    """What one episode of a rollout did. `messages` is the chat log, when the rollout records it."""

    episode_id: str
    episode_seed: int
    task: str
    success: bool
    episode_return: float
    n_steps: int
    truncated: bool
    n_errors: int
    #: Re-runs of a failing action: the environment's own count (`info["retries"]`) where it keeps one,
    #: else the number of times the policy repeated the action that had just failed.
    retries: int
    #: Failures recovered from: the environment's own count (`info["recoveries"]`) where it keeps one,
    #: else the number of error steps followed by a step without error.
    recoveries: int
    sub_goals_done: int | None = None
    sub_goals_total: int | None = None
    messages: list[dict[str, Any]] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class SimulationSummary:
    """What `simulate` wrote and how the behaviour policy did."""

    path: Path
    env: str
    policy: str
    episodes: int
    steps: int
    successes: int
    mean_return: float

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    @property
    def success_interval(self) -> tuple[float, float]:
        return wilson_interval(self.successes, self.episodes)


def episode_seed(seed: int, index: int) -> int:
    """The reset seed of episode `index` of a run seeded `seed`: runs with different seeds do not share
    episodes (for fewer than a million episodes), so logs made with seed 0 and an evaluation with seed 1
    see different tasks."""
    return (seed * 1_000_003 + index) % 2**32


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a success rate (95% with the default z); (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # At p = 0 or 1 the bound is exactly 0 or 1; rounding would leave p itself outside its interval.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def rollout(
    env: gym.Env,
    policy_fn: PolicyFn,
    episodes: int,
    seed: int = 0,
    *,
    record: bool = False,
    env_name: str | None = None,
) -> list[EpisodeResult]:
    """Run `episodes` episodes of `policy_fn` in `env`; with `record`, keep each episode's chat log."""
    return list(iter_episodes(env, policy_fn, episodes, seed, record=record, env_name=env_name))


def iter_episodes(
    env: gym.Env,
    policy_fn: PolicyFn,
    episodes: int,
    seed: int = 0,
    *,
    record: bool = False,
    env_name: str | None = None,
) -> Iterator[EpisodeResult]:
    """`rollout` one episode at a time, so that long runs can be written as they go."""
    name = env_name or (env.spec.id if env.spec is not None else type(env.unwrapped).__name__)
    for index in range(episodes):
        yield _run_episode(env, policy_fn, f"{name}-{seed}-{index}", episode_seed(seed, index), record)


def _run_episode(env: gym.Env, policy_fn: PolicyFn, episode_id: str, seed: int, record: bool) -> EpisodeResult:
    observation, info = env.reset(seed=seed)
    reset_policy = getattr(policy_fn, "reset", None)
    if reset_policy is not None:
        reset_policy()
    task = task_text(info, env, observation)
    messages = [{"role": "system", "content": task}, {"role": "user", "content": observation["text"]}]
    total, steps, errors, repeats, recovered = 0.0, 0, 0, 0, 0
    previous, previous_failed = None, False
    terminated = truncated = False
    while not (terminated or truncated):
        candidates = observation["candidates"]
        index = int(policy_fn(env, observation))
        if not 0 <= index < len(candidates):
            raise ValueError(
                f"the policy chose candidate {index} but the step offers {len(candidates)} (0..{len(candidates) - 1})"
            )
        action = canonical_action(candidates[index])
        if record:
            texts = [canonical_action(c) for c in candidates]
            result_message = _action_messages(messages, action, texts, steps)
        observation, reward, terminated, truncated, info = env.step(index)
        is_error = info.get("is_error")
        if record:
            result_message["content"] = observation["text"]
            if is_error is not None:
                result_message["is_error"] = bool(is_error)
            result_message["reward"] = float(reward)
            result_message["info"] = {k: v for k, v in info.items() if k not in _INFO_SKIP}
            messages.append(result_message)
        repeats += previous_failed and action == previous
        recovered += previous_failed and not is_error
        previous, previous_failed = action, bool(is_error)
        errors += bool(is_error)
        total += float(reward)
        steps += 1
    return EpisodeResult(
        episode_id=episode_id,
        episode_seed=seed,
        task=task,
        success=bool(info.get("success", False)),
        episode_return=total,
        n_steps=steps,
        truncated=bool(truncated),
        n_errors=errors,
        retries=int(info.get("retries", repeats)),
        recoveries=int(info.get("recoveries", recovered)),
        sub_goals_done=info.get("sub_goals_done"),
        sub_goals_total=info.get("sub_goals_total"),
        messages=messages if record else None,
    )


def _action_messages(messages: list[dict[str, Any]], action: str, candidates: list[str], step: int) -> dict[str, Any]:
    """Append the assistant message of an action; return the (unfinished) message that will carry its result.

    A tool call is an assistant message with `tool_calls` (arguments as a JSON string, as OpenAI writes
    them) answered by a `tool` message; a plain-text action is an assistant message answered by the user.
    """
    parsed = parse_action(action)
    if parsed.kind != TOOL_CALL:
        messages.append({"role": "assistant", "content": action, "candidates": candidates})
        return {"role": "user"}
    call_id = f"call_{step}"
    arguments = orjson.dumps(parsed.tool_args).decode()
    function = {"name": parsed.tool_name, "arguments": arguments}
    tool_calls = [{"id": call_id, "type": "function", "function": function}]
    messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls, "candidates": candidates})
    return {"role": "tool", "tool_call_id": call_id, "name": parsed.tool_name}


def episode_record(result: EpisodeResult, env: str, policy: str, seed: int) -> dict[str, Any]:
    """One line of a simulated log: an OpenAI chat-format record with the episode's outcome."""
    return {
        "episode_id": result.episode_id,
        "env": env,
        "policy": policy,
        "seed": seed,
        "episode_seed": result.episode_seed,
        "task": result.task,
        "messages": result.messages,
        "reward": result.episode_return,
        "success": result.success,
        "n_steps": result.n_steps,
        "truncated": result.truncated,
    }


def simulate(
    env: str,
    episodes: int,
    policy: str,
    seed: int,
    out: str | os.PathLike,
    *,
    progress: bool = False,
    **env_kwargs: Any,
) -> SimulationSummary:
    """Roll out the behaviour policy `policy` in environment `env` and write the logs to `out` (JSONL).

    The file is written to a temporary name next to `out` and moved into place at the end, so an
    interrupted run never leaves a truncated log behind.
    """
    from offline_agent.envs import make_env, make_policy

    if episodes < 1:
        raise UserError(f"--episodes must be at least 1, got {episodes}")
    policy_fn = make_policy(policy, seed)
    environment = make_env(env, **env_kwargs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    successes, steps, total = 0, 0, 0.0
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f, _progress_bar(progress, episodes, f"simulating {env}") as advance:
            for result in iter_episodes(environment, policy_fn, episodes, seed, record=True, env_name=env):
                f.write(orjson.dumps(episode_record(result, env, policy, seed), option=_JSON, default=str))
                f.write(b"\n")
                successes += result.success
                steps += result.n_steps
                total += result.episode_return
                advance()
        os.chmod(tmp, 0o644)  # mkstemp makes files private; a log is meant to be shared like any other
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        environment.close()
    return SimulationSummary(out, env, policy, episodes, steps, successes, total / episodes)


_JSON = orjson.OPT_SERIALIZE_NUMPY


@contextmanager
def _progress_bar(enabled: bool, total: int, description: str) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr; yields the callable that advances it (a no-op when disabled)."""
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)
