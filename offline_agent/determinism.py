"""Bit-reproducible torch: deterministic kernels (and, where asked, a fixed thread count) while a block runs.

Every trainer here is seeded, but a seed is not enough on a CPU with more than one thread: the backward of
advanced indexing (`x[idx]`, an `index_put_` with accumulation) adds rows in whatever order the threads finish,
so two runs of the same seed drift apart in the last bits and, after a few thousand gradient steps, end as
different policies (the offline stage of the online benchmark trained from the same data gave greedy success
0.80 one time and 0.90 another). Torch's deterministic algorithms add them in a fixed order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def deterministic_torch(threads: int | None = None) -> Iterator[None]:
    """Deterministic kernels, and `threads` torch threads unless None, for the duration (both are process-wide).

    Also usable as a decorator (`@deterministic_torch()`). On CPU every kernel the learners use has a
    deterministic implementation. On CUDA, cuBLAS needs a fixed workspace (set here unless the user set one),
    and an op without a deterministic kernel warns instead of failing the run: bit-exact results are guaranteed
    on CPU, best effort on a GPU.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    old_threads, old_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    if threads is not None:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_deterministic, warn_only=old_warn)
