"""Turning a stream of chat events into steps: the part every conversational log format shares.

A conversation is a sequence of three kinds of events: something the agent
observes (a user message, a tool result), something it does (a tool call or a
message), and a tool result that answers an earlier call. `EpisodeBuilder`
takes them in order and produces `Step`s whose observation is everything the
agent received since its previous action. Tool results are matched to calls by
id, and by position where ids repeat (τ-bench reuses ids across turns).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from offline_agent.schema import Step


class RecordError(ValueError):
    """A record that cannot become an episode; the message is the quarantine reason."""


class EpisodeBuilder:
    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._pending: list[str] = []
        # call id -> queue of step indices still waiting for their result (FIFO, since ids may repeat)
        self._open_calls: dict[str | None, deque[int]] = {}

    def observe(self, text: str) -> None:
        # Empty texts are kept as received (an empty tool result is still a result) and
        # dropped only when joining, so they add no blank lines.
        self._pending.append(text)

    def _observation(self) -> str:
        return "\n".join(t for t in self._pending if t)

    def act(
        self,
        action: str,
        call_id: str | None = None,
        candidates: list[str] | None = None,
        info: dict[str, Any] | None = None,
        expects_result: bool = False,
    ) -> Step:
        step = Step(observation=self._observation(), action=action, candidates=candidates, info=info or {})
        self._pending = []
        self.steps.append(step)
        if expects_result:
            self._open_calls.setdefault(call_id, deque()).append(len(self.steps) - 1)
        return step

    def result(
        self,
        call_id: str | None,
        text: str,
        is_error: bool = False,
        reward: float | None = None,
        score: float | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        """Attach a tool result to the call it answers; its text becomes part of the next observation."""
        queue = self._open_calls.get(call_id)
        if not queue and call_id is not None and None in self._open_calls:
            queue = self._open_calls[None]
        if not queue:
            raise RecordError(
                f"a tool result (tool_call_id={call_id!r}) has no matching tool call before it: "
                "check that the assistant message with that call is in the record"
            )
        step = self.steps[queue.popleft()]
        self.set_outcome(step, is_error, reward, score, info)
        self.observe(text)

    @staticmethod
    def set_outcome(
        step: Step, is_error: bool, reward: float | None, score: float | None, info: dict[str, Any] | None
    ) -> None:
        step.is_error = step.is_error or is_error
        if reward is not None:
            step.reward = (step.reward or 0.0) + float(reward)
        if score is not None:
            step.score = float(score)
        if info:
            step.info.update(info)

    def finish(self) -> list[Step]:
        """The steps; text received after the last action is kept on the last step as `final_observation`."""
        if not self.steps:
            raise RecordError("the record has no agent actions (no assistant messages or tool calls)")
        if self._pending:
            self.steps[-1].info["final_observation"] = self._observation()
        return self.steps


def looks_like_error(text: str) -> bool:
    """Tool results that report a failure in their text, as most agent stacks do ("Error: ...")."""
    # Most results start with neither a space nor e/f/t (the words' initials), and no other character
    # lowercases to one of those, so they are settled without copying the text.
    if not text or (text[0] not in "eEfFtT" and not text[0].isspace()):
        return False
    head = text.lstrip()[:40].lower()
    return head.startswith(("error", "exception", "traceback", "failed"))


def get_path(record: Any, dotted: str) -> Any:
    """`record["a"]["b"]` for `a.b`; KeyError names the missing part."""
    value = record
    for part in dotted.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise KeyError(dotted)
    return value


def first_present(record: dict, names: tuple[str, ...]) -> Any:
    for name in names:
        try:
            return get_path(record, name)
        except KeyError:
            continue
    return None


def as_float(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    raise RecordError(f"field {what!r} must be a number, got {type(value).__name__} {value!r:.60}")


def text_of(content: Any) -> str:
    """Message content as text: a string, or a list of content parts (OpenAI/Anthropic style)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and "content" in part:
                parts.append(text_of(part["content"]))
        return "\n".join(parts)
    raise RecordError(f"message content must be a string or a list of parts, got {type(content).__name__}")
