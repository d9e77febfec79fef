"""The command-line reference (docs/cli.md), generated from the `offline-agent` command's own definitions.

Every verb, argument and option with its default and help text is read from the Typer app, so the reference
cannot drift from the parser: `python -m offline_agent.cli_docs` rewrites docs/cli.md, and a test regenerates
it and compares.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
HEADER = (
    "# Command-line reference\n\n"
    "Generated from the parser by `python -m offline_agent.cli_docs` (`make docs`); do not edit by hand. "
    "`offline-agent VERB --help` prints the same.\n"
)


def reference_markdown() -> str:
    """docs/cli.md: a section per verb, in the order `offline-agent --help` lists them."""
    import click
    import typer.main

    from offline_agent.cli import app

    group = typer.main.get_command(app)
    context = click.Context(group, info_name="offline-agent")
    verbs = [group.get_command(context, name) for name in group.list_commands(context)]
    index = " · ".join(f"[`{verb.name}`](#{verb.name})" for verb in verbs)
    return "\n".join([HEADER, index, "", *(_verb(verb) for verb in verbs)]).rstrip() + "\n"


def _verb(command: Any) -> str:
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    options = [p for p in command.params if p.param_type_name == "option"]
    usage = " ".join(["offline-agent", command.name, *(_argument_usage(a) for a in arguments), "[OPTIONS]"])
    lines = [f"## {command.name}", "", " ".join((command.help or "").split()), "", f"`{usage}`", ""]
    if arguments:
        lines += ["| argument | what |", "|---|---|"]
        lines += [f"| `{_argument_usage(a)}` | {_cell(a.help)} |" for a in arguments]
        lines.append("")
    if options:
        lines += ["| option | default | what |", "|---|---|---|"]
        lines += [f"| {_names(o)} | {_default(o)} | {_cell(o.help)} |" for o in options]
        lines.append("")
    return "\n".join(lines)


def _argument_usage(argument: Any) -> str:
    name = argument.name.upper()
    return f"{name}..." if argument.nargs == -1 else name


def _names(option: Any) -> str:
    names = [*option.opts, *option.secondary_opts]
    if option.is_flag:
        return ", ".join(f"`{n}`" for n in names)
    long = next((n for n in option.opts if n.startswith("--")), option.opts[0])
    value = long.lstrip("-").replace("-", "_").upper()  # the option's own name, not the Python parameter's
    return ", ".join(f"`{n}`" for n in names) + f" {value}" + (" (repeatable)" if option.multiple else "")


def _default(option: Any) -> str:
    if option.required:
        return "required"
    default = option.default
    if option.is_flag:
        return "on" if default else "off"
    if default is None or default == [] or default == ():
        return ""
    return f"`{default}`"


def _cell(text: str | None) -> str:
    """Help text as one table cell: one line, its pipes escaped."""
    return " ".join((text or "").split()).replace("|", "\\|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REFERENCE), help="where to write the reference")
    args = parser.parse_args()
    Path(args.out).write_text(reference_markdown())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
