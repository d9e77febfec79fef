"""N environments in Ray actors, stepped together by the learner: rollouts that outgrow one machine.

The learner keeps the policy: it gathers the observations of every environment, encodes them in one batch,
picks the actions and sends them back. The environments live in A actors holding about N/A environments
each, so one round of a rollout is one call per actor, all in flight at once. The actors run the very
functions the in-process vector env runs (`vector.env_apply`), so under the same reset seeds a rollout on
Ray is the same as a local one.

An actor that dies (its machine went away, its process was killed) is replaced, and its environments are
brought back to where they were by replaying, in the new actor, everything done to them since their last
seeded reset: environments are deterministic under their reset seed (the built-in simulators are, and the
environment contract asks it), so the episodes in progress continue instead of being lost. The replay is
checked: each environment's last observation must come out as the learner last saw it, else the run stops
with an error saying so instead of training on a different episode. `stats()` counts the replacements and
what was replayed.

Ray is imported only here and in `offline_agent.ray_backend`; callers open a `ray_session` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from offline_agent.errors import UserError
from offline_agent.online.vector import VectorStep, _collect, _message, build_env, env_apply
from offline_agent.ray_backend import require_ray

#: Replacements of one actor within one call before the run gives up: a machine that keeps dying is not noise.
MAX_REPLACEMENTS = 3

Operation = tuple[str, int | None]  # ("reset", seed) | ("step", action) | ("play", action)


class EnvGroup:
    """The environments of one actor. Methods answer ("ok", payload) or ("error", one-line message), so that a
    user's environment that raises reaches the learner as that message, not as a Ray traceback."""

    def __init__(self, env_spec: str, count: int, safety_specs: Sequence[str]):
        self.env_spec = env_spec
        self.count = count
        self.safety_specs = list(safety_specs)
        self.envs: list[Any] = []

    def start(self) -> tuple[str, Any]:
        """Build the environments: ("ok", the action space's size)."""
        try:
            self.envs = [build_env(self.env_spec, self.safety_specs) for _ in range(self.count)]
            return "ok", int(self.envs[0].action_space.n)
        except Exception as exc:
            return "error", _message(exc)

    def run(self, commands: list[tuple[int, str, int | None]]) -> tuple[str, Any]:
        """Apply (environment index, operation, argument) commands in order: ("ok", their results)."""
        try:
            return "ok", [env_apply(self.envs[i], self.env_spec, op, arg) for i, op, arg in commands]
        except Exception as exc:
            return "error", _message(exc)

    def replay(self, logs: list[list[Operation]]) -> tuple[str, Any]:
        """Apply each environment's logged operations: ("ok", each one's last observation text, or None)."""
        try:
            last: list[str | None] = []
            for env, log in zip(self.envs, logs, strict=True):
                result = None
                for op, arg in log:
                    result = env_apply(env, self.env_spec, op, arg)
                last.append(None if result is None else result[0]["text"])
            return "ok", last
        except Exception as exc:
            return "error", _message(exc)


