"""Grounding: a few exact facts about a candidate action *in* its episode, for the scoring networks.

A sentence encoder embeds the state and the action separately, so a network that sees phi(s) and
psi(a) cannot check what a tool-calling agent's worst mistakes are made of: an argument value that
appears nowhere in the conversation (an e-mail address with a made-up domain, a card's last four
digits reversed, an order id from another ticket), or a call the agent already made, sent again. Two
independent 384-float vectors carry "is this string somewhere in that text" poorly, however the head
is trained, and the state text only shows the last k turns; a string search over the text and a set
lookup over the episode's earlier actions answer both exactly, in microseconds.

`grounding(state_text, action_text, taken)` returns P = len(GROUNDING_FEATURES) numbers in [0, 1]:

| feature | what it says |
|---|---|
| `is_call` | the action is a tool call (else a message) |
| `has_values` | the call has at least one argument value (a string or number) |
| `values_in_context` | fraction of its values that occur in the task or an observation of the state text |
| `values_in_observation` | fraction of its values that occur in the current (last) observation |
| `name_in_observation` | the tool's name occurs in the current observation (errors name the call to make) |
| `taken_before` | this exact action was taken earlier in the episode |
| `tool_used_before` | a call to this tool was made earlier in the episode |
| `repeats_last` | this exact action was the last one taken |
| `values_in_one_clause` | the call has 2+ values and one clause of the context names them all ("4 x water") |
| `task_clause_observed` | what the task says about each value, as far as the current observation shows it (below) |

The last two relate a call to the text around its values, which pooled embeddings blur most: in
"Orders: O-3330 3 x water to harbor; O-8191 4 x tires to mill_rd" and a status line "[T-7 at harbor]
cargo: water x3", `deliver(order_id=O-3330)` scores 1 (the clause's other words, water and harbor, are
both in the observation) and `deliver(order_id=O-8191)` 0. Clauses end at line breaks, commas,
semicolons, bars, and full stops or colons before a space; a clause's content words are its words of
3+ characters with a letter, common English words left out. Features are only ever appended to the
list, so a network trained with the first P of them reads the first P (`QHead`).

"Occurs" is a case-insensitive match that does not start or end inside a word, so the value `7`
does not occur in `17`. The state text is the one `offline_agent.text.states.render_state` writes (task
line, `[obs]` / `[act]` turns, current observation); values the agent itself wrote in earlier calls
do not count as context: grounding is in what the user, the task or a tool said. `taken` is every
action of the episode so far (training reads it from the log, a policy from its history); without
it, the `[act]` lines of the state text stand in. A network takes these as an extra input per
(state, candidate) pair: `q_values(..., pair=(B, C, P))`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from offline_agent.actions import TOOL_CALL, parse_action
from offline_agent.text.states import ACT_PREFIX as ACT
from offline_agent.text.states import OBS_PREFIX as OBS
from offline_agent.text.states import TASK_PREFIX as TASK

GROUNDING_FEATURES = (
    "is_call",
    "has_values",
    "values_in_context",
    "values_in_observation",
    "name_in_observation",
    "taken_before",
    "tool_used_before",
    "repeats_last",
    "values_in_one_clause",
    "task_clause_observed",
)
PAIR_DIM = len(GROUNDING_FEATURES)


def argument_values(arguments: Any) -> Iterator[str]:
    """The scalar values of a call's arguments (nested lists and objects included), as lowercase strings.

    Booleans and empty strings are left out: they say nothing about where a value came from.
    """
    if isinstance(arguments, dict):
        for value in arguments.values():
            yield from argument_values(value)
    elif isinstance(arguments, list):
        for value in arguments:
            yield from argument_values(value)
    elif isinstance(arguments, bool) or arguments is None:
        return
    elif isinstance(arguments, (int, float, str)):
        text = str(arguments).strip().lower()
        if text:
            yield text


@lru_cache(maxsize=65536)
def _pattern(value: str) -> re.Pattern[str]:
    # Word boundaries by hand: \b fails next to a value's own punctuation ("@mail.example.com", "-1").
    return re.compile(r"(?<!\w)" + re.escape(value) + r"(?!\w)")


def occurs(value: str, text: str) -> bool:
    """`value` (lowercase) occurs in `text` (lowercase), neither starting nor ending inside a word."""
    return value in text and _pattern(value).search(text) is not None


def split_state(state_text: str) -> tuple[str, str, list[str]]:
    """(context, current observation, actions taken) of a rendered state; context and observation lowercase.

    The context is the task and every observation; the actions are the `[act]` blocks, oldest first. A
    line that starts no block continues the one before it (observations span lines). A text that is not
    a rendered state (a bare prompt) is all context and all current observation.
    """
    return _split(_blocks(state_text), state_text)


def _blocks(state_text: str) -> list[tuple[str, list[str]]]:
    """(kind, lines) of each block of a rendered state: TASK, OBS or ACT, in order."""
    blocks: list[tuple[str, list[str]]] = []  # (kind, lines)
    for line in state_text.split("\n"):
        if line.startswith(OBS):
            blocks.append((OBS, [line[len(OBS) :]]))
        elif line.startswith(ACT):
            blocks.append((ACT, [line[len(ACT) :]]))
        elif line.startswith(TASK) and not blocks:
            blocks.append((TASK, [line[len(TASK) :]]))
        elif blocks:
            blocks[-1][1].append(line)
        else:
            blocks.append((TASK, [line]))
    return blocks


def _split(blocks: list[tuple[str, list[str]]], state_text: str) -> tuple[str, str, list[str]]:
    context = ["\n".join(lines) for kind, lines in blocks if kind != ACT]
    observations = ["\n".join(lines) for kind, lines in blocks if kind == OBS]
    actions = ["\n".join(lines) for kind, lines in blocks if kind == ACT]
    observation = observations[-1] if observations else state_text
    return "\n".join(context).lower(), observation.lower(), actions


@dataclass(frozen=True)
class Situation:
    """What grounding reads of one decision: the state's text split up, and the episode's actions so far."""

    context: str  # task and observations, lowercase
    observation: str  # the current observation, lowercase
    taken: frozenset[str]  # every action taken earlier in the episode
    tools: frozenset[str]  # the tools those actions called
    last: str | None  # the action taken just before
    clauses: tuple[str, ...] = ()  # the clauses of the context
    task_clauses: tuple[tuple[str, frozenset[str]], ...] = ()  # the task's clauses (lowercase), their content words
    observed_words: frozenset[str] = frozenset()  # the current observation's content words


def situation(state_text: str, taken: Sequence[str] | None = None) -> Situation:
    """The `Situation` of a rendered state; `taken` (the episode's actions, oldest first) defaults to the
    `[act]` lines of the text, which only reach back k turns."""
    blocks = _blocks(state_text)
    context, observation, shown = _split(blocks, state_text)
    task = "\n".join(blocks[0][1]) if blocks and blocks[0][0] == TASK else ""
    taken = shown if taken is None else list(taken)
    tools = {call_parts(a).tool_name for a in taken}
    return Situation(
        context,
        observation,
        frozenset(taken),
        frozenset(t for t in tools if t),
        taken[-1] if taken else None,
        clauses(context),
        task_clauses(task.lower()),
        frozenset(content_words(observation)),
    )


# A clause ends at a line break, a comma, a semicolon, a bar, or a full stop or colon before a space:
# "Orders: O-3330 3 x water to harbor; O-8191 ..." holds one clause per order.
_CLAUSE = re.compile(r"[;\n|,]|[.:](?:\s|$)")
_WORD = re.compile(r"\w[\w\-]*")
_STOP = frozenset(
    "the and for with was are has have not you your this that from into but all any can will its our out "
    "per via been were then than them they what when which who how now one get got may own off each only "
    "very also just more some such there here their these those would could should about after before "
    "again please".split()
)


def clauses(text: str) -> tuple[str, ...]:
    """The non-blank clauses of a text."""
    return tuple(c for c in _CLAUSE.split(text) if c.strip())


@lru_cache(maxsize=4096)
def task_clauses(task: str) -> tuple[tuple[str, frozenset[str]], ...]:
    """The clauses of a (lowercase) task with their content words; cached, as an episode's task is read at
    every step."""
    return tuple((c, frozenset(content_words(c))) for c in clauses(task))


def content_words(text: str) -> set[str]:
    """Words of 3+ characters with a letter in them, common English words left out."""
    return {w for w in _WORD.findall(text) if len(w) >= 3 and not w.isdigit() and w not in _STOP}


def task_clause_observed(value: str, where: Situation) -> float:
    """How much of what the task says about `value` the current observation shows: over the task's clauses
    that name it, the largest fraction of their other content words that occur in the observation (0 where
    no clause names it)."""
    best = 0.0
    for clause, words in where.task_clauses:
        if value in clause and occurs(value, clause):
            others = words - {value}
            if others:
                best = max(best, len(others & where.observed_words) / len(others))
    return best


def grounding(state_text: str, action_text: str, taken: Sequence[str] | None = None) -> np.ndarray:
    """(P,) float32: the GROUNDING_FEATURES of `action_text` (a canonical action) in `state_text`."""
    return features_in(situation(state_text, taken), action_text)


@dataclass(frozen=True)
class CallParts:
    """What grounding reads of an action text alone: is it a tool call, its tool, its distinct values."""

    is_call: bool
    tool_name: str | None
    values: tuple[str, ...]


@lru_cache(maxsize=65536)
def call_parts(action_text: str) -> CallParts:
    """The `CallParts` of a canonical action text. Cached: a rollout scores the same few candidates at every
    step, and parsing their JSON again was a tenth of a rollout step's Python time."""
    parsed = parse_action(action_text)
    if parsed.kind != TOOL_CALL:
        return CallParts(False, None, ())
    return CallParts(True, parsed.tool_name, tuple(dict.fromkeys(argument_values(parsed.tool_args))))


def features_in(where: Situation, action_text: str) -> np.ndarray:
    """(P,) float32 GROUNDING_FEATURES of a canonical action text in a `Situation`."""
    parsed = call_parts(action_text)
    found = dict.fromkeys(GROUNDING_FEATURES, 0.0)
    if parsed.is_call:
        values = parsed.values
        found["is_call"] = 1.0
        if values:
            found["has_values"] = 1.0
            found["values_in_context"] = sum(occurs(v, where.context) for v in values) / len(values)
            found["values_in_observation"] = sum(occurs(v, where.observation) for v in values) / len(values)
            found["values_in_one_clause"] = float(
                len(values) > 1 and any(all(occurs(v, c) for v in values) for c in where.clauses)
            )
            found["task_clause_observed"] = sum(task_clause_observed(v, where) for v in values) / len(values)
        found["name_in_observation"] = float(occurs(str(parsed.tool_name).lower(), where.observation))
        found["tool_used_before"] = float(parsed.tool_name in where.tools)
    found["taken_before"] = float(action_text in where.taken)
    found["repeats_last"] = float(action_text == where.last)
    return np.fromiter(found.values(), np.float32, PAIR_DIM)


def grounding_batch(
    state_texts: Sequence[str],
    candidates: Sequence[Sequence[str]],
    width: int,
    taken: Sequence[Sequence[str]] | None = None,
) -> torch.Tensor:
    """(B, width, P) float32 grounding of each state's candidate texts (zeros past a state's list); `taken`
    holds each state's episode actions so far (see `situation`)."""
    out = np.zeros((len(state_texts), width, PAIR_DIM), np.float32)
    for i, (state, cands) in enumerate(zip(state_texts, candidates, strict=True)):
        where = situation(state, None if taken is None else taken[i])
        for j, action in enumerate(cands):
            out[i, j] = features_in(where, action)
    return torch.from_numpy(out)


class GroundingTable:
    """Grounding of (logged step, vocabulary action) pairs, each computed once, on first use.

    A step's episode actions so far are the logged actions of the rows before it in its episode (rows
    are sorted by episode and step). Training asks for the same pairs every epoch (a step's logged
    candidates) and for random ones (the sampled candidates of logs without any), so pairs are computed
    lazily and remembered, not all N x V of them up front. The memory is bounded: past `max_pairs` it
    starts afresh (about 150 bytes a pair).
    """

    max_pairs = 2_000_000

    def __init__(
        self,
        state_texts: Sequence[str],
        vocab: Sequence[str],
        action_id: torch.Tensor,
        episode_index: torch.Tensor,
    ):
        self.state_texts, self.vocab = state_texts, vocab
        self.action_id, self.episode_index = action_id.tolist(), episode_index.tolist()
        self._situations: dict[int, Situation] = {}
        self._pairs: dict[tuple[int, int], np.ndarray] = {}

    def taken_before(self, row: int) -> list[str]:
        """The logged actions of the episode of `row` before it, oldest first."""
        first = row
        while first > 0 and self.episode_index[first - 1] == self.episode_index[row]:
            first -= 1
        return [self.vocab[a] for a in self.action_id[first:row]]

    def lookup(self, rows: torch.Tensor, ids: torch.Tensor, remember: bool = True) -> torch.Tensor:
        """rows (B,) int64 and ids (B, C) int64 (-1 = empty slot, zeros) -> (B, C, P) float32.

        `remember=False` for a one-off pass (FQE scoring every vocabulary action of every step)."""
        b, c = ids.shape
        out = np.zeros((b, c, PAIR_DIM), np.float32)
        for i, (row, row_ids) in enumerate(zip(rows.tolist(), ids.tolist(), strict=True)):
            for j, action_id in enumerate(row_ids):
                if action_id >= 0:
                    out[i, j] = self._pair(row, action_id, remember)
        return torch.from_numpy(out)

    def _pair(self, row: int, action_id: int, remember: bool) -> np.ndarray:
        key = (row, action_id)
        found = self._pairs.get(key)
        if found is None:
            where = self._situations.get(row)
            if where is None:
                where = self._situations[row] = situation(self.state_texts[row], self.taken_before(row))
            found = features_in(where, self.vocab[action_id])
            if remember:
                if len(self._pairs) >= self.max_pairs:
                    self._pairs.clear()
                self._pairs[key] = found
        return found
