"""Figures for run folders and reports, drawn without pyplot.

A library must not switch matplotlib's global backend (`matplotlib.use`) or
keep pyplot state: in a notebook that would silence the user's own inline
plots. A `Figure` on the Agg canvas draws to PNG in any thread, with or
without a display.
"""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path


def new_figure(width: float, height: float, layout: str | None = "constrained"):
    """A matplotlib Figure (Agg canvas) of `width` x `height` inches."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout=layout)


def figure_png(fig, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def save_png(fig, path: str | Path, dpi: int = 90) -> Path:
    """Write a figure as PNG atomically (temporary sibling, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{uuid.uuid4().hex[:8]}.png")
    try:
        fig.savefig(tmp, format="png", dpi=dpi)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
