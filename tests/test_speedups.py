"""The compiled module `offline_agent._speedups` gives what the Python it replaces gives, value for value."""

from __future__ import annotations

import copy
import random
import shutil
import sysconfig
from pathlib import Path

import pytest

from offline_agent.dataset import _digest_bytes, _digest_bytes_python
from offline_agent.ingest import openai_chat
from offline_agent.ingest.writer import _extend_columns_python, _json
from tests.test_ingest_fast import _records

speedups = pytest.importorskip("offline_agent._speedups", reason="the C extension was not built (no compiler)")

ROLES = ["system", "developer", "user", "assistant", "tool", "function", "critic", None, 3]
ODD_VALUES = [None, 0, 1, "", "x", "Error: odd", " failed", "traceback: t", "exception", "fine", "\u3000error",
              '{"name": "t"}', [], [1], {}, {"a": 1}, True, 2.5]
KEYS = ["role", "content", "tool_calls", "tool_call_id", "function", "id", "name", "arguments",
        "is_error", "reward", "score", "info", "candidates"]


def test_the_extension_is_built_where_a_compiler_is():
    # `setup.py` marks the extension optional, so a failed build would pass unseen and ingestion would
    # quietly run at the Python walk's speed; where the tools are, the build must have worked.
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers.exists():
        pytest.skip("no C compiler or Python headers here")
    assert openai_chat.walk is speedups.walk


def _message_lists() -> list[list]:
    lists = []
    for record in _records():
        if isinstance(record, dict):
            messages = record.get("messages", record.get("traj"))
            if isinstance(messages, list):
                lists.append(messages)
    return lists


def _mutate(messages: list, rng: random.Random) -> list:
    """One random change that may or may not keep a message list plain."""
    messages = copy.deepcopy(messages)
    if not messages:
        return [rng.choice(ODD_VALUES)]
    i = rng.randrange(len(messages))
    target = messages[i]
    calls = target.get("tool_calls") if isinstance(target, dict) else None
    if isinstance(calls, list) and calls and rng.random() < 0.5:  # reach into a tool call
        call = calls[rng.randrange(len(calls))]
        if isinstance(call, dict) and isinstance(call.get("function"), dict) and rng.random() < 0.5:
            call = call["function"]
        target = call
    what = rng.randrange(6)
    if what == 0 and isinstance(target, dict) and target:
        del target[rng.choice(list(target))]
    elif what == 1 and isinstance(target, dict):
        target[rng.choice(KEYS)] = rng.choice(ODD_VALUES + ROLES)
    elif what == 2:
        messages.insert(rng.randrange(len(messages) + 1), copy.deepcopy(messages[i]))
    elif what == 3:
        del messages[i]
    elif what == 4 and isinstance(target, dict):
        target["role"] = rng.choice(ROLES)
    else:
        messages[i] = rng.choice(ODD_VALUES)
    return messages


def _both(messages: list) -> tuple:
    python_calls: dict = {}
    compiled_calls: dict = {}
    expected = openai_chat.walk_messages(messages, python_calls)
    got = speedups.walk(messages, compiled_calls)
    return expected, got, python_calls, compiled_calls


def test_the_compiled_walk_equals_the_python_walk_on_every_record_shape():
    lists = _message_lists()
    assert len(lists) >= 20
    for messages in lists:
        expected, got, python_calls, compiled_calls = _both(messages)
        assert got == expected, messages
        assert compiled_calls == python_calls


def test_the_compiled_walk_equals_the_python_walk_on_random_mutations():
    rng = random.Random(0)
    lists = _message_lists()
    outcomes = {"plain": 0, "not plain": 0}
    for _ in range(3000):
        messages = rng.choice(lists)
        for _ in range(rng.randint(1, 3)):
            messages = _mutate(messages, rng)
        expected, got, python_calls, compiled_calls = _both(messages)
        assert got == expected, messages
        assert compiled_calls == python_calls
        outcomes["plain" if expected is not None else "not plain"] += 1
    assert min(outcomes.values()) > 300, outcomes  # both branches exercised, not just one


