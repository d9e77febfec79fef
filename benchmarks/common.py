"""What every benchmark shares: the machine stamp and writing a results table where the README finds it."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
#: The behaviour policy of the bundled logs (datasets/README.md), and of the logs the benchmarks simulate anew.
BEHAVIOUR = "noisy:0.5"
#: Real agent logs nobody on this team wrote, beside the checkout (each with a SOURCE.txt); absent on CI.
REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "real"
#: The real logs the benchmarks learn from: name -> (source, reward spec of `ingest`).
REAL_SOURCES = {
    "τ-bench airline": (REAL / "tau_bench_airline" / "gpt-4o-airline.json", "outcome"),
    "InterCode SQL": (REAL / "intercode" / "sql_gpt-4", "score-delta"),
    "InterCode bash": (REAL / "intercode" / "bash_gpt-4", "score-delta"),
}


def machine_stamp() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores, {cpu}, Python {platform.python_version()}, {dt.date.today().isoformat()}"


def write_result(name: str, title: str, table: str, command: str) -> Path:
    """Write `benchmarks/results/<name>.md`: a heading, the machine stamp, the table, how to reproduce."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    text = f"### {title}\n\nMachine: {machine_stamp()}. Reproduce: `{command}`.\n\n{table.strip()}\n"
    path.write_text(text)
    print(text)
    return path


def reproduce_command(script: str, leave_out: tuple[str, ...] = ("--tables-only",)) -> str:
    """The command line that ran `script`, quoted for a shell, without the flags in `leave_out` (those that
    only reuse a cache: the reproduced run must measure anew)."""
    return shlex.join(["python", f"benchmarks/{script}", *(a for a in sys.argv[1:] if a not in leave_out)])


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
