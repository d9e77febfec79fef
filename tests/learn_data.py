"""Shared, built-once data of the offline-learner tests: ColorLock logs ingested as a dataset, and MiniLM.

Built lazily, once per test process, in a temporary folder; tests that write (runs, caches) copy the
dataset first or write next to it.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from learn_envs import SPEC

EPISODES = 200
BEHAVIOUR = "noisy:0.7"
REPO = Path(__file__).resolve().parents[1]
K = 0  # the ColorLock observation is the whole state; k = 0 keeps the texts to a few dozen


@functools.cache
def root() -> Path:
    path = Path(tempfile.mkdtemp(prefix="offline-agent-learn-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def encoder():
    """The default encoder: per-turn state vectors."""
    from offline_agent.text.encoder import TextEncoder

    return TextEncoder()


@functools.cache
def whole_text_encoder():
    """The encoder of whole-text state vectors (`--whole-text`, the default until 2026-12-06)."""
    from offline_agent.text.encoder import TextEncoder

    return TextEncoder(per_turn=False)


@functools.cache
def color_lock_dataset() -> Path:
    """ColorLock logs of the noisy expert, ingested; its embedding cache is filled by the first features."""
    from offline_agent.ingest import ingest
    from offline_agent.simulate import simulate

    logs = root() / "color_lock.jsonl"
    simulate(SPEC, EPISODES, BEHAVIOUR, 0, logs)
    out = root() / "color_lock"
    ingest([logs], out)
    return out


@functools.cache
def color_lock_features():
    from offline_agent.learn.features import build_features
    from offline_agent.text.states import StateSettings

    return build_features(color_lock_dataset(), encoder(), StateSettings(k=K))


@functools.cache
def pipeline_run(per_turn: bool = True) -> dict[str, Path]:
    """{"data": six bundled PipelineRepair episodes ingested, "run": CQL trained 20 steps on them (one thread)},
    on per-turn state vectors (the default) or, without `per_turn`, whole-text ones (`run-whole-text`)."""
    import torch

    from offline_agent.ingest import ingest
    from offline_agent.learn.train import train
    from offline_agent.text.states import StateSettings

    folder = root() / "pipeline"
    if not (folder / "data").exists():
        folder.mkdir()
        lines = (REPO / "datasets" / "pipeline" / "logs.jsonl").read_text().splitlines(keepends=True)
        (folder / "logs.jsonl").write_text("".join(lines[:6]))
        ingest([folder / "logs.jsonl"], folder / "data")
    run = folder / ("run" if per_turn else "run-whole-text")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(folder / "data", "cql", run, steps=20, batch_size=16, seed=0,
              encoder=encoder() if per_turn else whole_text_encoder(), state_settings=StateSettings(per_turn=per_turn))
    finally:
        torch.set_num_threads(threads)
    return {"data": folder / "data", "run": run}


def fresh_copy(to: Path) -> Path:
    """A copy of the dataset (with its filled embedding cache) that a test may write into."""
    color_lock_features()
    shutil.copytree(color_lock_dataset(), to)
    return to


def assert_same_scores_and_gradients(net, first, second) -> None:
    """Two ways of scoring with `net` (callables returning Q-values) agree, and so do the gradients they give
    every parameter."""
    import torch

    torch.testing.assert_close(first(), second(), atol=1e-5, rtol=1e-5)
    grads = []
    for score in (first, second):
        net.zero_grad()
        score().square().sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