class RayVectorEnv:
    """`num_envs` copies of `env_spec` in `actors` Ray actors (default: one per CPU of the cluster, at most
    one per environment). The interface of `SyncVectorEnv`: `reset(seeds)` and `step(actions)` with
    same-step autoreset for PPO, `reset_slots` and `play` for evaluation."""

    def __init__(self, env_spec: str, num_envs: int, safety_specs: Sequence[str] = (), actors: int | None = None):
        self.ray = ray = require_ray()
        if num_envs < 1:
            raise UserError(f"--num-envs must be >= 1, got {num_envs}")
        if actors is not None and actors < 1:
            raise UserError(f"--ray-actors must be >= 1, got {actors}")
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        n_actors = min(num_envs, actors or max(1, int(cpus)))
        self.env_spec = env_spec
        self.num_envs = num_envs
        self.safety_specs = list(safety_specs)
        self.groups = [[int(i) for i in block] for block in np.array_split(np.arange(num_envs), n_actors)]
        self.where = {slot: (a, j) for a, group in enumerate(self.groups) for j, slot in enumerate(group)}
        # More actors than CPUs (a scaling test on a small machine) share them; on a cluster each gets one.
        self.actor_class = ray.remote(EnvGroup).options(num_cpus=min(1.0, cpus / n_actors), max_restarts=0)
        self.logs: list[list[Operation]] = [[] for _ in range(num_envs)]
        self.last_text: list[str | None] = [None] * num_envs
        self.actors_replaced = self.envs_replayed = self.steps_replayed = 0
        self.actors: list[Any] = [None] * n_actors
        try:
            sizes = [self._start(a) for a in range(n_actors)]
        except BaseException:
            self.close()
            raise
        self.max_candidates = sizes[0]

    # --- the vector-env interface ---------------------------------------------------------------------

    def reset(self, seeds: Sequence[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        results = self._run([(slot, "reset", int(seed)) for slot, seed in enumerate(seeds)])
        return [r[0] for r in results], [r[1] for r in results]

    def step(self, actions: Sequence[int]) -> VectorStep:
        return _collect(self._run([(slot, "step", int(a)) for slot, a in enumerate(actions)]))

    def reset_slots(self, seeds: dict[int, int]) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
        slots = list(seeds)
        return dict(zip(slots, self._run([(s, "reset", int(seeds[s])) for s in slots]), strict=True))

    def play(self, actions: dict[int, int]) -> dict[int, tuple]:
        slots = list(actions)
        return dict(zip(slots, self._run([(s, "play", int(actions[s])) for s in slots]), strict=True))

    def stats(self) -> dict[str, int]:
        """Actors, and what was lost and replayed: actors replaced, the environments they held (with their
        episodes in progress), and the steps replayed to bring those back."""
        return {
            "actors": len(self.actors),
            "actors_replaced": self.actors_replaced,
            "envs_replayed": self.envs_replayed,
            "steps_replayed": self.steps_replayed,
        }

    def close(self) -> None:
        for actor in self.actors:
            if actor is not None:
                self.ray.kill(actor)

    # --- calls, failures, replay ----------------------------------------------------------------------

    def _run(self, commands: list[tuple[int, str, int]]) -> list[tuple]:
        """Results of (slot, operation, argument) commands in their order; one call per actor, all in flight."""
        by_actor: dict[int, list[tuple[int, int, str, int]]] = {}
        for k, (slot, op, arg) in enumerate(commands):
            a, j = self.where[slot]
            by_actor.setdefault(a, []).append((k, j, op, arg))
        pending = {a: self.actors[a].run.remote([c[1:] for c in cmds]) for a, cmds in by_actor.items()}
        out: list[Any] = [None] * len(commands)
        for a, cmds in by_actor.items():
            again = lambda a=a, cmds=cmds: self.actors[a].run.remote([c[1:] for c in cmds])  # noqa: E731
            results = self._answer(a, pending[a], again)
            for (k, _, op, arg), result in zip(cmds, results, strict=True):
                slot = commands[k][0]
                if op == "reset" and arg is not None:  # a seeded reset starts the log anew
                    self.logs[slot] = []
                self.logs[slot].append((op, arg))
                self.last_text[slot] = result[0]["text"]
                out[k] = result
        return out

    def _answer(self, a: int, pending: Any, again: Any) -> Any:
        """The payload of actor `a`'s call `pending`; if the actor died, replace it and make the call `again`."""
        died = None
        for attempt in range(MAX_REPLACEMENTS + 1):
            try:
                if attempt:
                    self._replace(a)
                    pending = again()
                status, payload = self.ray.get(pending)
            except self.ray.exceptions.RayActorError as exc:
                died = exc
                continue
            if status != "ok":
                raise UserError(payload)
            return payload
        raise UserError(
            f"environment {self.env_spec!r}: a Ray actor died {MAX_REPLACEMENTS + 1} times in one step "
            f"({' '.join(str(died).split())[:160]}); see the cluster's Ray logs"
        )

    def _start(self, a: int) -> int:
        """Start actor `a` with its environments: the action space's size."""
        self.actors[a] = self.actor_class.remote(self.env_spec, len(self.groups[a]), self.safety_specs)
        status, payload = self.ray.get(self.actors[a].start.remote())
        if status != "ok":
            raise UserError(payload)
        return payload

    def _replace(self, a: int) -> None:
        """A new actor for group `a`, its environments replayed to where the learner last saw them."""
        try:
            self.ray.kill(self.actors[a])
        except Exception:  # noqa: BLE001 (it is gone already; nothing to free)
            pass
        self._start(a)
        logs = [self.logs[slot] for slot in self.groups[a]]
        status, last = self.ray.get(self.actors[a].replay.remote(logs))
        if status != "ok":
            raise UserError(f"environment {self.env_spec!r}: replaying environments in a new Ray actor failed: {last}")
        for slot, text in zip(self.groups[a], last, strict=True):
            if text != self.last_text[slot]:
                raise UserError(
                    f"environment {self.env_spec!r} does not replay: a Ray actor died, and replaying environment "
                    f"{slot}'s reset seed and actions in a new one gave another observation than before. Its "
                    "episodes cannot be continued; an environment must be deterministic under reset(seed=...)"
                )
        self.actors_replaced += 1
        self.envs_replayed += sum(1 for log in logs if log)
        self.steps_replayed += sum(len(log) - 1 for log in logs if log)

