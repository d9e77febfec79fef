"""N environments stepped together, in this process or in worker processes, with same-step autoreset.

Why not `gymnasium.vector`: its Sync/AsyncVectorEnv batch these observations
well enough (a tuple of texts, a tuple of candidate tuples), but gymnasium 1.0
(the version this project pins) only knows *next-step* autoreset: the step
after an episode ends ignores its action and returns the first observation of
the next episode with reward 0. In a PPO rollout that is one wasted slot per
episode (1 in ~13 on the built-in simulators) that has to be masked out of the
loss, and a policy forward pass (a text-encoder call, the most expensive thing
in a rollout) on a terminal observation that has no candidates at all. Here an
episode that ends is reset inside the same `step`: the returned observation is
the next episode's first, the info is the last one of the finished episode
(with `success`), and the reset info (with the task text) comes alongside.
Both implementations run the same two worker-side functions, so a rollout is
identical, bit for bit, whichever one runs it.

Environments are built in the worker from spec strings (`make_env(spec)`, so a
user's `module:factory` works in a worker process too) and wrapped in the
safety filter there; observations are checked against the contract at every
step, so that a user environment that breaks it mid-run fails with a one-line
`UserError` instead of a tensor error three frames later.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from offline_agent.errors import UserError

VectorMode = Literal["auto", "sync", "process"]


@dataclass
class VectorStep:
    """What one `step` of N environments returns; lists and arrays have length N."""

    observations: list[dict[str, Any]]  # what to act on next: a new episode's first where one ended
    rewards: np.ndarray  # (N,) float64
    terminated: np.ndarray  # (N,) bool
    truncated: np.ndarray  # (N,) bool
    infos: list[dict[str, Any]]  # this step's info (the finished episode's last info where one ended)
    reset_infos: list[dict[str, Any] | None]  # the new episode's reset info (with "task"), else None


# --- worker-side functions (run in this process or in a worker) -----------------------------------


def build_env(env_spec: str, safety_specs: Sequence[str] = ()) -> gym.Env:
    """The environment of `env_spec`, contract-checked, behind the safety filter if one is given.

    `make_env` checks the contract by stepping a fresh environment once with candidate 0, which may be a
    forbidden action; with a filter, the spec is resolved without that check and the *wrapped* environment
    is checked instead, so not even the check executes a forbidden action.
    """
    from offline_agent.envs import loading
    from offline_agent.envs.safety import SafetyFilter, SafetyWrapper

    safety = SafetyFilter.from_spec(safety_specs)
    if not safety:
        return loading.make_env(env_spec)
    import offline_agent.envs  # noqa: F401  (registers the built-in simulators)

    spec = env_spec.strip()
    if spec in gym.registry:
        env = loading._build(spec, lambda: gym.make(spec))
    elif ":" in spec:
        env = loading._from_module(spec, {})
    else:
        return loading.make_env(env_spec)  # raises its "unknown environment" UserError
    env = SafetyWrapper(env, safety)
    loading.check_contract(env, name=spec)
    return env


def _checked(env_spec: str, where: str, observation: Any, done: bool) -> dict[str, Any]:
    if not (isinstance(observation, dict) and isinstance(observation.get("text"), str)):
        raise UserError(
            f"environment {env_spec!r}: {where} returned {type(observation).__name__} {str(observation)[:80]!r}, "
            "expected an observation {'text': str, 'candidates': [...]}"
        )
    candidates = observation.get("candidates")
    if not isinstance(candidates, list | tuple) or (not done and not candidates):
        raise UserError(
            f"environment {env_spec!r}: {where} returned candidates {str(candidates)[:80]!r}; every step that does "
            "not end the episode must offer a non-empty list of candidate actions"
        )
    return observation


def _task(env: gym.Env, info: dict[str, Any]) -> dict[str, Any]:
    """The reset info with `task` filled in from the env's `task` attribute when the info lacks it (contract)."""
    if not info.get("task"):
        task = getattr(env.unwrapped, "task", None)
        info = {**info, "task": task if isinstance(task, str) else None}
    return info