@pytest.mark.parametrize("text", [s for s in ODD_VALUES if isinstance(s, str)] + ["Traceback", "\tEXCEPTION", "e", "t"])
def test_the_compiled_walk_flags_the_same_results_as_errors(text):
    for messages in _message_lists():
        messages = copy.deepcopy(messages)
        for message in messages:
            if isinstance(message, dict) and message.get("role") in ("tool", "user", "assistant"):
                message["content"] = text
        expected, got, _, _ = _both(messages)
        assert got == expected, messages


def test_the_walk_checks_its_arguments():
    with pytest.raises(TypeError):
        speedups.walk("not a list", {})
    with pytest.raises(TypeError):
        speedups.walk([], [])


@pytest.mark.parametrize(
    "rewards",
    [[0.0, -0.0, 1.0], [1e-7, 0.5, 123456789.0], [float("nan"), float("inf"), 2 / 3], [0, 1, True],
     [-1e300, 5e-324, 7]],
)
def test_the_compiled_digest_bytes_equal_the_python_ones(rewards):
    actions = ["a", '{"name":"t","arguments":{}}', "é ü"]
    observations = ["", "obs\x00with nul", "\U0001f600"]
    for episode_id in ("e", "é-1", ""):
        expected = _digest_bytes_python(episode_id, actions, observations, rewards)
        assert speedups.digest_bytes(episode_id, actions, observations, rewards) == expected
        assert _digest_bytes(episode_id, actions, observations, rewards) == expected
        # A lone surrogate has no UTF-8 of its own: the compiled copy says so, and Python's encoder takes over.
        with_surrogate = [*actions[:2], "é \ud800"]
        assert speedups.digest_bytes(episode_id, with_surrogate, observations, rewards) is None
        expected = _digest_bytes_python(episode_id, with_surrogate, observations, rewards)
        assert _digest_bytes(episode_id, with_surrogate, observations, rewards) == expected


def test_the_compiled_digest_bytes_reject_what_python_would_not_hash():
    with pytest.raises(ValueError, match="one entry per step"):
        speedups.digest_bytes("e", ["a"], [], [])
    with pytest.raises(TypeError, match="strings"):
        speedups.digest_bytes("e", [None], ["o"], [0.0])
    with pytest.raises(UnicodeEncodeError):  # as episode_id.encode() would
        speedups.digest_bytes("\ud800", [], [], [])
    assert speedups.digest_bytes("e", [], [], []) == b"e"


def _episode_columns(n: int, truncated: bool, infos: list) -> tuple:
    return (f"ep-{n}", [f"o{i}" for i in range(n)], [f"a{i}" for i in range(n)], ["tool_call"] * n,
            [f"t{i}" for i in range(n)], [None] * n, [i % 2 == 0 for i in range(n)], infos,
            [0.0] * (n - 1) + [1.5], truncated, 7)


@pytest.mark.parametrize("n, truncated, infos", [
    (1, False, [None]),
    (1, True, [{}]),
    (3, False, [None, {"assistant_text": "x"}, {}]),
    (4, True, [{"final_observation": "é"}, None, None, {"k": [1, None]}]),
])
def test_the_compiled_column_append_equals_the_python_one(n, truncated, infos):
    expected = tuple([f"old{i}"] for i in range(14))  # appended to lists that already hold a row
    got = tuple([f"old{i}"] for i in range(14))
    _extend_columns_python(expected, *_episode_columns(n, truncated, infos), _json)
    speedups.extend_columns(got, *_episode_columns(n, truncated, infos), _json)
    assert got == expected
    assert expected[8][1:] == [False] * (n - 1) + [not truncated] and expected[9][-1] == truncated


def test_the_compiled_column_append_rejects_ragged_columns():
    lists = tuple([] for _ in range(14))
    columns = list(_episode_columns(3, False, [None] * 3))
    columns[1] = ["only one observation"]
    with pytest.raises(ValueError, match="one length"):
        speedups.extend_columns(lists, *columns, _json)
    with pytest.raises(TypeError, match="14 lists"):
        speedups.extend_columns(lists[:13], *_episode_columns(3, False, [None] * 3), _json)
