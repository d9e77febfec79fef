"""`train`: a dataset in, a run folder out (what the `offline-agent train` verb runs).

A run folder holds

    policy.safetensors, policy.json   the checkpoint (see `offline_agent.learn.policy`)
    metrics.parquet                   one row per logged step: `step` and the algorithm's metrics
    curves.png                        those metrics against step
    train.json                        dataset, algorithm, config, sizes, time, embedding-cache use

The dataset becomes tensors once (`build_features`, through the dataset's
embedding cache), then one learner runs: `cql` (ours), `bc`, `filtered-bc`
(top 20% of episodes by return unless configured) or `d3rlpy-cql`. Beside the
policy, unless `value_head=False`, the logs' value network trains on the same
features for as many steps (`offline_agent.learn.value`; `value.safetensors`):
what `advise` and `evaluate --dataset` predict returns and success with. The
checkpoint also keeps the vectors of the logs' most frequent texts
(`offline_agent.text.known`; `texts.safetensors`), which the loaded policy's
rollouts then need not encode.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import polars as pl

from offline_agent.errors import UserError
from offline_agent.learn.bc import BCConfig, train_bc
from offline_agent.learn.cql import CQLConfig, OnStep, train_cql
from offline_agent.learn.d3rlpy_bridge import D3rlpyCQLConfig, train_d3rlpy_cql
from offline_agent.learn.encoder_tuning import EncoderTuner
from offline_agent.learn.features import Features, build_features
from offline_agent.learn.policy import CONFIG_FILE, save_checkpoint
from offline_agent.learn.value import ValueConfig, train_value
from offline_agent.text.states import StateSettings

ALGOS = ("cql", "bc", "filtered-bc", "d3rlpy-cql")
FILTERED_BC_FRACTION = 0.2
METRICS_FILE = "metrics.parquet"
CURVES_FILE = "curves.png"
SUMMARY_FILE = "train.json"


def make_config(algo: str, **settings: Any) -> CQLConfig | BCConfig | D3rlpyCQLConfig:
    """The config dataclass of `algo` with `settings` (None values mean "the default")."""
    settings = {k: v for k, v in settings.items() if v is not None}
    if algo == "cql":
        cls: type = CQLConfig
    elif algo in ("bc", "filtered-bc"):
        cls = BCConfig
        if algo == "filtered-bc":
            settings.setdefault("filter_fraction", FILTERED_BC_FRACTION)
    elif algo == "d3rlpy-cql":
        cls = D3rlpyCQLConfig
    else:
        raise UserError(f"unknown algorithm {algo!r}: use --algo one of {', '.join(ALGOS)}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise UserError(f"--algo {algo} has no setting {', '.join(unknown)} (its settings: {', '.join(sorted(known))})")
    return cls(**settings)


def run_algorithm(
    algo: str, features: Features, config: Any, on_step: OnStep | None = None, tuner: EncoderTuner | None = None
) -> tuple[Any, list[dict[str, float]]]:
    """Train `algo` on `features`: (network with `q_values`, metric rows). `tuner` fine-tunes the encoder's
    top layers along (cql, bc and filtered-bc)."""
    if algo == "cql":
        return train_cql(features, config, on_step, tuner)
    if algo in ("bc", "filtered-bc"):
        return train_bc(features, config, on_step, tuner)
    if algo == "d3rlpy-cql":
        return train_d3rlpy_cql(features, config, on_step)
    raise UserError(f"unknown algorithm {algo!r}: use --algo one of {', '.join(ALGOS)}")


@dataclass
class TrainResult:
    run_dir: Path
    algo: str
    steps: int
    seconds: float  # training only, features excluded
    final_metrics: dict[str, float]
    cache_hits: int
    cache_misses: int

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("inf")


def load_encoder(encoder: Any, device: str, state_settings: StateSettings, precision: str = "fp32") -> Any:
    """A `TextEncoder` from a path (None = the packaged MiniLM) in `precision` with the observation view and
    per-turn vectors `state_settings` ask for, or `encoder` itself if it is one already (then with those
    settings, in its own precision)."""
    if encoder is None or isinstance(encoder, str | Path):
        from offline_agent.text.encoder import TextEncoder

        path = None if encoder is None else str(encoder)
        return TextEncoder(
            path=path, device=device, observation_view=state_settings.observation_view,
            per_turn=state_settings.per_turn, precision=precision,
        )
    state_settings.for_encoder(encoder)  # refuses an encoder with other views
    return encoder


def train(
    dataset: str | Path,
    algo: str = "cql",
    out: str | Path = "run",
    *,
    steps: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    alpha: float | None = None,
    encoder: Any = None,
    encoder_precision: str = "fp32",
    state_settings: StateSettings | None = None,
    overwrite: bool = False,
    progress: bool = False,
    settings: dict[str, Any] | None = None,
    features: Features | None = None,
    value_head: bool = True,
) -> TrainResult:
    """Train `algo` on `dataset` and write the run folder `out` (see the module docstring).

    `encoder_precision` is the number format the dataset is embedded in when `encoder` is a path or None
    (`TextEncoder(precision=...)`): "fp32" (the default), "bf16", "int8" or "auto"; the policy records it in its
    encoder id, and an encoder of the same model in any precision plays it (`policy.encoder_for`).
    `state_settings` say how states become text and vectors (None: the defaults, whole-text vectors when
    the encoder is tuned, or with `features` theirs),
    recorded in policy.json; with the observation view the encoder embeds each state's current observation
    as a second view (`TextEncoder`). `settings` passes any other field of the algorithm's config (e.g.
    {"cal_ql": True}); `features` skips embedding when the caller already built them (benchmarks).
    `value_head` trains the logs' value network too (`offline_agent.learn.value`), with the algorithm's steps,
    batch size, discount, seed and device (not with a tuned encoder: it learns on fixed vectors).
    """
    from offline_agent.dataset import TrajectoryDataset

    if algo in ("bc", "filtered-bc") and alpha is not None:
        raise UserError(f"--alpha is the weight of CQL's conservative term; --algo {algo} has none: drop --alpha")
    ds = TrajectoryDataset.open(dataset)
    # The learner's discount is its own (`cql.DEFAULT_GAMMA`), not the dataset's: the dataset's gamma is how its
    # returns are reported, and the value network below predicts those.
    config = make_config(
        algo, steps=steps, batch_size=batch_size, seed=seed, device=device, alpha=alpha, **(settings or {})
    )
    out = Path(out)
    if (out / CONFIG_FILE).exists() and not overwrite:
        raise UserError(f"{out} already holds a trained policy: choose another --out, or pass --overwrite")
    n_tuned = getattr(config, "tune_encoder_layers", 0)
    if state_settings is None:
        # A tuned encoder is tuned over whole state texts, so its states are whole texts unless asked otherwise.
        state_settings = features.state_settings if features is not None else StateSettings(per_turn=not n_tuned)
    encoder = load_encoder(encoder, device, state_settings, encoder_precision)
    if n_tuned and getattr(encoder, "precision", "fp32") != "fp32":
        # The tuner backpropagates through the torch model in fp32; its vectors would not be the ones embedded.
        raise UserError(
            f"--tune-encoder-layers trains the encoder in fp32, not {encoder.precision}: drop --encoder-precision"
        )
    if n_tuned and (state_settings.observation_view or state_settings.per_turn):
        # The tuner pools the model's own output over the whole text; it has no other view to train through.
        fix = "drop --observation-view" if state_settings.observation_view else "add --whole-text"
        raise UserError(
            f"--tune-encoder-layers tunes the encoder over whole state texts: {fix} (per-turn vectors, the "
            "default, and the observation view pool other texts)"
        )
    if features is None:
        features = build_features(ds, encoder, state_settings, progress=progress)
    elif features.encoder_id != encoder.id:
        raise ValueError("features were built with another encoder than the one given")
    else:
        # The policy renders its states with the features' settings: differing ones would be ignored.
        _check_same_settings(features.state_settings, state_settings.for_encoder(encoder))
    tuner = None
    if n_tuned:
        tuner = EncoderTuner(
            encoder, features, n_tuned, config.encoder_lora_rank, config.encoder_action_gradient, progress=progress
        )

    start = time.perf_counter()
    with _progress_bar(progress, config.steps, algo) as on_step:
        network, history = run_algorithm(algo, features, config, on_step, tuner)
    seconds = time.perf_counter() - start
    value_network, value_summary = None, None
    if value_head and tuner is not None:
        # It would learn on the frozen encoder's vectors and be scored on the tuned one's.
        value_summary = {"skipped": "a run with a tuned encoder has no value network"}
    elif value_head:
        # The logs' value predicts the logs' own returns, at the discount they were ingested with (`--gamma`
        # of `ingest`), whatever discount the policy's learner bootstraps with.
        value_config = ValueConfig(
            steps=config.steps, batch_size=config.batch_size, gamma=features.gamma, seed=config.seed,
            device=config.device,
        )
        value_start = time.perf_counter()
        with _progress_bar(progress, value_config.steps, "value") as on_step:
            value_network, value_history = train_value(features, value_config, on_step)
        history = merge_by_step(history, value_history)
        value_summary = {"config": asdict(value_config), "train_seconds": round(time.perf_counter() - value_start, 3)}

    out.mkdir(parents=True, exist_ok=True)
    metrics = write_metrics(out, history)
    plot_curves(metrics, out / CURVES_FILE, title=f"{algo} on {ds.name}")
    encoder_meta = {
        "id": encoder.id,
        "path": getattr(encoder, "path", None),
        "dim": encoder.dim,
        "max_length": getattr(encoder, "max_length", None),
        # What `encoder_for` rebuilds it with.
        "observation_view": features.state_settings.observation_view,
        "per_turn": features.state_settings.per_turn,
    }
    tuning = tuner.describe() if tuner is not None else None
    if tuning is not None:
        # The policy's values are of the tuned encoder's vectors: it is the encoder it must be played with.
        encoder_meta.update(id=tuning["tuned_id"], tuned={"layers": tuning["layers"], "base_id": tuning["base_id"]})
    meta = {
        "algo": algo,
        "encoder": encoder_meta,
        **features.state_settings.to_meta(),
        "tau": config.tau,
        "dataset": {
            "path": str(ds.path), "name": ds.name, "fingerprint": ds.meta.get("fingerprint"), "gamma": ds.gamma
        },
        "config": asdict(config),
    }
    encoder_layers = tuner.layer_state() if tuner is not None else None
    # A tuned encoder's vectors are not the cached frozen ones: its memos start empty.
    known = known_text_arrays(ds, encoder, features) if tuner is None else None
    save_checkpoint(out, network, meta, encoder_layers, value_network, known)
    final = {name: v for name, v in (history[-1] if history else {}).items() if v is not None}
    summary = {
        **meta,
        "features": features.describe(),
        "train_seconds": round(seconds, 3),
        "steps_per_second": round(config.steps / seconds, 2) if seconds > 0 else None,
        "embedding_cache": {"hits": features.cache_hits, "misses": features.cache_misses},
        "encoder_tuning": tuning,
        "value_network": value_summary,
        "final_metrics": final,
    }
    _write_json(out / SUMMARY_FILE, summary)
    return TrainResult(out, algo, config.steps, seconds, final, features.cache_hits, features.cache_misses)


def known_text_arrays(ds: Any, encoder: Any, features: Features) -> dict[str, Any] | None:
    """The vectors (in the encoder's precision) of the logs' most frequent texts (`offline_agent.text.known`),
    read from the dataset's embedding cache (where `build_features` put them), for the checkpoint; None for an
    encoder without a one-view form (duck-typed encoders of experiments)."""
    from offline_agent.text.cache import CACHE_DIRNAME, EmbeddingCache
    from offline_agent.text.known import frequent_texts, text_arrays

    if not hasattr(encoder, "single_view"):
        return None
    plain = encoder.single_view()
    texts = frequent_texts(features.state_texts, features.vocab, features.state_settings.per_turn)
    vectors = EmbeddingCache(ds.path / CACHE_DIRNAME, plain).embed(texts)
    return text_arrays(texts, vectors, int(plain.dim))


def _check_same_settings(built: StateSettings, wanted: StateSettings) -> None:
    differ = [f.name for f in fields(StateSettings) if getattr(built, f.name) != getattr(wanted, f.name)]
    if differ:
        said = [", ".join(f"{name}={getattr(s, name)}" for name in differ) for s in (built, wanted)]
        raise ValueError(f"features were built with {said[0]}, not {said[1]}: pass the features' state settings")


def merge_by_step(history: list[dict[str, float]], other: list[dict[str, float]]) -> list[dict[str, float]]:
    """Metric rows of two trainings over the same steps as one row per step (a step one of them did not log
    has no value there), in step order."""
    rows: dict[int, dict[str, float]] = {}
    for record in [*history, *other]:
        rows.setdefault(int(record["step"]), {}).update(record)
    return [rows[step] for step in sorted(rows)]


def write_metrics(run_dir: Path, history: list[dict[str, float]]) -> pl.DataFrame:
    """RUN/metrics.parquet: one row per logged step (written to a temporary name, then renamed)."""
    frame = pl.DataFrame(history) if history else pl.DataFrame({"step": []}, schema={"step": pl.Int64})
    frame = frame.with_columns(pl.col("step").cast(pl.Int64))
    tmp = run_dir / f".{METRICS_FILE}.tmp-{uuid.uuid4().hex[:8]}"
    frame.write_parquet(tmp)
    os.replace(tmp, run_dir / METRICS_FILE)
    return frame


def plot_curves(metrics: pl.DataFrame, path: Path, title: str = "") -> None:
    """One panel per metric against step, as PNG."""
    from offline_agent.plots import new_figure, save_png

    names = [c for c in metrics.columns if c != "step"]
    cols = min(3, max(1, len(names)))
    rows = max(1, -(-len(names) // cols))
    fig = new_figure(4.2 * cols, 2.8 * rows, layout=None)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        ax.plot(metrics["step"].to_numpy(), metrics[name].to_numpy(), lw=1.2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_png(fig, path)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(value, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class _progress_bar:
    """A rich progress bar over training steps when asked for; yields the `on_step` callback."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled, total, label

    def __enter__(self) -> OnStep | None:
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("train {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[loss]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.bar.start()
        task = self.bar.add_task(self.label, total=self.total, loss="")

        def on_step(step: int, record: dict[str, float] | None) -> None:
            if record is not None:
                loss = next((v for k, v in record.items() if "loss" in k.split("/") and v is not None), None)
                self.bar.update(task, completed=step, loss=f"loss {loss:.4f}" if loss is not None else "")
            elif step % 10 == 0:
                self.bar.update(task, completed=step)

        return on_step

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.bar.stop()
