"""The shared machinery of the built-in simulators: spaces, candidate lists, argument checks, episode bookkeeping.

Every built-in simulator is a `ToolEnv`: a small state machine with hidden
state, whose observation is `{"text": str, "candidates": tuple}` and whose
action is the index of one candidate. A subclass describes its job (the tools
and their argument schemas, what each call does, what an expert would do next
and which wrong, harmful or malformed calls are on offer at each step); this
class turns that into the gymnasium API, checks arguments the way a real tool
server would (so that a malformed call comes back as an error observation),
counts steps, and truncates at `max_steps`. It is pure Python with one
`random.Random` per episode, because the simulators must run at thousands of
steps per second on one core.
"""

from __future__ import annotations

import operator
import random
import string
from collections.abc import Sequence
from typing import Any, ClassVar

import gymnasium as gym
from gymnasium import spaces

#: An operation as the simulators hold it internally: `(tool_name, ((arg, value), ...))` for a tool
#: call, `(None, text)` for a message to the user. Tuples, so that candidate lists can be deduplicated.
Op = tuple[Any, Any]

#: The kinds of candidate a built-in simulator offers, exposed as `env.unwrapped.candidate_kinds` so that
#: scripted behaviour policies (the expert, the LLM-like failure modes) can pick by kind.
EXPERT, PLAUSIBLE, MALFORMED, HARMFUL = "expert", "plausible", "malformed", "harmful"

#: What observation texts and candidate strings may hold (printable ASCII and whitespace).
TEXT_CHARSET = string.printable
MAX_TEXT = 8192


def call(name: str, **arguments: Any) -> Op:
    """A tool call as an `Op`."""
    return (name, tuple(arguments.items()))


def say(text: str) -> Op:
    """A message to the user as an `Op`."""
    return (None, text)


def as_candidate(op: Op) -> str | dict[str, Any]:
    """The public form of an op: a string for a message, `{"name", "arguments"}` for a tool call."""
    name, payload = op
    if name is None:
        return payload
    return {"name": name, "arguments": dict(payload)}


class Candidate(spaces.Space):
    """The space of one candidate action: a message string, or a tool call `{"name": str, "arguments": dict}`.

    gymnasium has no space for a JSON-like tool call, and `Text` alone would force the simulators to
    hand out tool calls as pre-serialised strings; this space keeps them structured.
    """

    def __init__(self, max_length: int = 1024, seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_length = max_length

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        if isinstance(x, str):
            return len(x) <= self.max_length
        return (
            isinstance(x, dict)
            and set(x) == {"name", "arguments"}
            and isinstance(x["name"], str)
            and bool(x["name"])
            and isinstance(x["arguments"], dict)
        )

    def sample(self, mask: Any = None) -> str | dict[str, Any]:
        if self.np_random.random() < 0.5:
            n = int(self.np_random.integers(1, 24))
            return "".join(self.np_random.choice(list(string.ascii_lowercase + " "), size=n))
        return {"name": "tool_" + str(int(self.np_random.integers(100))), "arguments": {}}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Candidate) and other.max_length == self.max_length

    def __hash__(self) -> int:
        return hash(("Candidate", self.max_length))

    def __repr__(self) -> str:
        return f"Candidate(max_length={self.max_length})"


def observation_space() -> spaces.Dict:
    """The observation space every built-in simulator uses: the text the agent sees and its candidates."""
    return spaces.Dict(
        {
            "text": spaces.Text(MAX_TEXT, min_length=0, charset=TEXT_CHARSET),
            "candidates": spaces.Sequence(Candidate(), stack=False),
        }
    )


