"""`finetune`: an offline checkpoint in, a fine-tuned run folder out (what `offline-agent finetune` runs).

The run folder RUN2 holds

    policy.safetensors, policy.json   the fine-tuned policy head, in the offline checkpoint's format (algo "ppo"):
                                      `Policy.load(RUN2)` and `offline-agent evaluate RUN2` read it as they read
                                      RUN; policy.json also keeps the safety rules ("safety") it was tuned under
                                      and the temperature ("tau", `--tau` or RUN's) it was tuned at. With
                                      `--validation-episodes N` it is the kept policy: the offline policy or an
                                      iteration's, chosen by its greedy success on N held-out episodes and the
                                      rule `--validation-keep` (`validation.py`; policy.json's "validation"
                                      says which)
    metrics.parquet                   one row per iteration (names in `config.METRICS`), readable with DuckDB
    curves.png                        success rate, return, KL and beta against iterations
    resume.safetensors                the resume state (below); written every `config.checkpoint_every` iterations
    finetune.json                     source run and its weights' hash, environment, config, safety rules,
                                      final metrics, time

Resume state: one safetensors file, replaced atomically (tmp + os.replace), with
the model (policy and value heads), the Adam state, the self-imitation buffer
(with `self_imitation` on), the kept policy head (with validation on), the text -> vector
memos of the rollouts and of the validation episodes (texts as UTF-8 bytes and offsets, vectors,
least recently used first), every random-number state
(torch's global RNG and the trainer's generator as uint8 tensors, numpy's and
Python's global RNGs) and, in its JSON metadata, the iteration, env steps, the
KL controller and the settings that must not change across a resume. Nothing is
unpickled. Environments need no saved state: checkpoints are taken exactly where
the trainer re-seeds them from (seed, iteration) and resets them. (A finished run resumed with more
`--iterations` resets them where it had stopped, so it is not bit-identical to a run that was longer from the
start; an interrupted run is.) The run is made deterministic (torch's
deterministic algorithms, a fixed thread count), so `--resume` after a kill
finishes with the same parameters, bit for bit, as a run that was never
interrupted.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from safetensors.torch import load_file, save_file

from offline_agent.determinism import deterministic_torch
from offline_agent.envs.safety import SafetyFilter
from offline_agent.errors import UserError
from offline_agent.online.config import METRICS, PPOConfig
from offline_agent.online.ppo import PPOTrainer
from offline_agent.online.validation import PolicySelector
from offline_agent.ray_backend import check_backend, ray_session, require_ray

STATE_FILE = "resume.safetensors"
METRICS_FILE = "metrics.parquet"
CURVES_FILE = "curves.png"
SUMMARY_FILE = "finetune.json"
STATE_FORMAT = "offline-agent-finetune-state"
#: Config fields a resume may change: they do not enter the computation.
RESUMABLE_CHANGES = ("iterations", "vector")

#: Called after every iteration with its metrics row.
OnIteration = Callable[[dict[str, float]], None]


@dataclass(frozen=True)
class FinetuneResult:
    run_dir: Path
    iterations: int
    env_steps: int
    seconds: float
    final_metrics: dict[str, float]
    resumed_from: int | None  # the iteration a resumed run started after
    ray: dict[str, int] | None = None  # with --backend ray: actors, replacements and replays (RayVectorEnv.stats)


def finetune(
    run: str | Path,
    env: str,
    out: str | Path,
    config: PPOConfig | None = None,
    *,
    safety: str | Sequence[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    encoder: Any = None,
    encoder_precision: str = "auto",
    progress: bool = False,
    on_iteration: OnIteration | None = None,
    backend: str = "local",
    ray_address: str | None = None,
    ray_actors: int | None = None,
) -> FinetuneResult:
    """Fine-tune the policy of checkpoint `run` in environment `env` with PPO + KL, into run folder `out`.

    `safety` is a safety-filter spec (see `offline_agent.envs.safety`); `resume` continues `out` from its
    last checkpoint (the other arguments must match the interrupted run's, except `config.iterations`).
    `encoder_precision` "bf16" runs the rollouts' encoder in bfloat16 and "int8" in int8 with ONNX Runtime
    (`TextEncoder`; "auto", the default, is int8 on a CPU with int8 instructions, else bf16 where the device
    computes in bf16 natively, else fp32); the fine-tuned policy keeps the offline checkpoint's encoder, and
    plays with any of them. `backend="ray"` runs the environments in
    `ray_actors` Ray actors (`RayVectorEnv`; `ray_address` as in `offline_agent.ray_backend`) while the policy
    learns here; the run is the same as with the local backend (validation episodes still play here).
    """
    from offline_agent.learn.policy import (
        CONFIG_FILE,
        Policy,
        checkpoint_dir,
        load_value_network,
        save_checkpoint,
        tuned_layers,
    )

    config = config or PPOConfig()
    if check_backend(backend) == "ray":
        require_ray()  # before anything is loaded
    source = checkpoint_dir(run)
    out = Path(out)
    if out.resolve() == source.resolve():
        raise UserError(f"--out {out} is the checkpoint being fine-tuned: choose another folder")
    safety_filter = SafetyFilter.from_spec(safety)
    state_path = out / STATE_FILE
    if resume and not state_path.is_file():
        raise UserError(f"--resume: {out} holds no fine-tuning checkpoint ({STATE_FILE}); start without --resume")
    if not resume and not overwrite and (state_path.exists() or (out / CONFIG_FILE).exists()):
        raise UserError(f"{out} already holds a run: pass --resume to continue it, --overwrite, or another --out")

    if resume and encoder_precision == "auto":
        # "auto" goes on in what the interrupted run ran in, though the default has changed since (bf16, then
        # int8 on CPUs with int8 instructions) or the run moved to another machine: its memo holds those vectors.
        encoder_precision = _interrupted_precision(state_path)
    reference = Policy.load(source, encoder=encoder, device=config.device, precision=encoder_precision)
    if reference.meta.get("network", {}).get("kind") is None:
        raise UserError(f"{source} has no network description in policy.json: retrain it with this offline-agent")
    identity = {
        "format": STATE_FORMAT,
        "source": str(source.resolve()),
        "source_weights_sha256": file_sha256(source / "policy.safetensors"),
        "encoder_id": reference.encoder.id,
        "env": env,
        "safety": safety_filter.specs,
        "config": asdict(config),
    }
    out.mkdir(parents=True, exist_ok=True)
    if not resume:  # an overwritten run's resume state must not be picked up by a later --resume
        for stale in (state_path, out / METRICS_FILE, out / SUMMARY_FILE):
            stale.unlink(missing_ok=True)
    rows: list[dict[str, float]] = []
    resumed_from = None
    start = time.perf_counter()
    with deterministic_torch(config.torch_threads), ExitStack() as on_ray:
        # The global generators too: a user's env or judge that draws from `random` or `np.random` in this
        # process is then reproducible, and resumable since their states are checkpointed.
        random.seed(config.seed)
        np.random.seed(config.seed % 2**32)
        envs = None
        if backend == "ray":
            from offline_agent.online.ray_envs import RayVectorEnv

            on_ray.enter_context(ray_session(ray_address))
            envs = RayVectorEnv(env, config.num_envs, safety_filter.specs, ray_actors)
        trainer = PPOTrainer(reference, env, config, safety_filter, envs)
        selector = None
        if config.validation_episodes:
            selector = PolicySelector(
                reference, env, config.validation_episodes, config.validation_seed, safety_filter.specs,
                keep=config.validation_keep,
            )
        try:
            if resume:
                resumed_from = load_state(state_path, trainer, identity, selector)
                if (out / METRICS_FILE).is_file():
                    rows = pl.read_parquet(out / METRICS_FILE).filter(pl.col("iteration") <= resumed_from).to_dicts()
            elif selector is not None:  # the offline policy is the one to beat
                selector.consider(0, trainer.model.policy_head)
            meta = _policy_meta(reference, env, config, safety_filter, source, trainer.tau)
            # A policy over a tuned encoder carries its layers along: the fine-tuned one plays with them too.
            encoder_layers = tuned_layers(source, reference.meta)
            # The logs' value (`learn/value.py`) does not change with the policy: the fine-tuned run keeps it.
            value_network = load_value_network(source)
            known_texts = reference.known_texts  # the source's, carried like its value network
            with _progress(progress, config.iterations, trainer.iteration) as advance:
                while trainer.iteration < config.iterations:
                    row = trainer.train_iteration()
                    if selector is not None:
                        row |= selector.consider(trainer.iteration, trainer.model.policy_head)
                    rows.append(row)
                    write_metrics(out, rows)
                    if on_iteration is not None:
                        on_iteration(row)
                    advance(row)
                    if trainer.iteration % config.checkpoint_every == 0 or trainer.iteration == config.iterations:
                        carried = {"encoder_layers": encoder_layers, "value_network": value_network,
                                   "known_texts": known_texts}
                        if selector is None:
                            save_checkpoint(out, trainer.model.policy_head, meta, **carried)
                        else:
                            assert selector.kept_head is not None
                            kept_meta = {**meta, "validation": selector.describe()}
                            save_checkpoint(out, selector.kept_head, kept_meta, **carried)
                        save_state(state_path, trainer, identity, selector)
        finally:
            trainer.close()
    seconds = time.perf_counter() - start
    frame = write_metrics(out, rows)
    plot_curves(frame, out / CURVES_FILE, title=f"PPO fine-tuning of {source.name} in {env}")
    final = {k: v for k, v in (rows[-1] if rows else {}).items() if v is not None}
    summary = {
        "source": str(source),
        "source_weights_sha256": identity["source_weights_sha256"],  # which offline weights, even if retrained
        "env": env,
        "safety": safety_filter.specs,
        "config": asdict(config),
        "iterations": trainer.iteration,
        "env_steps": trainer.env_steps,
        "seconds_this_process": round(seconds, 3),
        "resumed_from": resumed_from,
        "encoder_precision": getattr(reference.encoder, "precision", "fp32"),
        "texts_encoded_this_process": trainer.featurizer.encoded,
        "validation": None if selector is None else selector.describe(),
        "ray": None if envs is None else envs.stats(),
        "final_metrics": final,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return FinetuneResult(
        out, trainer.iteration, trainer.env_steps, seconds, final, resumed_from, None if envs is None else envs.stats()
    )


def _policy_meta(
    reference: Any, env: str, config: PPOConfig, safety: SafetyFilter, source: Path, tau: float
) -> dict[str, Any]:
    """policy.json of the fine-tuned policy: the reference's (encoder, renderer) plus where it came from, at the
    temperature `tau` the trainer played it at (its logits are Q / tau)."""
    skip = ("format", "format_version", "network", "value_network")  # value_network: its weights are saved apart
    meta = {k: v for k, v in reference.meta.items() if k not in skip}
    meta.update(
        algo="ppo",
        finetuned_from={"path": str(source), "algo": reference.meta.get("algo"), "tau": reference.meta.get("tau")},
        env=env,
        safety=safety.specs,
        config=asdict(config),
        tau=tau,
    )
    return meta


# --- resume state ------------------------------------------------------------------------------------


def save_state(
    path: Path, trainer: PPOTrainer, identity: dict[str, Any], selector: PolicySelector | None = None
) -> None:
    """Everything `load_state` needs, in one safetensors file written to a temporary name and renamed."""
    tensors = {f"model/{k}": v.detach().cpu().contiguous() for k, v in trainer.model.state_dict().items()}
    optimizer = trainer.optimizer.state_dict()
    for pid, slots in optimizer["state"].items():
        for key, value in slots.items():
            tensors[f"optimizer/{pid}/{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    if trainer.success_buffer is not None:
        tensors |= {f"self_imitation/{k}": v.contiguous() for k, v in trainer.success_buffer.tensors().items()}
    selection = None
    if selector is not None:
        selected, selection = selector.state()
        tensors |= selected
    # The text -> vector memos: a text's vector depends by ~1e-7 on which texts were encoded with it, so a resumed
    # run needs the very vectors (and the same memo contents, which decide the batches) to repeat itself.
    for name, memo in _memos(trainer, selector).items():
        tensors |= {f"memo/{name}/{k}": torch.from_numpy(v) for k, v in memo.arrays().items()}
    tensors["rng/torch"] = torch.get_rng_state()
    tensors["rng/generator"] = trainer.generator.get_state()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(np_keys.astype(np.int64))
    py_version, py_state, py_gauss = random.getstate()
    state = {
        **identity,
        "iteration": trainer.iteration,
        "env_steps": trainer.env_steps,
        "kl_controller": trainer.kl_controller.state(),
        "optimizer_param_groups": optimizer["param_groups"],
        "rng_numpy": [np_kind, int(np_pos), int(np_has_gauss), float(np_gauss)],
        "rng_python": [py_version, list(py_state), py_gauss],
        "validation": selection,
    }
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    save_file(tensors, str(tmp), metadata={"state": json.dumps(state)})
    os.replace(tmp, path)


def read_state_metadata(path: Path) -> dict[str, Any]:
    """The JSON half of `save_state`'s file (iteration, identity, config, ...) without loading its tensors.
    Raises whatever safetensors or json raise on a file that is not one (e.g. cut short by a kill)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return json.loads((handle.metadata() or {})["state"])


def _interrupted_precision(path: Path) -> str:
    """The encoder precision of the run whose resume state is `path`, read off its encoder id
    (`TextEncoder.precision_of`); "auto" if the file cannot be read (`load_state` then says so)."""
    from offline_agent.text.encoder import TextEncoder

    try:
        encoder_id = str(read_state_metadata(path)["encoder_id"])
    except Exception:
        return "auto"
    return TextEncoder.precision_of(encoder_id)


def load_state(
    path: Path, trainer: PPOTrainer, identity: dict[str, Any], selector: PolicySelector | None = None
) -> int:
    """Restore a trainer (and the run's policy selection) from `save_state`'s file; returns the iteration it
    had completed."""
    try:
        state = read_state_metadata(path)
        tensors = load_file(str(path))
    except Exception as exc:
        raise UserError(f"{path} is not a readable fine-tuning checkpoint ({type(exc).__name__}): delete it") from None
    _check_same_run(path, state, identity)
    trainer.model.load_state_dict({k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")})
    optimizer_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, pid, slot = key.split("/", 2)
            optimizer_state.setdefault(int(pid), {})[slot] = value
    groups = _optimizer_groups(state["optimizer_param_groups"], trainer.optimizer.param_groups)
    trainer.optimizer.load_state_dict({"state": optimizer_state, "param_groups": groups})
    if trainer.success_buffer is not None:
        prefix = "self_imitation/"
        trainer.success_buffer.load({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
    torch.set_rng_state(tensors["rng/torch"])
    trainer.generator.set_state(tensors["rng/generator"])
    np_kind, np_pos, np_has_gauss, np_gauss = state["rng_numpy"]
    np.random.set_state((np_kind, tensors["rng/numpy"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    py_version, py_state, py_gauss = state["rng_python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    if selector is not None:  # _check_same_run made sure the interrupted run validated too
        selector.load(tensors, state["validation"], trainer.model.policy_head)
    for name, memo in _memos(trainer, selector).items():  # a checkpoint from before memos were saved has none
        prefix = f"memo/{name}/"
        if f"{prefix}vectors" in tensors:
            memo.load_arrays({k[len(prefix) :]: v.numpy() for k, v in tensors.items() if k.startswith(prefix)})
    trainer.kl_controller.beta = float(state["kl_controller"]["beta"])
    trainer.iteration = int(state["iteration"])
    trainer.env_steps = int(state["env_steps"])
    return trainer.iteration


def _memos(trainer: PPOTrainer, selector: PolicySelector | None) -> dict[str, Any]:
    """The run's text -> vector memos by name: the rollouts' and the validation episodes'."""
    return {"rollout": trainer.featurizer.memo, **({} if selector is None else {"validation": selector.memo})}


def _check_same_run(path: Path, saved: dict[str, Any], identity: dict[str, Any]) -> None:
    if saved.get("format") != STATE_FORMAT:
        raise UserError(f"{path} is not an offline-agent fine-tuning checkpoint: delete it or choose another --out")
    if saved["encoder_id"] != identity["encoder_id"]:
        raise UserError(
            f"{path.parent} was fine-tuned on embeddings of encoder {saved['encoder_id']}, but the checkpoint and "
            f"encoder given now use {identity['encoder_id']}: resume with the same RUN, --encoder and "
            "--encoder-precision"
        )
    for key, flag in (("source_weights_sha256", "RUN"), ("env", "--env"), ("safety", "--safety")):
        if saved[key] != identity[key]:
            shown = "source" if key == "source_weights_sha256" else key  # a path reads better than a hash
            raise UserError(
                f"--resume: {flag} differs from the interrupted run's ({saved[shown]!r}, now {identity[shown]!r}, "
                "or its weights changed): resume with the same arguments or start a new --out"
            )
    saved_config = _implied_config(saved["config"])
    changed = sorted(
        k for k, v in identity["config"].items() if k not in RESUMABLE_CHANGES and saved_config.get(k) != v
    )
    if changed:
        was = ", ".join(f"{k}={saved_config.get(k)!r}" for k in changed)
        now = ", ".join(f"{k}={identity['config'][k]!r}" for k in changed)
        raise UserError(f"--resume with other settings than the interrupted run ({was}; now {now}): use the same ones")


#: Settings added since the first checkpoints, and what a checkpoint without them did.
_BEFORE_SETTING = {"policy_init": "copy", "kl_gradient": False}


def _implied_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's settings as this version reads them: a setting added since it was written takes the
    value its run had in effect (`value_learning_rate` was the policy's learning rate, the policy a trained
    copy of the offline network, the KL penalty in the rewards only)."""
    known = {f.name for f in fields(PPOConfig)}
    return asdict(PPOConfig(**{**_BEFORE_SETTING, **{k: v for k, v in saved.items() if k in known}}))


def _optimizer_groups(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The saved optimizer's parameter groups, split as the current optimizer groups its parameters: a
    checkpoint written before the value head had its own learning rate has one group holding all of them,
    in the same order (policy head, then value head), at one learning rate."""
    if len(saved) != 1 or len(current) == 1:
        return saved
    ids, groups, start = saved[0]["params"], [], 0
    for group in current:
        groups.append({**saved[0], "params": ids[start : start + len(group["params"])]})
        start += len(group["params"])
    return groups


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path} ({type(exc).__name__}): the checkpoint is damaged") from None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- metrics and plots -------------------------------------------------------------------------------


def write_metrics(run_dir: Path, rows: list[dict[str, float]]) -> pl.DataFrame:
    """RUN2/metrics.parquet, one row per iteration (temporary name, then renamed)."""
    if rows:
        frame = pl.from_dicts(rows, infer_schema_length=None)
    else:
        frame = pl.DataFrame(schema=dict.fromkeys(METRICS, pl.Float64))
    frame = frame.with_columns(pl.col("iteration").cast(pl.Int64), pl.col("env_steps").cast(pl.Int64))
    tmp = run_dir / f".{METRICS_FILE}.tmp-{uuid.uuid4().hex[:8]}"
    frame.write_parquet(tmp)
    os.replace(tmp, run_dir / METRICS_FILE)
    return frame


def plot_curves(frame: pl.DataFrame, path: Path, title: str = "") -> None:
    """Success rate, episode return, KL to the reference and beta against iteration, in one PNG."""
    from offline_agent.plots import new_figure, save_png

    panels = [
        ("charts/success_rate", "success rate (sampled; validation: greedy)"),
        ("charts/episode_return", "episode return"),
        ("objective/kl", "KL(pi || pi_offline) per step"),
        ("objective/beta", "beta"),
    ]
    fig = new_figure(16, 3.4, layout=None)
    axes = fig.subplots(1, 4)
    for ax, (column, label) in zip(axes, panels, strict=True):
        if column in frame.columns and frame.height:
            ax.plot(frame["iteration"].to_list(), frame[column].to_list(), marker="o", markersize=3)
        if column == "charts/success_rate" and "validation/success_rate" in frame.columns:
            ax.plot(frame["iteration"].to_list(), frame["validation/success_rate"].to_list(), marker="s",
                    markersize=3, label="greedy, validation episodes")
            ax.legend(fontsize=7)
        ax.set_title(label)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    save_png(fig, path)


class _progress:
    """A rich progress bar over iterations when asked for, else a no-op; `advance(row)` after each."""

    def __init__(self, enabled: bool, total: int, done: int):
        self.enabled, self.total, self.done = enabled, total, done

    def __enter__(self) -> Callable[[dict[str, float]], None]:
        if not self.enabled:
            return lambda row: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.bar.start()
        task = self.bar.add_task("fine-tuning", total=self.total, completed=self.done)

        def advance(row: dict[str, float]) -> None:
            self.bar.update(
                task,
                advance=1,
                description=(
                    f"success {row['charts/success_rate']:.2f} kl {row['objective/kl']:.3f} "
                    f"beta {row['objective/beta']:.3f}"
                ),
            )

        return advance

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.bar.stop()
