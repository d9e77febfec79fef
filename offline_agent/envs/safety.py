"""The safety filter: rules that forbid candidate actions, and the env wrapper that never offers a forbidden one.

A fine-tuning run explores, and in a simulator of a production system some
actions must never be tried, however much reward they promise (dropping a
table, refunding without a check). A rule judges one candidate in the context
of its observation; `SafetyFilter` is a list of rules, built from a SPEC string:

- `deny:drop_table,rollback_stage`: tool calls with these names are forbidden;
- `regex:PATTERN`: actions whose canonical text (`offline_agent.actions.canonical_action`, the compact
  JSON of a tool call with its arguments, or a message's text) matches PATTERN (`re.search`) are forbidden;
- `callable:my.module:judge`: `judge(observation_text, action_text) -> bool` decides, True = allowed
  (imported from the current directory or PYTHONPATH, like a `module:factory` environment).

Several rules are joined with `;` (a `;` only splits where a new `deny:`, `regex:` or `callable:` starts,
so a pattern may contain one) or given as several specs. `SafetyWrapper` applies a filter to any
environment by *removing* the forbidden candidates from each observation and mapping the agent's index
back to the environment's: whatever acts on the wrapped env (PPO rollouts, `Policy.act`, evaluation)
cannot pick a forbidden action, with no cooperation from it. This is masking before sampling: softmax over
the allowed candidates is the policy's distribution conditioned on being allowed. If every candidate of a
step is forbidden, the step ends the episode as truncated with `info["safety"] = "all candidates
forbidden"` rather than execute anything; at a reset, where gymnasium has no way to end an episode, the
only candidate offered is `STOP_CANDIDATE`, whose choice ends the episode the same way without reaching
the environment. Each observation's info counts what was removed, per rule, under `info["safety_blocked"]`.
(Privileged indices such as `env.unwrapped.expert_action()` refer to the unfiltered list.)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from offline_agent.actions import ActionError, canonical_action, parse_action
from offline_agent.errors import UserError
from offline_agent.plugins import load_user_function

ALL_FORBIDDEN = "all candidates forbidden"
STOP_CANDIDATE = "[safety filter] every candidate action is forbidden here: end the episode"
SPEC_HELP = "deny:TOOL[,TOOL...] | regex:PATTERN | callable:module.path:function, several joined with ';'"
_KINDS = ("deny", "regex", "callable")
_SPLIT = re.compile(r";\s*(?=(?:deny|regex|callable):)")

Judge = Callable[[str, str], bool]


@dataclass(frozen=True)
class DenyTools:
    """Forbid tool calls by name. Counted per tool: `deny:<tool>`."""

    tools: frozenset[str]

    @property
    def spec(self) -> str:
        return "deny:" + ",".join(sorted(self.tools))

    def forbids(self, observation: str, action: str, tool: str | None) -> str | None:
        return f"deny:{tool}" if tool is not None and tool in self.tools else None


@dataclass(frozen=True)
class RegexRule:
    """Forbid actions whose canonical text matches a pattern. Counted as `regex:<pattern>`."""

    pattern: re.Pattern[str]

    @property
    def spec(self) -> str:
        return "regex:" + self.pattern.pattern

    def forbids(self, observation: str, action: str, tool: str | None) -> str | None:
        return self.spec if self.pattern.search(action) else None


@dataclass(frozen=True)
class CallableRule:
    """Forbid what a user function rejects: `judge(observation_text, action_text) -> bool`, True = allowed."""

    path: str
    judge: Judge

    @property
    def spec(self) -> str:
        return "callable:" + self.path

    def forbids(self, observation: str, action: str, tool: str | None) -> str | None:
        try:
            verdict = self.judge(observation, action)
        except Exception as exc:
            raise UserError(
                f"safety judge {self.path!r} raised {type(exc).__name__}: {str(exc)[:200]} (on action {action[:80]!r})"
            ) from None
        if not isinstance(verdict, bool) and type(verdict).__name__ != "bool_":  # numpy's bool is fine too
            raise UserError(
                f"safety judge {self.path!r} returned {verdict!r:.60}; it must return True (allowed) or False"
            )
        return None if verdict else self.spec


Rule = DenyTools | RegexRule | CallableRule


def parse_rule(text: str) -> Rule:
    """One rule from its spec (see the module docstring); bad specs raise `UserError`."""
    kind, sep, arg = text.strip().partition(":")
    kind = kind.strip()
    if not sep or kind not in _KINDS:
        raise UserError(f"unknown safety rule {text.strip()!r}: expected {SPEC_HELP}")
    if not arg.strip():
        raise UserError(f"safety rule {text.strip()!r} is empty: expected {SPEC_HELP}")
    if kind == "deny":
        tools = frozenset(t.strip() for t in arg.split(",") if t.strip())
        if not tools:
            raise UserError(f"safety rule {text.strip()!r} names no tool: e.g. deny:drop_table,force_publish")
        return DenyTools(tools)
    if kind == "regex":
        try:
            return RegexRule(re.compile(arg))
        except re.error as exc:
            raise UserError(f"safety rule {text.strip()!r}: invalid regular expression ({exc})") from None
    return CallableRule(arg.strip(), _import_judge(arg.strip()))


def _import_judge(path: str) -> Judge:
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        raise UserError(f"safety rule callable:{path} must name module.path:function")
    return load_user_function(module_name, attr, f"safety rule callable:{path}")


def add_blocked(total: dict[str, int], blocked: dict[str, int] | None) -> None:
    """Add one `info["safety_blocked"]` ({rule: candidates removed}, or None) into a running count."""
    for rule, n in (blocked or {}).items():
        total[rule] = total.get(rule, 0) + int(n)


def split_specs(specs: str | Iterable[str] | None) -> list[str]:
    """Rule specs from one `;`-joined string or several, with blanks dropped."""
    if specs is None:
        return []
    if isinstance(specs, str):
        specs = [specs]
    return [part.strip() for spec in specs for part in _SPLIT.split(spec) if part.strip()]


class SafetyFilter:
    """A list of rules; `check` says which candidates of an observation are allowed and what blocked the rest."""

    def __init__(self, rules: Sequence[Rule] = ()):
        self.rules = list(rules)

    @classmethod
    def from_spec(cls, specs: str | Iterable[str] | None) -> SafetyFilter:
        return cls([parse_rule(s) for s in split_specs(specs)])

    @property
    def specs(self) -> list[str]:
        """The rules as specs: what a checkpoint stores so that evaluation applies the same filter."""
        return [rule.spec for rule in self.rules]

    def __bool__(self) -> bool:
        return bool(self.rules)

    def check(self, observation: str, candidates: Sequence[Any]) -> tuple[list[bool], dict[str, int]]:
        """(allowed flag per candidate, {rule name: candidates it forbade}); every rule sees every candidate,
        so a candidate two rules forbid counts once for each."""
        allowed, blocked = [], {}
        for candidate in candidates:
            try:
                action = canonical_action(candidate)
            except ActionError:
                action = str(candidate)  # the env contract check rejects these; judge the text anyway
            tool = parse_action(action).tool_name
            hits = [name for rule in self.rules if (name := rule.forbids(observation, action, tool))]
            for name in hits:
                blocked[name] = blocked.get(name, 0) + 1
            allowed.append(not hits)
        return allowed, blocked

    def __repr__(self) -> str:
        return f"SafetyFilter({'; '.join(self.specs)!r})"


class SafetyWrapper(gym.Wrapper):
    """Offer only the candidates the filter allows; an agent's index i means the i-th allowed candidate.

    See the module docstring for the all-forbidden cases. `info["safety_blocked"]` ({rule: count}) is set on
    every observation the agent has to act on.
    """

    def __init__(self, env: gym.Env, safety: SafetyFilter):
        super().__init__(env)
        self.safety = safety
        self._index: list[int] = []  # allowed position -> the environment's candidate index
        self._stop_only = False
        self._text = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        observation, info = self.env.reset(seed=seed, options=options)
        observation, blocked = self._filter(observation)
        info = {**info, "safety_blocked": blocked}
        self._stop_only = not self._index
        if self._stop_only:
            observation = {**observation, "candidates": (STOP_CANDIDATE,)}
            info["safety"] = ALL_FORBIDDEN
        return observation, info

    def step(self, action: Any):
        if self._stop_only:  # the agent chose STOP_CANDIDATE, the only thing offered
            self._stop_only = False
            observation = {"text": self._text, "candidates": ()}
            return observation, 0.0, False, True, {"success": False, "safety": ALL_FORBIDDEN, "safety_blocked": {}}
        index = int(action)
        if not 0 <= index < len(self._index):
            raise ValueError(
                f"action {action!r} is not a candidate index: this step offers {len(self._index)} allowed candidates"
            )
        observation, reward, terminated, truncated, info = self.env.step(self._index[index])
        if terminated or truncated:
            self._index = []
            return observation, reward, terminated, truncated, info
        observation, blocked = self._filter(observation)
        info = {**info, "safety_blocked": blocked}
        if not self._index:
            # Nothing allowed is left: end here (truncated) rather than execute a forbidden action.
            info.update(success=False, safety=ALL_FORBIDDEN)
            return observation, reward, terminated, True, info
        return observation, reward, terminated, truncated, info

    def _filter(self, observation: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
        candidates = observation.get("candidates") if isinstance(observation, dict) else None
        if not isinstance(candidates, list | tuple) or not isinstance(observation.get("text"), str):
            raise UserError(
                f"environment {type(self.env.unwrapped).__name__} returned {str(observation)[:80]!r}: the safety "
                "filter expected an observation {'text': str, 'candidates': [...]}"
            )
        self._text = observation["text"]
        allowed, blocked = self.safety.check(self._text, candidates)
        self._index = [i for i, ok in enumerate(allowed) if ok]
        kept = tuple(candidates[i] for i in self._index)
        return {**observation, "candidates": kept}, blocked
