"""Schema v1 of a trajectory dataset: the Arrow schemas of its tables and the canonical episode.

An adapter (one per log format, or a user's own) turns raw records into
`Episode` objects; the writer turns those into rows of `STEPS_SCHEMA` and
`EPISODES_SCHEMA`. A record that cannot become an episode becomes a
`Quarantined` row instead, so that nothing read is ever lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 1

STEPS_SCHEMA = pa.schema(
    [
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("observation", pa.string(), nullable=False),
        pa.field("action", pa.string(), nullable=False),
        pa.field("action_kind", pa.string(), nullable=False),
        pa.field("tool_name", pa.string()),
        pa.field("tool_args", pa.string()),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("return_to_go", pa.float32(), nullable=False),
        pa.field("terminated", pa.bool_(), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
        pa.field("is_error", pa.bool_(), nullable=False),
        pa.field("candidates", pa.list_(pa.string())),
        pa.field("info", pa.string()),
    ]
)

EPISODES_SCHEMA = pa.schema(
    [
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("task", pa.string()),
        pa.field("agent", pa.string()),
        pa.field("n_steps", pa.int32(), nullable=False),
        pa.field("return", pa.float32(), nullable=False),
        pa.field("success", pa.bool_()),
        pa.field("outcome", pa.float64()),
        pa.field("split", pa.string(), nullable=False),
        pa.field("metadata", pa.string()),
    ]
)

QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string(), nullable=False),
        pa.field("location", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("raw", pa.string()),
    ]
)

#: What each column means; the schema tables of docs/dataset.md are written from this.
COLUMN_DOCS: dict[str, dict[str, str]] = {
    "steps": {
        "episode_id": "the episode this step belongs to (stable: derived from source and record)",
        "step": "0-based index of the decision within its episode",
        "observation": "what the agent had just received before acting (user/tool messages, env text)",
        "action": "canonical action text: compact JSON {name, arguments} for a tool call, else the text",
        "action_kind": "tool_call | message | final (the last message of an episode that ends in text)",
        "tool_name": "the tool's name for a tool call, else null",
        "tool_args": "the tool call's arguments as sorted-key JSON, else null",
        "reward": "reward of this step under the dataset's reward spec",
        "return_to_go": "discounted sum of rewards from this step to the end, with the dataset's gamma",
        "terminated": "true on the last step of an episode that ended (task done or failed)",
        "truncated": "true on the last step of an episode cut off before it ended",
        "is_error": "the action produced an error observation",
        "candidates": "the valid actions at this step in canonical text, when the log knows them; else null",
        "info": "JSON of anything else the log had for this step (tool result, score, sub-goals)",
    },
    "episodes": {
        "episode_id": "unique id of the episode",
        "source": "file the episode came from (as given on the command line)",
        "task": "the task or instruction the agent was given",
        "agent": "the model or agent that produced the log, when known",
        "n_steps": "number of rows in steps",
        "return": "undiscounted sum of the episode's rewards",
        "success": "outcome >= success threshold (null when the log has no outcome)",
        "outcome": "the log's own score of the episode (reward, grade, max score), null where absent",
        "split": "train | valid | test, from a hash of episode_id",
        "metadata": "JSON of the record's other fields",
    },
    "quarantine": {
        "source": "file the record came from",
        "location": "line (JSONL), index or key (JSON) of the record in that file",
        "reason": "why the record could not be read, and what to do",
        "raw": "the record's raw text (invalid UTF-8 bytes replaced), so nothing is lost",
    },
}


@dataclass
class Step:
    """One decision in the canonical form adapters produce.

    `action` is the canonical action text (see `offline_agent.actions`).
    `reward` is the log's own step reward, `score` the log's running score
    (InterCode style); which one becomes the dataset's reward is the
    `--reward` choice at ingest.
    """

    observation: str
    action: str
    reward: float | None = None
    score: float | None = None
    is_error: bool = False
    candidates: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One episode in canonical form: what every adapter yields."""

    episode_id: str
    steps: list[Step]
    task: str | None = None
    agent: str | None = None
    outcome: float | None = None
    #: set only where the log states success itself; otherwise it is derived from `outcome` at ingest
    success: bool | None = None
    truncated: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    #: how many raw records this episode was made from (1, or one per step for per-step logs);
    #: the ingest summary reconciles records read against these and the quarantine
    records: int = 1

    @property
    def n_steps(self) -> int:
        return len(self.steps)


@dataclass(slots=True)
class ColumnarEpisode:
    """An episode already laid out as step columns, for adapters on a hot path (no `Step` per step).

    Its steps carry no log rewards or scores (the dataset reward comes from `outcome`
    alone) and no candidates; `infos` holds each step's info dict or None.
    """

    episode_id: str
    observations: list[str]
    actions: list[str]
    action_kinds: list[str]
    tool_names: list[str | None]
    tool_args: list[str | None]
    is_error: list[bool]
    infos: list[dict[str, Any] | None]
    task: str | None = None
    agent: str | None = None
    outcome: float | None = None
    success: bool | None = None
    truncated: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    records: int = 1

    @property
    def n_steps(self) -> int:
        return len(self.actions)


@dataclass
class Quarantined:
    """A record that could not be read: where it was, why, and its raw text."""

    location: str
    reason: str
    raw: str | None = None


def schema_markdown() -> str:
    """docs/dataset.md's column tables, written from the schemas and `COLUMN_DOCS` so they cannot drift apart."""
    parts = []
    for table, schema in (("steps", STEPS_SCHEMA), ("episodes", EPISODES_SCHEMA), ("quarantine", QUARANTINE_SCHEMA)):
        parts.append(f"`{table}`\n\n| column | type | meaning |\n|---|---|---|")
        for f in schema:
            parts.append(f"| `{f.name}` | {f.type} | {COLUMN_DOCS[table][f.name]} |")
        parts.append("")
    return "\n".join(parts).strip()
