"""Imports run one way: each layer of the package imports only from the layers below it.

Every `import` of every module is read with `ast`, function-level and `TYPE_CHECKING` imports included
(a function-level import is still a dependency; it only hides a cycle until the function runs).
The layers, bottom up: environments (`envs/`, with the safety filter) and text encoders (`text/`),
offline learners (`learn/`), online fine-tuning and the rollouts it shares with evaluation (`online/`),
then evaluation, reports and the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "offline_agent"
ABOVE_ONLINE = ("offline_agent.evaluate", "offline_agent.advise", "offline_agent.report", "offline_agent.cli")
ABOVE_LEARN = ("offline_agent.online", *ABOVE_ONLINE)
ABOVE_TEXT = ("offline_agent.learn", *ABOVE_LEARN)

#: (a package or module, what it must never import)
RULES = [
    ("offline_agent.text", ABOVE_TEXT),
    ("offline_agent.envs", ("offline_agent.text", *ABOVE_TEXT)),
    ("offline_agent.learn", ABOVE_LEARN),
    ("offline_agent.online", ABOVE_ONLINE),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module `source` imports anywhere (top level, in functions, under TYPE_CHECKING), as absolute
    dotted names; `from a import b` gives both `a` and `a.b` (b may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def modules() -> dict[str, set[str]]:
    return {
        module_name(path): imported_modules(
            path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py"
        )
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, imports in graph.items():
        for layer, forbidden in RULES:
            if not inside(module, layer):
                continue
            upward = {name for name in imports if any(inside(name, f) for f in forbidden)}
            # `from a.b import c` reads as a.b and a.b.c: name the module once
            out += [
                f"{module} imports {name} ({layer} is below it)"
                for name in sorted(upward)
                if name.rpartition(".")[0] not in upward
            ]
    return out


def test_the_import_reader_sees_function_level_relative_and_type_checking_imports():
    source = """
from typing import TYPE_CHECKING
from . import cache
if TYPE_CHECKING:
    from offline_agent.learn.policy import Policy
def f():
    import offline_agent.online.ppo
    from ..evaluate import summarize
"""
    found = imported_modules(source, "offline_agent.text.encoder", is_package=False)
    assert {"offline_agent.text.cache", "offline_agent.learn.policy", "offline_agent.online.ppo"} <= found
    assert "offline_agent.evaluate.summarize" in found
    graph = {"offline_agent.text.encoder": found, "offline_agent.learn.policy": {"offline_agent.text.cache"}}
    assert violations(graph) == [
        "offline_agent.text.encoder imports offline_agent.evaluate (offline_agent.text is below it)",
        "offline_agent.text.encoder imports offline_agent.learn.policy (offline_agent.text is below it)",
        "offline_agent.text.encoder imports offline_agent.online.ppo (offline_agent.text is below it)",
    ]


@pytest.mark.parametrize(("layer", "forbidden"), RULES, ids=[layer for layer, _ in RULES])
def test_no_layer_imports_a_layer_above_it(layer, forbidden):
    graph = modules()
    assert any(inside(module, layer) for module in graph), f"{layer} holds no module: the rule checks nothing"
    found = [v for v in violations(graph) if f"({layer} is below it)" in v]
    assert not found, "imports that run upward:\n" + "\n".join(found)

