"""Shared fixtures: the real agent logs in ../shared (tests using them skip when it is absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

REPO = Path(__file__).resolve().parents[1]
REAL = REPO.parent / "shared" / "data" / "real"


@pytest.fixture
def real_data() -> Path:
    if not REAL.is_dir():
        pytest.skip("../shared/data/real is absent (real agent logs live beside the checkout, not in it)")
    return REAL


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: two cores shared by several test processes run faster without contention."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
