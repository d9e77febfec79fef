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


@pytest.fixture(scope="session")
def local_ray(tmp_path_factory):
    """A real local Ray (2 CPUs) shared by the session's Ray tests; they skip where the extra is not installed.

    Its session files go to a short folder under /tmp (Ray's socket paths must stay under 108 characters, which
    pytest's tmp paths can exceed) that is removed afterwards; token auth is off so nothing is written to ~/.ray.
    Workers see the repository and tests/ on their path, for the test modules they import (user envs).
    """
    pytest.importorskip("ray", reason="Ray tests need the extra: pip install 'offline-agent[ray]'")
    import shutil

    from offline_agent.ray_backend import WORKER_ENV
    from tests.helpers import ray_folder, start_test_ray

    folder = ray_folder()
    path = os.pathsep.join([str(REPO), str(REPO / "tests")])
    ray = start_test_ray(folder, runtime_env={"env_vars": {**WORKER_ENV, "PYTHONPATH": path}})
    yield ray
    ray.shutdown()
    shutil.rmtree(folder, ignore_errors=True)