def env_reset(env: gym.Env, env_spec: str, seed: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    observation, info = env.reset(seed=seed)
    return _checked(env_spec, "reset()", observation, False), _task(env, dict(info))


def env_step(env: gym.Env, env_spec: str, action: int) -> tuple:
    """One step with same-step autoreset: (observation to act on, reward, terminated, truncated, info, reset_info)."""
    observation, reward, terminated, truncated, info = env.step(action)
    terminated, truncated = bool(terminated), bool(truncated)
    _checked(env_spec, f"step({action})", observation, terminated or truncated)
    reset_info = None
    if terminated or truncated:
        if not isinstance(info.get("success"), bool | np.bool_):
            raise UserError(
                f"environment {env_spec!r}: the info of an episode's last step must hold 'success' (bool), "
                f"got {info.get('success')!r:.60}"
            )
        observation, reset_info = env_reset(env, env_spec, None)
    return observation, float(reward), terminated, truncated, dict(info), reset_info


def env_play(env: gym.Env, action: int) -> tuple:
    """One step without autoreset, as evaluation plays it (it resets each episode with that episode's seed)."""
    observation, reward, terminated, truncated, info = env.step(action)
    return observation, float(reward), bool(terminated), bool(truncated), dict(info)


def env_apply(env: gym.Env, env_spec: str, operation: str, argument: int | None) -> tuple:
    """One worker-side operation on one environment: ("reset", seed), ("step", action) with same-step
    autoreset, or ("play", action) without. The in-process and the Ray implementations both run this, so a
    rollout is the same whichever runs it; Ray also replays an environment's operations with it."""
    if operation == "reset":
        return env_reset(env, env_spec, argument)
    if operation == "step":
        return env_step(env, env_spec, int(argument))
    if operation == "play":
        return env_play(env, int(argument))
    raise ValueError(f"unknown environment operation {operation!r}")


# --- the implementations ----------------------------------------------------------------------------


class SyncVectorEnv:
    """N environments stepped one after the other in this process."""

    def __init__(self, env_spec: str, num_envs: int, safety_specs: Sequence[str] = ()):
        self.env_spec = env_spec
        self.envs = [build_env(env_spec, safety_specs) for _ in range(num_envs)]
        self.num_envs = num_envs
        self.max_candidates = int(self.envs[0].action_space.n)

    def reset(self, seeds: Sequence[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        results = [env_reset(env, self.env_spec, int(seed)) for env, seed in zip(self.envs, seeds, strict=True)]
        return [r[0] for r in results], [r[1] for r in results]

    def step(self, actions: Sequence[int]) -> VectorStep:
        results = [env_step(env, self.env_spec, int(a)) for env, a in zip(self.envs, actions, strict=True)]
        return _collect(results)

    def reset_slots(self, seeds: dict[int, int]) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
        """Reset some environments (slot -> seed): {slot: (observation, reset info with "task")}."""
        return {slot: env_reset(self.envs[slot], self.env_spec, int(seed)) for slot, seed in seeds.items()}

    def play(self, actions: dict[int, int]) -> dict[int, tuple]:
        """Step some environments (slot -> action) without autoreset: {slot: gymnasium's five-tuple}."""
        return {slot: env_play(self.envs[slot], int(action)) for slot, action in actions.items()}

    def close(self) -> None:
        for env in self.envs:
            env.close()


class ProcessVectorEnv:
    """N environments, one per worker process, talking over pipes; for environments whose steps cost real time.

    Workers are started with `spawn` (a fork of a process that runs torch threads can deadlock). A worker
    that fails sends its error back and the call raises it here as a `UserError`.
    """

    def __init__(self, env_spec: str, num_envs: int, safety_specs: Sequence[str] = ()):
        self.env_spec = env_spec
        self.num_envs = num_envs
        context = mp.get_context("spawn")
        self.remotes, self.processes = [], []
        for _ in range(num_envs):
            remote, worker_remote = context.Pipe()
            process = context.Process(
                target=_worker, args=(worker_remote, env_spec, list(safety_specs)), daemon=True
            )
            process.start()
            worker_remote.close()
            self.remotes.append(remote)
            self.processes.append(process)
        try:
            self.max_candidates = [self._receive(r) for r in self.remotes][0]
        except BaseException:
            self.close()
            raise

    def _receive(self, remote: Any) -> Any:
        try:
            status, payload = remote.recv()
        except EOFError:
            raise UserError(f"environment {self.env_spec!r}: a worker process died (see its output above)") from None
        if status != "ok":
            raise UserError(payload)
        return payload

    def reset(self, seeds: Sequence[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        for remote, seed in zip(self.remotes, seeds, strict=True):
            remote.send(("reset", int(seed)))
        results = [self._receive(r) for r in self.remotes]
        return [r[0] for r in results], [r[1] for r in results]

    def step(self, actions: Sequence[int]) -> VectorStep:
        for remote, action in zip(self.remotes, actions, strict=True):
            remote.send(("step", int(action)))
        return _collect([self._receive(r) for r in self.remotes])

    def close(self) -> None:
        for remote in self.remotes:
            try:
                remote.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()


def _worker(remote: Any, env_spec: str, safety_specs: list[str]) -> None:
    try:
        env = build_env(env_spec, safety_specs)
        remote.send(("ok", int(env.action_space.n)))
    except Exception as exc:
        remote.send(("error", _message(exc)))
        return
    while True:
        try:
            command, argument = remote.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if command == "close":
            env.close()
            return
        try:
            result = env_reset(env, env_spec, argument) if command == "reset" else env_step(env, env_spec, argument)
            remote.send(("ok", result))
        except Exception as exc:
            remote.send(("error", _message(exc)))


def _message(exc: Exception) -> str:
    if isinstance(exc, UserError):
        return str(exc)
    return f"environment worker failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _collect(results: list[tuple]) -> VectorStep:
    observations, rewards, terminated, truncated, infos, reset_infos = zip(*results, strict=True)
    return VectorStep(
        list(observations),
        np.asarray(rewards, dtype=np.float64),
        np.asarray(terminated, dtype=bool),
        np.asarray(truncated, dtype=bool),
        list(infos),
        list(reset_infos),
    )


def make_vector_env(
    env_spec: str, num_envs: int, safety_specs: Sequence[str] = (), mode: VectorMode = "auto"
) -> SyncVectorEnv | ProcessVectorEnv:
    """N copies of `env_spec`.

    `auto` steps the built-in simulators in this process and other environments in worker processes when
    N > 1 and the machine has more than one core. Measured (benchmarks/online.py, 2 busy cores): a built-in
    simulator steps at ~40,000 steps/s in-process but ~7,000-10,000 through pipes, and a full rollout with 4
    envs ran at 13 steps/s in-process against 9 with workers, which take CPU from the text encoder. Workers
    pay off only for environments whose own step costs milliseconds (a real tool sandbox, a remote API).
    """
    from offline_agent.envs import BUILTIN_ENVS

    if num_envs < 1:
        raise UserError(f"--num-envs must be >= 1, got {num_envs}")
    if mode == "auto":
        cheap = env_spec.strip() in BUILTIN_ENVS
        mode = "process" if num_envs > 1 and (os.cpu_count() or 1) > 1 and not cheap else "sync"
    if mode == "sync":
        return SyncVectorEnv(env_spec, num_envs, safety_specs)
    if mode == "process":
        return ProcessVectorEnv(env_spec, num_envs, safety_specs)
    raise UserError(f"unknown vector mode {mode!r}: use auto, sync or process")
