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


_WORD_RUN = re.compile(r"\w+")


class StringFinder:
    """Which of a fixed list of (lowercase) strings occur in a text, by `occurs`, without trying every one.

    Where a string occurs, its first run of word characters is a whole run of the text's: the character
    before that run is not a word character (inside the string, or by `occurs`' rule at its start), nor is
    the one after it (inside the string, or at its end). So only the strings whose first run is one of the
    text's runs are tried, and strings without a word character always are.
    """

    def __init__(self, strings: Sequence[str]):
        self.strings = list(strings)
        self._by_run: dict[str, list[int]] = {}
        self._always: list[int] = []
        for i, string in enumerate(self.strings):
            run = _WORD_RUN.search(string)
            if run is None:
                self._always.append(i)
            else:
                self._by_run.setdefault(run.group(), []).append(i)

    def found_in(self, text: str) -> list[int]:
        """Indices of the strings that occur in `text`, ascending."""
        tried = set(self._always)
        for run in set(_WORD_RUN.findall(text)):
            tried.update(self._by_run.get(run, ()))
        return sorted(i for i in tried if occurs(self.strings[i], text))


def _sorted_keys(keys: list[int], values: list[Any] | None = None, width: int = 0, dtype=torch.int64):
    """(keys (K,) int64 sorted, their `values` (K + 1,) or (K + 1, width) in the same order): the last
    value is zeros, where `_find` points when there are no keys."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    sorted_keys = torch.tensor([keys[i] for i in order], dtype=torch.int64)
    if values is None:
        return sorted_keys, None
    shape = (len(order) + 1, width) if width else (len(order) + 1,)
    padded = torch.zeros(shape, dtype=dtype)
    if order:
        padded[:-1] = torch.tensor([values[i] for i in order], dtype=dtype)
    return sorted_keys, padded


def _find(keys: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each query sits in the sorted `keys`: (index, found), both shaped like `queries`."""
    if keys.numel() == 0:
        return torch.zeros_like(queries), torch.zeros(queries.shape, dtype=torch.bool)
    index = torch.searchsorted(keys, queries).clamp(max=keys.numel() - 1)
    return index, keys[index] == queries


_F = {name: i for i, name in enumerate(GROUNDING_FEATURES)}


