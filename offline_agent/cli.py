"""The `offline-agent` command: one verb per stage of the pipeline, each a thin layer over library functions.

Each verb parses its flags, calls one library function and prints a summary.
Bad input raises `UserError` (or a ValueError from a config's validation),
which `main` turns into one line on stderr and exit code 2; a Python
traceback reaching the user is a bug.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import typer  # noqa: E402
from rich.console import Console  # noqa: E402

from offline_agent.errors import UserError  # noqa: E402

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Reinforcement learning on the logs of LLM agents: ingest, query, train, fine-tune, evaluate.",
)
console = Console(stderr=True)


# --- verbs are registered below, one section per stage ---------------------------------------------


def main() -> None:
    try:
        app(standalone_mode=False)
    except UserError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        console.print("aborted")
        sys.exit(130)
    except Exception as exc:  # click's usage errors
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
