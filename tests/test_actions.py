import pytest

from offline_agent.actions import (
    MESSAGE,
    TOOL_CALL,
    ActionError,
    canonical_action,
    parse_action,
    tool_call_text,
)


def test_tool_call_canonical_text_sorts_argument_keys_and_puts_name_first():
    assert tool_call_text("book", {"b": 1, "a": {"z": 2, "y": [3, {"d": 4, "c": 5}]}}) == (
        '{"name":"book","arguments":{"a":{"y":[3,{"c":5,"d":4}],"z":2},"b":1}}'
    )


def test_the_same_call_written_four_ways_is_one_action():
    forms = [
        {"name": "f", "arguments": {"x": 1, "y": "a"}},
        {"name": "f", "arguments": '{"y": "a", "x": 1}'},
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"y":"a","x":1}'}},
        {"type": "tool_use", "id": "tu_1", "name": "f", "input": {"y": "a", "x": 1}},
    ]
    assert len({canonical_action(f) for f in forms}) == 1


def test_strings_are_messages_kept_verbatim():
    assert canonical_action("  ls -la\n") == "  ls -la\n"
    assert parse_action("ls -la").kind == MESSAGE


def test_parse_action_inverts_a_tool_call():
    parsed = parse_action(tool_call_text("move", {"to": "B"}))
    assert (parsed.kind, parsed.tool_name, parsed.tool_args) == (TOOL_CALL, "move", {"to": "B"})


def test_empty_arguments_are_an_empty_object():
    assert tool_call_text("restart", "") == tool_call_text("restart", None) == '{"name":"restart","arguments":{}}'


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ({"name": "f", "arguments": "{not json"}, "not valid JSON"),
        ({"name": "f", "arguments": "[1, 2]"}, "must be a JSON object"),
        ({"name": "", "arguments": {}}, "non-empty string name"),
        (42, "must be a string or a tool call"),
    ],
)
def test_bad_actions_say_what_is_wrong(action, message):
    with pytest.raises(ActionError, match=message):
        canonical_action(action)