class ToolEnv(gym.Env):
    """Base class of the built-in text simulators with tool-call actions.

    Subclasses set `tools` (argument schema per tool: each argument maps to a type or a tuple of
    allowed values) and implement `_begin` (new hidden state, first observation), `_apply` (what a
    well-formed call does), `_offer` (the candidates of this step with their kinds; exactly one
    `EXPERT`) and `_sub_goals`. A call whose arguments break the schema never reaches `_apply`: it
    comes back as an error observation, as from a real tool server.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 4}
    max_candidates: ClassVar[int] = 8
    default_max_steps: ClassVar[int] = 40
    tools: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, render_mode: str | None = None, max_steps: int | None = None):
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}")
        self.render_mode = render_mode
        self.max_steps = int(max_steps or self.default_max_steps)
        self.observation_space = observation_space()
        self.action_space = spaces.Discrete(self.max_candidates)
        self.task = ""
        self.steps = 0
        self.last_is_error = False
        self.candidate_kinds: tuple[str, ...] = ()
        self._ops: list[Op] = []
        self._expert_index = -1
        self._done = True
        self._success = False
        self._text = ""
        self._rng = random.Random(0)

    # --- the gymnasium API -------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        # One draw from np_random seeds the fast stdlib generator that everything else in the episode uses.
        self._rng = random.Random(int(self.np_random.integers(2**62)))
        self.steps = 0
        self.last_is_error = False
        self._done = False
        self._success = False
        self._text = self._begin(self._rng)
        self._make_candidates()
        info = self._info(False)
        info["task"] = self.task
        return self._observation(), info

    def step(self, action: Any):
        if self._done:
            raise RuntimeError("step() called on a finished episode: call reset() first")
        index = _as_index(action)
        if not 0 <= index < len(self._ops):
            raise ValueError(
                f"action {action!r} is not a candidate index: this step offers {len(self._ops)} candidates, "
                f"pick an index from 0 to {len(self._ops) - 1}"
            )
        op = self._ops[index]
        self.steps += 1
        problem = self._check_arguments(op)
        if problem is None:
            text, is_error = self._apply(op)
        else:
            text, is_error = problem, True
        self.last_is_error = is_error
        terminated = self._done
        truncated = not terminated and self.steps >= self.max_steps
        if truncated:
            self._done = True
            text += f"\n[episode truncated: the {self.max_steps}-step budget is spent]"
        self._text = text
        if terminated:
            self._ops, self.candidate_kinds, self._candidates, self._expert_index = [], (), (), -1
        else:
            self._make_candidates()
        reward = 1.0 if terminated and self._success else 0.0
        return self._observation(), reward, terminated, truncated, self._info(is_error)

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self._text
        return None

    # --- privileged access for scripted policies ---------------------------------------------------

    def expert_action(self) -> int:
        """The index of the candidate a competent operator who knows the hidden state would pick now."""
        if self._done:
            raise RuntimeError("the episode is over: there is no expert action")
        return self._expert_index

    # --- for subclasses ----------------------------------------------------------------------------

    def _begin(self, rng: random.Random) -> str:
        """Draw the hidden state of a new episode, set `self.task`, return the first observation text."""
        raise NotImplementedError

    def _apply(self, op: Op) -> tuple[str, bool]:
        """Carry out a well-formed op: return (observation text, is_error); call `_finish` to end the episode."""
        raise NotImplementedError

    def _offer(self, rng: random.Random) -> list[tuple[Op, str]]:
        """The candidates of this step with their kinds, exactly one of them `EXPERT`, no duplicates."""
        raise NotImplementedError

    def _sub_goals(self) -> tuple[int, int]:
        """(done, total) sub-goals of the task."""
        raise NotImplementedError

    def _extra_info(self) -> dict[str, Any]:
        return {}

    def _finish(self, success: bool) -> None:
        self._done = True
        self._success = success

    def _malformed(self, op: Op, rng: random.Random) -> Op:
        """A malformed variant of a tool call, as LLMs write them: a wrong type, a misspelt key, a missing
        or an extra argument. The schema check turns it into an error observation."""
        name, args = op
        if name is None:
            return op
        args = list(args)
        how = rng.randrange(4) if args else 3
        if how == 0:  # a position where a name was expected, or a number written as a string
            key, value = args[0]
            allowed = self.tools.get(name, {}).get(key)
            if isinstance(value, str):
                value = allowed.index(value) if isinstance(allowed, tuple) and value in allowed else len(value)
            else:
                value = str(value)
            args[0] = (key, value)
        elif how == 1:
            key, value = args[0]
            args[0] = (key + "_name", value)
        elif how == 2:
            args = args[1:]
        else:
            args.append(("force", "yes"))
        return (name, tuple(args))

    # --- internals ---------------------------------------------------------------------------------

    def _make_candidates(self) -> None:
        offered = self._offer(self._rng)
        self._rng.shuffle(offered)
        assert 0 < len(offered) <= self.max_candidates, f"{type(self).__name__} offered {len(offered)} candidates"
        self._ops = [op for op, _ in offered]
        self.candidate_kinds = tuple(kind for _, kind in offered)
        self._expert_index = self.candidate_kinds.index(EXPERT)
        self._candidates = tuple(as_candidate(op) for op in self._ops)

    def _observation(self) -> dict[str, Any]:
        return {"text": self._text, "candidates": self._candidates}

    def _info(self, is_error: bool) -> dict[str, Any]:
        done, total = self._sub_goals()
        info = {"success": self._success, "is_error": is_error, "sub_goals_done": done, "sub_goals_total": total}
        info.update(self._extra_info())
        return info

    def _check_arguments(self, op: Op) -> str | None:
        name, args = op
        if name is None:
            return None
        schema = self.tools.get(name)
        if schema is None:
            return f"ERROR unknown tool {name!r}; available tools: {', '.join(self.tools)}"
        given = dict(args)
        missing = [k for k in schema if k not in given]
        extra = [k for k in given if k not in schema]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing required argument(s) {', '.join(missing)}")
            if extra:
                parts.append(f"unexpected argument(s) {', '.join(extra)}")
            return f"ERROR invalid arguments for {name}: {'; '.join(parts)}"
        for key, allowed in schema.items():
            value = given[key]
            if isinstance(allowed, tuple):
                if value not in allowed:
                    choices = ", ".join(map(str, allowed))
                    return f"ERROR invalid arguments for {name}: {key!r} must be one of {choices}; got {value!r}"
            elif not isinstance(value, allowed) or (allowed is int and isinstance(value, bool)):
                return f"ERROR invalid arguments for {name}: {key!r} must be {allowed.__name__}, got {value!r}"
        return None


def _as_index(action: Any) -> int:
    try:
        return operator.index(action)  # ints and numpy integers; a float index is a caller's bug
    except TypeError:
        raise ValueError(f"an action is the integer index of a candidate, got {action!r}") from None


def fill(
    rng: random.Random,
    expert: Op,
    plausible: Sequence[Op],
    k: int,
    *,
    harmful: Sequence[Op] = (),
    harm_p: float = 0.0,
    malformed: Op | None = None,
    malformed_p: float = 0.0,
) -> list[tuple[Op, str]]:
    """Assemble a candidate list of at most `k`: the expert op, maybe one malformed and one harmful op,
    then plausible-but-wrong ops drawn without replacement."""
    chosen: list[tuple[Op, str]] = [(expert, EXPERT)]
    seen = {expert}
    if malformed is not None and malformed not in seen and rng.random() < malformed_p:
        chosen.append((malformed, MALFORMED))
        seen.add(malformed)
    if harmful and rng.random() < harm_p:
        op = harmful[rng.randrange(len(harmful))]
        if op not in seen:
            chosen.append((op, HARMFUL))
            seen.add(op)
    pool = [op for op in dict.fromkeys(plausible) if op not in seen]
    room = k - len(chosen)
    if len(pool) > room:
        pool = rng.sample(pool, room)
    chosen.extend((op, PLAUSIBLE) for op in pool)
    return chosen