class GroundingTable:
    """Grounding of every (logged step, vocabulary action) pair, read from tensors built once.

    A learner on logs without candidates scores random vocabulary actions at every step (some 9,000 pairs
    a batch), and FQE or `advise` the whole vocabulary at every step; `features_in` once per pair, in
    Python, was 95% of training time on such logs. So the table keeps each feature's facts apart and
    gathers them per batch:

    - the action's own (`is_call`, `has_values`; its tool, its values);
    - the step's episode so far: the first row of its episode where each action, and each tool, was
      logged (`taken_before`, `tool_used_before`), and the action logged just before (`repeats_last`);
    - which tool names the step's observation names (`name_in_observation`);
    - for each value that occurs in the step's context or observation (`StringFinder`), whether it does in
      each and what the task says of it as far as the observation shows (`task_clause_observed`); a value
      that occurs in neither adds nothing to any of the four value features;
    - the (step, action) pairs whose values all occur in one clause (`values_in_one_clause`).

    Every value equals `features_in` on the step's `situation` with its episode so far, bit for bit (tests
    check every pair of simulated logs, and sixty steps of τ-bench's against its whole vocabulary). A step's
    episode so far is the logged actions of the rows before it in its episode (rows are sorted by episode
    and step). Built in a second or two per few thousand steps, most of it finding the values in the texts.
    """

    def __init__(
        self,
        state_texts: Sequence[str],
        vocab: Sequence[str],
        action_id: torch.Tensor,
        episode_index: torch.Tensor,
    ):
        self.vocab = vocab
        self.action_id, self.episode_index = action_id.tolist(), episode_index.tolist()
        self._build_actions()
        self._build_episodes()
        self._build_steps(state_texts)

    def _build_actions(self) -> None:
        parts = [call_parts(a) for a in self.vocab]
        self.values = sorted({v for p in parts for v in p.values})
        self.names = sorted({str(p.tool_name).lower() for p in parts if p.is_call})
        self.tools = sorted({p.tool_name for p in parts if p.is_call and p.tool_name})
        value_id = {v: i for i, v in enumerate(self.values)}
        name_id = {n: i for i, n in enumerate(self.names)}
        tool_id = {t: i for i, t in enumerate(self.tools)}
        # Keys are row * stride + id (a step's value, name or tool) or run * stride + id (an episode's tool).
        self.value_stride, self.name_stride = max(len(self.values), 1), max(len(self.names), 1)
        self.tool_stride = max(len(self.tools), 1)
        self.is_call = torch.tensor([p.is_call for p in parts], dtype=torch.bool)
        # each action's values, one after the other: action a's are value_ids[value_start[a]:][:n_values[a]]
        self.value_ids = torch.tensor([value_id[v] for p in parts for v in p.values], dtype=torch.int64)
        self.n_values = torch.tensor([len(p.values) for p in parts], dtype=torch.int64)
        self.value_start = self.n_values.cumsum(0) - self.n_values
        self.name_of = torch.tensor(
            [name_id[str(p.tool_name).lower()] if p.is_call else -1 for p in parts], dtype=torch.int64
        )
        self.tool_of = torch.tensor(
            [tool_id[p.tool_name] if p.is_call and p.tool_name else -1 for p in parts], dtype=torch.int64
        )
        self._parts = parts
        # the actions of two or more values, by value: where all of an action's values occur in a context,
        # it may have them in one clause
        self._multi_by_value: dict[int, list[int]] = {}
        for a, p in enumerate(parts):
            if len(p.values) > 1:
                for v in p.values:
                    self._multi_by_value.setdefault(value_id[v], []).append(a)

    def _build_episodes(self) -> None:
        n, n_actions = len(self.action_id), len(self.vocab)
        # An episode is a run of rows with one episode index, as `taken_before` walks it.
        run = [0] * n
        for row in range(1, n):
            run[row] = run[row - 1] + (self.episode_index[row] != self.episode_index[row - 1])
        self.run = torch.tensor(run, dtype=torch.int64)
        first_taken: dict[int, int] = {}
        first_tool: dict[int, int] = {}
        prev = [-1] * n
        for row, action in enumerate(self.action_id):
            first_taken.setdefault(run[row] * n_actions + action, row)
            tool = int(self.tool_of[action])
            if tool >= 0:
                first_tool.setdefault(run[row] * self.tool_stride + tool, row)
            if row > 0 and run[row] == run[row - 1]:
                prev[row] = self.action_id[row - 1]
        self.prev_action = torch.tensor(prev, dtype=torch.int64)
        self.taken_keys, self.taken_first = _sorted_keys(list(first_taken), list(first_taken.values()))
        self.tool_keys, self.tool_first = _sorted_keys(list(first_tool), list(first_tool.values()))

    def _build_steps(self, state_texts: Sequence[str]) -> None:
        value_finder, name_finder = StringFinder(self.values), StringFinder(self.names)
        n_actions = len(self.vocab)
        value_keys: list[int] = []
        value_facts: list[tuple[float, float, float]] = []  # (in context, in observation, task clause observed)
        name_keys: list[int] = []
        clause_keys: list[int] = []
        for row, text in enumerate(state_texts):
            where = situation(text, ())  # the episode so far is `_build_episodes`' part
            in_context = set(value_finder.found_in(where.context))
            in_observation = set(value_finder.found_in(where.observation))
            for v in sorted(in_context | in_observation):
                value_keys.append(row * self.value_stride + v)
                task = task_clause_observed(self.values[v], where) if v in in_context else 0.0
                value_facts.append((float(v in in_context), float(v in in_observation), task))
            name_keys.extend(row * self.name_stride + i for i in name_finder.found_in(where.observation))
            clause_keys.extend(row * n_actions + a for a in self._in_one_clause(where, in_context))
        self.value_keys, self.value_facts = _sorted_keys(value_keys, value_facts, 3, torch.float64)
        self.name_keys, _ = _sorted_keys(name_keys)
        self.clause_keys, _ = _sorted_keys(clause_keys)

    def _in_one_clause(self, where: Situation, in_context: set[int]) -> list[int]:
        """The actions of two or more values, all in one clause of `where`'s context (`values_in_one_clause`)."""
        hits: dict[int, int] = {}
        for v in in_context:
            for a in self._multi_by_value.get(v, ()):
                hits[a] = hits.get(a, 0) + 1
        whole = [a for a, count in hits.items() if count == len(self._parts[a].values)]
        clauses_of: dict[str, set[int]] = {}  # a value's clauses, found once per step
        for a in whole:
            for v in self._parts[a].values:
                if v not in clauses_of:
                    clauses_of[v] = {i for i, c in enumerate(where.clauses) if occurs(v, c)}
        return [a for a in whole if set.intersection(*(clauses_of[v] for v in self._parts[a].values))]

    def taken_before(self, row: int) -> list[str]:
        """The logged actions of the episode of `row` before it, oldest first."""
        first = row
        while first > 0 and self.episode_index[first - 1] == self.episode_index[row]:
            first -= 1
        return [self.vocab[a] for a in self.action_id[first:row]]

    def lookup(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """rows (B,) int64 and ids (B, C) int64 (-1 = empty slot, zeros) -> (B, C, P) float32."""
        valid = ids >= 0
        a = ids.clamp(min=0)
        r = rows[:, None].expand_as(a)
        out = torch.zeros(*ids.shape, PAIR_DIM)
        is_call = self.is_call[a]
        n = self.n_values[a]
        out[..., _F["is_call"]] = is_call.float()
        out[..., _F["has_values"]] = (n > 0).float()

        # Each (pair, value) once, pair by pair and in the action's order of values, so that the sums below
        # add a pair's values in `features_in`'s order (in float64, then divided, as it does).
        counts = n.reshape(-1)  # (B * C,)
        pair = torch.repeat_interleave(torch.arange(counts.numel()), counts)  # (M,)
        within = torch.arange(pair.numel()) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        value = self.value_ids[self.value_start[a.reshape(-1)][pair] + within]  # (M,)
        index, found = _find(self.value_keys, r.reshape(-1)[pair] * self.value_stride + value)
        facts = self.value_facts[index] * found[:, None]  # (M, 3)
        total = torch.zeros(counts.numel(), 3, dtype=torch.float64).index_add_(0, pair, facts)
        share = (total / counts.clamp(min=1)[:, None]).float().reshape(*ids.shape, 3)
        out[..., _F["values_in_context"]] = share[..., 0]
        out[..., _F["values_in_observation"]] = share[..., 1]
        out[..., _F["task_clause_observed"]] = share[..., 2]
        out[..., _F["values_in_one_clause"]] = _find(self.clause_keys, r * len(self.vocab) + a)[1].float()

        name = self.name_of[a]
        named = _find(self.name_keys, r * self.name_stride + name.clamp(min=0))[1]
        out[..., _F["name_in_observation"]] = (named & (name >= 0)).float()
        tool = self.tool_of[a]
        index, found = _find(self.tool_keys, self.run[r] * self.tool_stride + tool.clamp(min=0))
        used = found & (tool >= 0) & (self.tool_first[index] < r)
        out[..., _F["tool_used_before"]] = used.float()
        index, found = _find(self.taken_keys, self.run[r] * len(self.vocab) + a)
        out[..., _F["taken_before"]] = (found & (self.taken_first[index] < r)).float()
        out[..., _F["repeats_last"]] = (self.prev_action[r] == a).float()
        return out * valid[..., None]
