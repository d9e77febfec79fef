"""State text: how a decision's task, recent turns and observation become one text, and a dataset's texts.

`render_state` is the one function that turns (task, recent turns, observation) into state text, used both
over logged datasets and at decision time in an environment, so that a decision-time state hits the
embedding of the logged one. `StateSettings` is how it renders (turns of history, token budget, the opening
turn) and whether the current observation is also embedded on its own; a policy's checkpoint records them
(`to_meta`, `from_meta`). `dataset_texts` renders every step of a dataset and collects its action and
candidate texts. `current_observation` reads a state's current observation back (the observation view:
`observation_views`), as `offline_agent.learn.grounding` reads its turns, by the line prefixes below.

Dimension letters: N texts, D embedding width.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow.compute as pc

from offline_agent.errors import UserError

if TYPE_CHECKING:
    from offline_agent.dataset import TrajectoryDataset

#: Turns of history (observation, action) a state text shows by default (`render_state`'s k).
DEFAULT_K = 3
#: The line prefixes of a rendered state (`render_state`); `offline_agent.learn.grounding` and the
#: observation view (`current_observation`) read states back by them.
TASK_PREFIX, OBS_PREFIX, ACT_PREFIX = "Task: ", "[obs] ", "[act] "
PREFIXES = (TASK_PREFIX, OBS_PREFIX, ACT_PREFIX)


@dataclass(frozen=True)
class StateSettings:
    """How a decision's state becomes text, and whether its current observation is also embedded on its own.

    One object from the CLI flags (`--k`, `--keep-opening`, `--observation-view`) to the features a learner
    trains on and the policy.json of its checkpoint, so that the policy renders its decision-time states as
    its training states were rendered. Frozen: two runs with equal settings render the same texts.

    The token counter is not a field: it is the encoder's tokenizer (`TextEncoder.count_tokens`), which is
    neither a value to compare nor one to save in a checkpoint, so it is passed beside the settings, with
    the encoder it belongs to. `max_tokens`, the budget it counts against, is the encoder's window
    (`for_encoder`), recorded here because a decision-time state must be cut to the budget the training
    states were cut to.
    """

    #: previous (observation, action) turns a state text shows (`--k`)
    k: int = DEFAULT_K
    #: tokens a state text may have (the encoder's max_length); None: no budget, texts are never cut
    max_tokens: int | None = None
    #: the episode's first turn stays in the text after it has left the last k (`--keep-opening`)
    keep_opening: bool = False
    #: the current observation is embedded on its own beside the whole text (`--observation-view`): the
    #: encoder's setting (`TextEncoder(observation_view=...)`), not the renderer's
    observation_view: bool = False
    #: each block of a state text (task, every observation and action) is embedded on its own and the state's
    #: vector is their mean (`--per-turn`, the default; `--whole-text` embeds the text in one pass): the
    #: encoder's setting (`TextEncoder(per_turn=...)`), not the renderer's. Consecutive states share all but
    #: their newest block, so a run encodes each block once. Checkpoints saved before it existed are whole-text.
    per_turn: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise UserError(f"k (--k, turns of history in a state text) must be an integer >= 0, got {self.k!r}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise UserError(
                f"max_tokens (the token budget of a state text) must be an integer >= 1 or None for no budget, "
                f"got {self.max_tokens!r}"
            )
        for name in ("keep_opening", "observation_view", "per_turn"):
            if not isinstance(getattr(self, name), bool):
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{name} ({flag}) must be True or False, got {getattr(self, name)!r}")

    def for_encoder(self, encoder: Any) -> StateSettings:
        """These settings as `encoder` renders them: its window (`max_length`) is the token budget when it can
        count tokens (`count_tokens`), and there is none when it cannot, nor per turn: there each block is
        encoded on its own and cut to the window by itself, so the current observation never loses its place to
        older turns, and a state keeps its k turns. The encoder must have the observation view and per-turn
        setting these settings ask for (it is what implements them)."""
        has_view = bool(getattr(encoder, "observation_view", False))
        if has_view != self.observation_view:
            raise ValueError(
                f"the encoder has observation_view={has_view} but the state settings ask for "
                f"{self.observation_view}: build the encoder with observation_view={self.observation_view}"
            )
        per_turn = bool(getattr(encoder, "per_turn", False))
        if per_turn != self.per_turn:
            raise ValueError(
                f"the encoder has per_turn={per_turn} but the state settings ask for {self.per_turn}: build "
                f"the encoder with per_turn={self.per_turn}"
            )
        counts = getattr(encoder, "count_tokens", None) is not None
        return replace(self, max_tokens=encoder.max_length if counts and not self.per_turn else None)

    def to_meta(self) -> dict[str, Any]:
        """The settings as a checkpoint's policy.json keeps them: the flat keys k, max_tokens, keep_opening
        (as before this object existed), observation_view and per_turn, which the encoder's entry holds as well."""
        return {
            "k": self.k,
            "max_tokens": self.max_tokens,
            "keep_opening": self.keep_opening,
            "observation_view": self.observation_view,
            "per_turn": self.per_turn,
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> StateSettings:
        """The settings of a checkpoint's policy.json. A key it lacks (a checkpoint saved before the setting
        existed) takes the value those checkpoints were rendered with: k 3, no token budget, no opening turn,
        and the observation view and per-turn vectors as the encoder's entry records them (neither if it does
        not: whole-text vectors, the default until 2026-12-06)."""
        encoder = meta.get("encoder")
        views = ("observation_view", "per_turn")
        encoder_says = {name: encoder.get(name) if isinstance(encoder, Mapping) else None for name in views}
        said = {name: meta.get(name, value) for name, value in encoder_says.items()}
        for name, value in encoder_says.items():
            if value is not None and bool(said[name]) != bool(value):
                raise UserError(
                    f"policy.json says {name}={said[name]} but its encoder entry says {value}: "
                    "the checkpoint is damaged; retrain it"
                )
        k, max_tokens = meta.get("k", DEFAULT_K), meta.get("max_tokens")
        try:
            return cls(
                k=int(k),
                max_tokens=None if max_tokens is None else int(max_tokens),
                keep_opening=bool(meta.get("keep_opening", False)),
                observation_view=bool(said["observation_view"]),
                per_turn=bool(said["per_turn"]),
            )
        except (TypeError, ValueError, UserError) as exc:
            raise UserError(f"policy.json holds bad state settings ({exc}): the checkpoint is damaged") from None


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


def turn_blocks(text: str) -> list[str]:
    """The blocks of a rendered state text (`render_state`): its task line and each `[obs]` and `[act]` block,
    with their prefixes (a block keeps its own line breaks: a line that does not start with a prefix
    continues the block before it). A text that does not start with a prefix, such as an action, is one
    block."""
    if not text.startswith(PREFIXES):
        return [text]
    blocks: list[str] = []
    for line in text.split("\n"):
        if line.startswith(PREFIXES) or not blocks:
            blocks.append(line)
        else:
            blocks[-1] += "\n" + line
    return blocks


def per_turn_vectors(texts: list[str], one_view: Callable[[list[str]], np.ndarray]) -> np.ndarray:
    """The mean of the unit vectors of each text's blocks (`turn_blocks`), L2-normalised: (N, D). `one_view`
    embeds a list of texts (N, D) in one call; the distinct blocks of all `texts` are passed once, so a
    block that many states share (their task, their earlier turns) is embedded once. A one-block text (an
    action) keeps its own vector."""
    blocks = [turn_blocks(t) for t in texts]
    position = {block: i for i, block in enumerate(dict.fromkeys(b for bs in blocks for b in bs))}
    vectors = np.asarray(one_view(list(position)), dtype=np.float32)  # (distinct blocks, D)
    out = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
    for i, bs in enumerate(blocks):
        mean = vectors[[position[b] for b in bs]].mean(0)
        out[i] = mean / max(float(np.linalg.norm(mean)), 1e-12)
    return out


def state_views(
    texts: list[str], one_view: Callable[[list[str]], np.ndarray], per_turn: bool, observation_view: bool
) -> np.ndarray:
    """The vectors of `texts` as an encoder with these settings gives them, from `one_view`, the plain
    encoder's (N, D) vectors of a list of texts: per turn (`per_turn_vectors`) and/or with the observation
    view (`observation_views`)."""
    whole = (lambda ts: per_turn_vectors(ts, one_view)) if per_turn else one_view
    return observation_views(texts, whole) if observation_view else whole(texts)


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
    settings: StateSettings = StateSettings(),
    count_tokens: Callable[[str], int] | None = None,
) -> str:
    """State text of a decision: the task, the last `settings.k` (observation, action) turns, the current
    observation.

        Task: <task>
        [obs] <observation of turn t-k>
        [act] <action of turn t-k>
        ...
        [obs] <current observation>

    The task line is left out when there is no task, or when an observation shown starts with it
    (chat logs whose task is their first user message). With `settings.max_tokens` and `count_tokens` (e.g.
    `TextEncoder.count_tokens` and its `max_length`), a text that is too long loses its oldest turns
    first, because an encoder truncates from the end and would otherwise cut the current observation;
    with no turns left, the task is cut to half the budget and the observation to what remains, both
    keeping their start.

    With `keep_opening`, the episode's first turn stays in the text after it has left the last k: in
    many logs the task is a system prompt and what the user wants is only in the first observation
    ("I was charged twice and my package never arrived"), which a window of the last few turns loses
    within a few steps. Over budget, the opening is dropped after every other earlier turn.

    The same arguments always give the same text: `offline-agent embed` renders with
    `settings.for_encoder(encoder)` and `encoder.count_tokens`, and decision-time states rendered the same
    way hit the embeddings of the logged ones.
    """
    k, max_tokens, keep_opening = settings.k, settings.max_tokens, settings.keep_opening
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
    settings: StateSettings = StateSettings(),
    count_tokens: Callable[[str], int] | None = None,
) -> DatasetTexts:
    """Render the state of every step (its episode's task + the previous k turns, and with `keep_opening` its
    first turn, + its observation) with `render_state` under `settings` (and `count_tokens`, the encoder's,
    for their token budget), and collect the action and candidate texts."""
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
            render_state(task_of.get(episode_id), turns, observation, settings, count_tokens)
        )
        turns.append((observation, action))
    # Flattening in Arrow skips null lists (steps whose log did not know the candidates).
    flat = pc.list_flatten(steps.column("candidates")).drop_null()
    candidates = sorted(set(flat.to_pylist()))
    return DatasetTexts(states, cols["action"], candidates)
