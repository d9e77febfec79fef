"""A user's own code named as `module.path:function`: custom adapters, environments, safety judges, potentials.

One way to import it, so that every `module:function` option behaves alike: the current directory
is on the import path (users run the CLI next to their module, as they would `python -c "import
my_module"`), and a failure is a one-line `UserError` that says what was being loaded, what went
wrong (a missing module, or an error raised while importing it) and what to do.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from offline_agent.errors import UserError


def import_user_module(module_name: str, what: str) -> ModuleType:
    """Import `module_name` for `what` (e.g. "environment spec 'my_env:make'")."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only the module itself (or a parent package) missing means "not on the path"; a module that is
        # found but imports something missing is an error inside it.
        if exc.name == module_name or module_name.startswith(f"{exc.name}."):
            raise UserError(
                f"cannot import module {module_name!r} for {what}: run from the directory that holds it, "
                "or add that directory to PYTHONPATH"
            ) from None
        raise UserError(f"importing {module_name!r} for {what} failed: {describe(exc)}") from None
    except Exception as exc:
        raise UserError(f"importing {module_name!r} for {what} failed: {describe(exc)}") from None


def load_user_function(module_name: str, attr: str, what: str) -> Callable[..., Any]:
    """The callable `module_name:attr`, for `what`."""
    function = getattr(import_user_module(module_name, what), attr, None)
    if not callable(function):
        raise UserError(f"module {module_name!r} has no function {attr!r} for {what}")
    return function


def describe(exc: BaseException) -> str:
    """`Type: message` on one line, cut to 300 characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
