"""The quickstart notebook runs top to bottom, as a newcomer would run it."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from tests.conftest import REPO


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's own inline backend, as in Jupyter
    notebook = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}})
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "episodes" in text and "success" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    kinds = [(o.output_type, sorted(o.get("data", {}))) for o in outputs]
    assert images, f"the notebook ends with a plot; outputs were {kinds}"
