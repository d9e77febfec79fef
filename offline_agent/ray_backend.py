"""The Ray backend: where work outgrows one machine (rollouts, ingestion, embedding).

Ray is an optional extra (`pip install 'offline-agent[ray]'`). Nothing outside this module imports it at
module level, so without `--backend ray` Ray is never imported. Every verb that runs on Ray takes
`backend` ("local" | "ray") and `ray_address`:

- None: use the Ray already initialised in this process, else start a local one on this machine (shut down
  again when the work is done);
- "auto": join the cluster this machine belongs to (`ray start --head` ran here or `RAY_ADDRESS` is set);
- "HOST:PORT" or "ray://HOST:PORT": join that cluster.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from offline_agent.errors import UserError

BACKENDS = ("local", "ray")
INSTALL_HINT = "pip install 'offline-agent[ray]'"
#: Environment of every Ray worker this process starts: no hub look-ups, no usage report, one BLAS thread
#: (a worker is one task; Ray gives it one CPU).
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}


def check_backend(backend: str) -> str:
    """`backend` if it is one of BACKENDS, else a UserError naming the choices."""
    if backend not in BACKENDS:
        raise UserError(f"unknown --backend {backend!r}: use local or ray")
    return backend


def require_ray() -> Any:
    """The `ray` module, or a one-line UserError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError(f"--backend ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


@contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None) -> Iterator[Any]:
    """The `ray` module, connected. Shuts Ray down on exit only if it was started here.

    `address` as in this module's docstring; `num_cpus` caps a local Ray started here (default: every core).
    """
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # read when Ray starts: no report over the network
    options: dict[str, Any] = {
        "runtime_env": {"env_vars": WORKER_ENV},
        "include_dashboard": False,
        "log_to_driver": True,
        "configure_logging": False,
    }
    if address is None:
        options["num_cpus"] = num_cpus
    try:
        ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = "a local Ray" if address is None else f"the Ray cluster at {address!r}"
        raise UserError(
            f"could not start or reach {where}: {' '.join(str(exc).split())[:200]} "
            "(for a cluster, run `ray start --head` first and pass --ray-address auto)"
        ) from None
    try:
        yield ray
    finally:
        ray.shutdown()
