"""A user's `module:function` is imported the same way for every option that takes one."""

from __future__ import annotations

import pytest

from offline_agent.errors import UserError
from offline_agent.plugins import load_user_function


def test_a_module_next_to_the_user_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_judges_xyz.py").write_text("def judge(observation, action):\n    return 'no'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p != str(tmp_path)])
    assert load_user_function("my_judges_xyz", "judge", "a test")(None, None) == "no"


@pytest.mark.parametrize(
    ("source", "attr", "message"),
    [
        (None, "f", r"cannot import module 'absent_module_xyz' for the test: run from the directory that holds "
                    r"it, or add that directory to PYTHONPATH"),
        ("import absent_dependency_xyz\n", "f", r"importing 'broken_xyz' for the test failed: "
                                                r"ModuleNotFoundError: No module named 'absent_dependency_xyz'"),
        ("raise RuntimeError('half-written')\n", "f", r"importing 'broken_xyz' for the test failed: "
                                                      r"RuntimeError: half-written"),
        ("f = 3\n", "f", r"module 'broken_xyz' has no function 'f' for the test"),
    ],
)
def test_each_failure_is_one_line_saying_what_to_do(tmp_path, monkeypatch, source, attr, message):
    monkeypatch.chdir(tmp_path)
    name = "absent_module_xyz"
    if source is not None:
        name = "broken_xyz"
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    with pytest.raises(UserError, match=message) as caught:
        load_user_function(name, attr, "the test")
    assert "\n" not in str(caught.value)
