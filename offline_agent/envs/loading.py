"""Building an environment from a spec string, and checking that it follows the environment contract.

A spec is either a registered gymnasium id (the built-ins are
`offline_agent/PipelineRepair-v0`, `offline_agent/Logistics-v0` and
`offline_agent/CustomerSupport-v0`) or `module.path:factory`, a callable that
returns a `gymnasium.Env`, imported from the current directory or PYTHONPATH.
Specs are plain strings plus keyword arguments so that worker processes (vector
envs, Ray actors) can rebuild the same environment.

The contract every environment follows, built-in or the user's:

- `reset()` returns `(observation, info)` and `step(i)` returns
  `(observation, reward, terminated, truncated, info)`, as in gymnasium;
- the observation is a dict `{"text": str, "candidates": sequence}`, each candidate a valid action at
  this step: a string (a message) or a tool call `{"name": str, "arguments": dict}`; a candidate list
  may be empty only once the episode has terminated;
- the action is the integer index of a candidate, and the action space is `Discrete(n)` with `n` at
  least the largest number of candidates the environment offers;
- `info` is a dict; at the end of an episode it says `success` (bool), and where the environment knows
  them, `sub_goals_done` / `sub_goals_total` (int) and `is_error` (the last action produced an error);
- the task text comes from the reset info's `task`, else the environment's `task` attribute;
- optionally `expert_action() -> int`, a privileged oracle for the `expert` and `noisy` policies.
"""

from __future__ import annotations

import difflib
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from offline_agent.actions import ActionError, canonical_action
from offline_agent.errors import UserError
from offline_agent.plugins import describe, import_user_module

CONTRACT = "an observation {'text': str, 'candidates': [str | {'name': str, 'arguments': dict}, ...]}"


def make_env(spec: str, **kwargs: Any) -> gym.Env:
    """Build the environment named by `spec` (a registered id or `module.path:factory`) and check its contract.

    Raises `UserError` with a one-line message when the spec cannot be resolved, the factory raises,
    or the environment breaks the contract.
    """
    import offline_agent.envs  # noqa: F401  (registers the built-in simulators)

    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"an environment spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in gym.registry:
        env = _build(spec, lambda: gym.make(spec, **kwargs))
    elif ":" in spec:
        env = _from_module(spec, kwargs)
    else:
        close = difflib.get_close_matches(spec, list(gym.registry), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(
            f"unknown environment {spec!r}{hint}: expected a registered gymnasium id such as "
            f"offline_agent/Logistics-v0, or 'module.path:factory' naming a callable that returns a gymnasium.Env"
        )
    check_contract(env, name=spec)
    return env


def _from_module(spec: str, kwargs: dict[str, Any]) -> gym.Env:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"environment spec {spec!r} must look like 'module.path:factory'")
    module = import_user_module(module_name, f"environment spec {spec!r}")
    factory = getattr(module, attr, None)
    if factory is None and attr in gym.registry:  # gymnasium's own `module:EnvId` form
        return _build(spec, lambda: gym.make(attr, **kwargs))
    if not callable(factory):
        what = "has no attribute" if factory is None else "has a non-callable"
        raise UserError(
            f"module {module_name!r} {what} {attr!r}: environment spec {spec!r} must name a callable that "
            f"returns a gymnasium.Env"
        )
    env = _build(spec, lambda: factory(**kwargs))
    if not isinstance(env, gym.Env):
        raise UserError(f"environment factory {spec!r} returned {type(env).__name__}, expected a gymnasium.Env")
    return env


def _build(spec: str, build: Any) -> gym.Env:
    try:
        return build()
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"creating environment {spec!r} failed: {describe(exc)}") from None


def task_text(info: dict[str, Any] | None, env: gym.Env | None, observation: dict[str, Any]) -> str:
    """An episode's task, as the contract says: the reset info's `task`, else the environment's `task`
    attribute, else (an environment that states neither) the first observation's text. Simulation,
    evaluation and fine-tuning all take it from here, so that a state renders the same in each."""
    for task in ((info or {}).get("task"), getattr(getattr(env, "unwrapped", None), "task", None)):
        if isinstance(task, str) and task:
            return task
    return observation["text"]


def check_contract(env: gym.Env, name: str | None = None, steps: int = 1) -> None:
    """Reset `env` (seed 0), take `steps` steps with the first candidate, and check the contract on the way.

    Raises `UserError` naming what was expected. The environment is left mid-episode: reset it before use.
    """
    name = name or type(env.unwrapped).__name__
    if not isinstance(env, gym.Env):
        raise UserError(f"environment {name!r} is a {type(env).__name__}, expected a gymnasium.Env")
    if not isinstance(env.action_space, spaces.Discrete):
        raise UserError(
            f"environment {name!r} has action space {env.action_space}, expected Discrete(max_candidates): "
            f"an action is the index of a candidate"
        )
    result = _call(name, "reset(seed=0)", lambda: env.reset(seed=0))
    if not (isinstance(result, tuple) and len(result) == 2):
        raise UserError(f"environment {name!r}: reset() must return (observation, info), got {_short(result)}")
    observation, info = result
    _check_observation(name, "reset()", observation, env.action_space.n, terminal=False)
    _check_info(name, "reset()", info)
    for _ in range(steps):
        result = _call(name, "step(0)", lambda: env.step(0))
        if not (isinstance(result, tuple) and len(result) == 5):
            raise UserError(
                f"environment {name!r}: step() must return (observation, reward, terminated, truncated, info), "
                f"got {_short(result)}"
            )
        observation, reward, terminated, truncated, info = result
        try:
            float(reward)
        except (TypeError, ValueError):
            raise UserError(
                f"environment {name!r}: step() returned reward {_short(reward)}, expected a number"
            ) from None
        _check_observation(name, "step()", observation, env.action_space.n, terminal=bool(terminated or truncated))
        _check_info(name, "step()", info)
        if terminated or truncated:
            if not isinstance(info.get("success"), bool):
                raise UserError(
                    f"environment {name!r}: the info of an episode's last step must hold 'success' (bool), "
                    f"got {_short(info.get('success'))}"
                )
            break


def _call(name: str, what: str, fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        raise UserError(f"environment {name!r}: {what} raised {describe(exc)}") from None


def _check_observation(name: str, where: str, observation: Any, n_actions: int, terminal: bool) -> None:
    if not (isinstance(observation, dict) and isinstance(observation.get("text"), str)):
        raise UserError(f"environment {name!r}: {where} returned {_short(observation)}, expected {CONTRACT}")
    candidates = observation.get("candidates")
    if not isinstance(candidates, list | tuple):
        raise UserError(
            f"environment {name!r}: {where} returned candidates {_short(candidates)}, expected a list of valid "
            f"actions, {CONTRACT}"
        )
    if not candidates and not terminal:
        raise UserError(f"environment {name!r}: {where} offered no candidates; every non-final step needs at least one")
    if len(candidates) > n_actions:
        raise UserError(
            f"environment {name!r}: {where} offered {len(candidates)} candidates but the action space is "
            f"Discrete({n_actions}); make it Discrete(max_candidates)"
        )
    for i, candidate in enumerate(candidates):
        try:
            canonical_action(candidate)
        except ActionError as exc:
            raise UserError(f"environment {name!r}: {where} candidate {i} is not a valid action: {exc}") from None


def _check_info(name: str, where: str, info: Any) -> None:
    if not isinstance(info, dict):
        raise UserError(f"environment {name!r}: {where} returned info {_short(info)}, expected a dict")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
