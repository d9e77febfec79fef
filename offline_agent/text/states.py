"""State text: how a decision's task, recent turns and observation become one text, and a dataset's texts.

`render_state` is the one function that turns (task, recent turns, observation) into state text, used both
over logged datasets and at decision time in an environment, so that a decision-time state hits the
embedding of the logged one. `dataset_texts` renders every step of a dataset and collects its action and
candidate texts. `current_observation` reads a state's current observation back (the observation view:
`observation_views`), as `offline_agent.learn.grounding` reads its turns, by the line prefixes below.

Dimension letters: N texts, D embedding width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import pyarrow.compute as pc

if TYPE_CHECKING:
    from offline_agent.dataset import TrajectoryDataset

#: Turns of history (observation, action) a state text shows by default (`render_state`'s k).
DEFAULT_K = 3
#: The line prefixes of a rendered state (`render_state`); `offline_agent.learn.grounding` and the
#: observation view (`current_observation`) read states back by them.
TASK_PREFIX, OBS_PREFIX, ACT_PREFIX = "Task: ", "[obs] ", "[act] "


def current_observation(text: str) -> str:
    """The current observation of a rendered state text (its last `[obs]` block, without the prefix); a
    text with no `[obs]` block, such as an action, is returned whole."""
    if text.startswith(OBS_PREFIX) and "\n" + OBS_PREFIX not in text:
        return text[len(OBS_PREFIX) :]
    i = text.rfind("\n" + OBS_PREFIX)
    return text[i + 1 + len(OBS_PREFIX) :] if i >= 0 else text


def observation_views(texts: list[str], one_view: Callable[[list[str]], np.ndarray]) -> np.ndarray:
    """[v(text); v(current observation)] / sqrt(2) for each text: two unit vectors side by side, still of unit
    norm. `one_view` embeds a list of texts (N, D) in one call; a text that is its own current observation
    (an action) is passed once."""
    focus = [current_observation(t) for t in texts]
    differ = [i for i, (t, f) in enumerate(zip(texts, focus, strict=True)) if t != f]
    views = one_view(texts + [focus[i] for i in differ])
    whole = views[: len(texts)]
    part = whole.copy()
    part[differ] = views[len(texts) :]
    return (np.concatenate([whole, part], axis=1) / np.sqrt(2.0)).astype(np.float32)


def _render(task: str | None, turns: Sequence[tuple[str, str]], observation: str) -> str:
    # Chat logs without a task field take the first user message as the task; it also opens the first
    # observation, and one copy is enough in a window of a few hundred tokens.
    shown = bool(task) and any(obs.startswith(task) for obs in [*(o for o, _ in turns), observation])
    lines = [TASK_PREFIX + task] if task and not shown else []
    for obs, act in turns:
        lines.append(OBS_PREFIX + obs)
        lines.append(ACT_PREFIX + act)
    lines.append(OBS_PREFIX + observation)
    return "\n".join(lines)


def _longest_prefix(text: str, fits: Callable[[str], bool]) -> str:
    """The longest prefix of `text` that `fits`, by binary search over its length ("" if none does).

    Token counts grow (almost) monotonically with the prefix length; the result is checked, so a
    non-monotone counter can only make the prefix shorter than it could be, never too long.
    """
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(text[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def render_state(
    task: str | None,
    turns: Sequence[tuple[str, str]],
    observation: str,
    k: int = DEFAULT_K,
    max_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
    keep_opening: bool = False,
) -> str:
    """State text of a decision: the task, the last `k` (observation, action) turns, the current observation.

        Task: <task>
        [obs] <observation of turn t-k>
        [act] <action of turn t-k>
        ...
        [obs] <current observation>

    The task line is left out when there is no task, or when an observation shown starts with it
    (chat logs whose task is their first user message). With `max_tokens` and `count_tokens` (e.g.
    `TextEncoder.count_tokens` and its `max_length`), a text that is too long loses its oldest turns
    first, because an encoder truncates from the end and would otherwise cut the current observation;
    with no turns left, the task is cut to half the budget and the observation to what remains, both
    keeping their start.

    With `keep_opening`, the episode's first turn stays in the text after it has left the last k: in
    many logs the task is a system prompt and what the user wants is only in the first observation
    ("I was charged twice and my package never arrived"), which a window of the last few turns loses
    within a few steps. Over budget, the opening is dropped after every other earlier turn.

    The same arguments always give the same text: `offline-agent embed` renders
    with `max_tokens=encoder.max_length, count_tokens=encoder.count_tokens`, and decision-time states
    rendered the same way hit the embeddings of the logged ones.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    turns = turns if isinstance(turns, list | tuple) else list(turns)  # a whole episode's turns: no copy
    recent = list(turns[-k:]) if k else []
    opening = list(turns[:1]) if keep_opening and len(turns) > len(recent) else []
    text = _render(task, opening + recent, observation)
    if max_tokens is None or count_tokens is None:
        return text
    while (opening or recent) and count_tokens(text) > max_tokens:
        if recent:
            recent = recent[1:]
        else:
            opening = []
        text = _render(task, opening + recent, observation)
    if count_tokens(text) <= max_tokens:
        return text

    def fits(budget: int) -> Callable[[str], bool]:
        return lambda candidate: count_tokens(candidate) <= budget

    if task and not fits(max_tokens // 2)(_render(task, [], "")):
        task = _longest_prefix(task, lambda t: fits(max_tokens // 2)(_render(t, [], "")))
    observation = _longest_prefix(observation, lambda o: fits(max_tokens)(_render(task, [], o)))
    text = _render(task, [], observation)
    if task and not fits(max_tokens)(text):  # a budget smaller than the template itself
        text = _render(
            _longest_prefix(task, lambda t: fits(max_tokens)(_render(t, [], observation))), [], observation
        )
    return text


class DatasetTexts(NamedTuple):
    """Every text of a dataset the learner embeds."""

    #: state text of each step, aligned with the rows of `TrajectoryDataset.steps_table()`
    states: list[str]
    #: action text of each step, aligned the same way
    actions: list[str]
    #: the distinct candidate actions of all steps, sorted
    candidates: list[str]


def dataset_texts(
    ds: TrajectoryDataset | str | Path,
    k: int = DEFAULT_K,
    max_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
    keep_opening: bool = False,
) -> DatasetTexts:
    """Render the state of every step (its episode's task + the previous k turns, and with `keep_opening` its
    first turn, + its observation) with `render_state`, and collect the action and candidate texts."""
    from offline_agent.dataset import TrajectoryDataset

    if not isinstance(ds, TrajectoryDataset):
        ds = TrajectoryDataset.open(ds)
    steps = ds.steps_table(columns=["episode_id", "step", "observation", "action", "candidates"])
    episodes = ds.episodes_table().select(["episode_id", "task"]).to_pydict()
    task_of = dict(zip(episodes["episode_id"], episodes["task"], strict=True))
    cols = steps.select(["episode_id", "observation", "action"]).to_pydict()
    states: list[str] = []
    turns: list[tuple[str, str]] = []
    current = None
    for episode_id, observation, action in zip(
        cols["episode_id"], cols["observation"], cols["action"], strict=True
    ):
        if episode_id != current:
            current, turns = episode_id, []
        states.append(
            render_state(task_of.get(episode_id), turns, observation, k, max_tokens, count_tokens, keep_opening)
        )
        turns.append((observation, action))
    # Flattening in Arrow skips null lists (steps whose log did not know the candidates).
    flat = pc.list_flatten(steps.column("candidates")).drop_null()
    candidates = sorted(set(flat.to_pylist()))
    return DatasetTexts(states, cols["action"], candidates)
