"""The run report: one self-contained HTML page on a run, or on a demo folder that holds several.

`write_report(run)` gathers what a run folder holds and renders four sections,
each shown when its inputs exist and otherwise a short "not run" note:
`dataset` (the summary of `offline_agent.info.dataset_summary` and a return
histogram), `training` (curves of an offline run's `metrics.parquet` against
`step`), `online` (curves of a fine-tune run's `metrics.parquet` against
`iteration` or `env_steps`) and `evaluation` (one row per object in an
`eval*.json`, or in any JSON file of an `eval/` folder; an object with an
`fqe` one, as `evaluate --dataset --json` writes, is also a row of the
off-policy table, with evaluate's reasons not to act on it). A run is any folder
under RUN with `metrics.parquet`, `policy.json`, `train.json` or
`finetune.json`; the dataset is `--dataset`, else the one the runs' configs
name, else a dataset folder inside RUN. The page embeds its plots as base64 PNG
data URIs and its CSS inline, and a content security policy forbids anything
else, so it can be mailed or archived as one file. The code is small pure
functions (figure -> PNG bytes -> data URI; data -> section HTML) and one
writer; every piece of text from the inputs goes through `html.escape`.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
import math
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from offline_agent.errors import UserError
from offline_agent.plots import figure_png, new_figure

REPORT_FILE = "report.html"
METRICS_FILE = "metrics.parquet"
#: Files whose presence makes a folder a run; the JSON ones also hold its config.
CONFIG_FILES = ("policy.json", "config.json", "train.json", "finetune.json")
RUN_MARKERS = (METRICS_FILE, "policy.json", "train.json", "finetune.json")
#: Folders whose every *.json is an evaluation (besides eval*.json anywhere).
EVAL_DIRS = ("eval", "evals", "evaluation")
#: Folders never searched: a dataset's own tables and caches hold no runs.
SKIP_DIRS = {"steps", "episodes", "embeddings", "__pycache__", "node_modules"}
MAX_DEPTH = 6

TRAINING_METRICS = ("loss/td", "loss/cql", "q/ood_gap", "q/data_mean")
ONLINE_METRICS = (
    "charts/success_rate",
    "charts/episode_return",
    "charts/episodic_return",
    "objective/kl",
    "objective/beta",
)
ONLINE_X = ("iteration", "env_steps", "global_step", "step")
#: Any of these columns (or namespaces) marks a metrics file as a fine-tune run's, not an offline one's.
ONLINE_MARKERS = ("iteration", "env_steps")
ONLINE_NAMESPACES = ("charts/", "objective/")

#: After load, an inline script records how many images decoded: the browser test reads it from the DOM.
IMAGES_SCRIPT = """window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute("data-images-ok", ok + "/" + imgs.length);
});"""

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2430; margin: 0 auto;
       max-width: 1180px; padding: 0 24px 48px; background: #fff; }
header { border-bottom: 2px solid #2b6cb0; padding: 18px 0 10px; margin-bottom: 8px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; color: #2b6cb0; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.meta, .note { color: #5a6372; } .note { font-style: italic; }
table { border-collapse: collapse; margin: 8px 0; } th, td { padding: 4px 10px; border-bottom: 1px solid #e2e6ec; }
th { text-align: left; background: #f4f6f9; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; height: auto; display: block; margin: 6px 0; }
dl.facts { display: grid; grid-template-columns: max-content auto; gap: 2px 16px; margin: 8px 0; }
dl.facts dt { color: #5a6372; } dl.facts dd { margin: 0; }
code { font-size: 12px; background: #f4f6f9; padding: 1px 4px; border-radius: 3px; }
"""


# --- what a run folder holds ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFolder:
    """One run inside the report's folder: where it is, its merged config, and its metrics file if any."""

    path: Path
    name: str
    config: dict[str, Any]
    metrics: Path | None


@dataclass
class ReportInputs:
    """Everything `write_report` found under RUN, before anything is read beyond configs."""

    root: Path
    runs: list[RunFolder] = field(default_factory=list)
    eval_files: list[Path] = field(default_factory=list)
    dataset: Path | None = None
    dataset_note: str | None = None


def walk_folders(root: Path, max_depth: int = MAX_DEPTH) -> Iterable[Path]:
    """root and its subfolders, sorted, skipping hidden folders, dataset tables and caches."""
    stack = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        yield folder
        if depth >= max_depth:
            continue
        try:
            children = sorted((p for p in folder.iterdir() if p.is_dir()), reverse=True)
        except OSError:
            continue
        for child in children:
            if not child.name.startswith(".") and child.name not in SKIP_DIRS:
                stack.append((child, depth + 1))


def read_json(path: Path) -> Any:
    """A JSON file's value, or None when it is unreadable (a report shows what it can)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def read_run_config(folder: Path) -> dict[str, Any]:
    """The run's JSON config files (`CONFIG_FILES`) merged; earlier files win on shared keys."""
    config: dict[str, Any] = {}
    for name in reversed(CONFIG_FILES):
        value = read_json(folder / name) if (folder / name).is_file() else None
        if isinstance(value, dict):
            config.update(value)
    return config


def is_eval_file(path: Path) -> bool:
    return path.suffix == ".json" and (path.name.startswith("eval") or path.parent.name in EVAL_DIRS)


def run_label(folder: Path, root: Path) -> str:
    rel = folder.relative_to(root).as_posix()
    return root.name if rel == "." else rel


def discover(root: Path) -> ReportInputs:
    """The runs and evaluation files under `root` (the dataset is resolved separately, see `resolve_dataset`)."""
    inputs = ReportInputs(root=root)
    for folder in walk_folders(root):
        if (folder / "dataset.json").is_file() and folder != root:
            continue  # a dataset folder's JSON files are not evaluations
        if any((folder / marker).is_file() for marker in RUN_MARKERS):
            metrics = folder / METRICS_FILE
            inputs.runs.append(
                RunFolder(
                    folder, run_label(folder, root), read_run_config(folder), metrics if metrics.is_file() else None
                )
            )
        inputs.eval_files.extend(sorted(p for p in folder.glob("*.json") if p.is_file() and is_eval_file(p)))
    return inputs


def dataset_refs(config: dict[str, Any]) -> list[str]:
    """Dataset paths a run's config names: `dataset` (a path or {"path": ...}), `dataset_path`, `data`."""
    refs = []
    for key in ("dataset", "dataset_path", "data", "train_dataset"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("path")
        if isinstance(value, str) and value:
            refs.append(value)
    return refs


def policy_refs(config: dict[str, Any]) -> list[str]:
    """Checkpoints a fine-tune run's config names; their policy.json names the dataset it started from."""
    refs = []
    for key in ("source", "reference_policy", "init_policy", "policy", "offline_policy", "checkpoint"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("path")
        if isinstance(value, str) and value:
            refs.append(value)
    return refs


def _candidates(ref: str, base: Path) -> list[Path]:
    # A config written by a run started elsewhere holds a path relative to *that* working directory;
    # try it as given, then relative to the config's folder and the folders above it.
    p = Path(ref)
    if p.is_absolute():
        return [p]
    return [p, *(parent / p for parent in [base, *base.parents][:4])]


def _existing_dataset(ref: str, base: Path) -> Path | None:
    for p in _candidates(ref, base):
        if (p / "dataset.json").is_file():
            return p
    return None


def resolve_dataset(inputs: ReportInputs, dataset: str | Path | None) -> tuple[Path | None, str | None]:
    """(dataset folder, note): `dataset` if given, else one the runs' configs name, else one inside RUN."""
    if dataset is not None:
        path = Path(dataset)
        if not (path / "dataset.json").is_file():
            raise UserError(f"--dataset {path} is not a dataset (no dataset.json): pass the folder `ingest` wrote")
        return path, None
    named: list[str] = []
    for run in inputs.runs:
        refs = list(dataset_refs(run.config))
        for ref in policy_refs(run.config):
            for p in _candidates(ref, run.path):
                config = read_run_config(p.parent if p.suffix == ".json" else p)
                if config:
                    refs.extend(dataset_refs(config))
                    break
        for ref in refs:
            named.append(ref)
            found = _existing_dataset(ref, run.path)
            if found is not None:
                return found, None
    for folder in walk_folders(inputs.root, max_depth=3):
        if (folder / "dataset.json").is_file():
            return folder, None
    if named:
        return None, (
            f"the runs' configs name the dataset {named[0]}, which is not there (moved?): "
            "pass it with --dataset DATASET"
        )
    return None, None


def collect_inputs(run: str | Path, dataset: str | Path | None = None) -> ReportInputs:
    """Discover runs, evaluation files and the dataset of `run`; UserError when there is nothing to report."""
    root = Path(run)
    if not root.exists():
        raise UserError(
            f"{root} does not exist: pass a run folder (`offline-agent train ... --out RUN`) or a demo folder"
        )
    if not root.is_dir():
        raise UserError(f"{root} is a file: pass the run folder that holds it ({root.parent})")
    inputs = discover(root)
    inputs.dataset, inputs.dataset_note = resolve_dataset(inputs, dataset)
    inside = inputs.dataset is not None and dataset is None
    if not inputs.runs and not inputs.eval_files and not inside:
        raise UserError(
            f"{root} holds nothing to report: no {', '.join(RUN_MARKERS)} or eval*.json under it "
            "and no dataset; pass a run folder written by `offline-agent train` or a demo folder"
        )
    return inputs


# --- reading metrics and evaluations --------------------------------------------------------------------


def read_metrics(path: Path) -> pl.DataFrame | None:
    try:
        return pl.read_parquet(path)
    except (OSError, pl.exceptions.PolarsError):  # a damaged metrics file becomes a note, not a failed report
        return None


def is_online_metrics(frame: pl.DataFrame) -> bool:
    cols = frame.columns
    return any(c in cols for c in ONLINE_MARKERS) or any(c.startswith(ONLINE_NAMESPACES) for c in cols)


def numeric_columns(frame: pl.DataFrame, exclude: Sequence[str] = ()) -> list[str]:
    return [c for c, t in frame.schema.items() if t.is_numeric() and c not in exclude]


def curve_columns(frame: pl.DataFrame, preferred: Sequence[str], x: str | None) -> list[str]:
    """The preferred metrics that the frame has, in that order; if none, all its numeric columns but x."""
    numeric = numeric_columns(frame, exclude=[x] if x else [])
    chosen = [c for c in preferred if c in numeric]
    if chosen:
        return chosen
    return [c for c in numeric if c not in ONLINE_X]


def x_column(frame: pl.DataFrame, candidates: Sequence[str]) -> str | None:
    return next((c for c in candidates if c in frame.columns and frame.schema[c].is_numeric()), None)


@dataclass(frozen=True)
class EvalRow:
    """One policy's evaluation, read tolerantly from an eval JSON object."""

    policy: str
    env: str | None
    success_rate: float | None
    ci95: tuple[float, float] | None
    mean_return: float | None
    mean_steps: float | None
    episodes: int | None
    source: str


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def _interval(value: Any) -> tuple[float, float] | None:
    if isinstance(value, dict):
        value = [value.get("low", value.get("lower")), value.get("high", value.get("upper"))]
    if isinstance(value, list | tuple) and len(value) == 2:
        low, high = _number(value[0]), _number(value[1])
        if low is not None and high is not None:
            return low, high
    return None


def _policy_name(record: dict[str, Any], path: Path) -> str:
    for key in ("policy", "name"):
        value = record.get(key)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, dict) and isinstance(value.get("name") or value.get("path"), str):
            return value.get("name") or value.get("path")
    stem = path.stem
    for prefix in ("eval-", "eval_", "eval"):
        if stem.startswith(prefix) and len(stem) > len(prefix):
            return stem[len(prefix) :]
    return path.parent.name if stem == "eval" else stem


def eval_row(record: dict[str, Any], path: Path, label: str) -> EvalRow:
    episodes = _number(record.get("episodes"))
    env = record.get("env")
    return EvalRow(
        policy=_policy_name(record, path),
        env=env if isinstance(env, str) else (json.dumps(env) if env is not None else None),
        success_rate=_number(record.get("success_rate")),
        ci95=_interval(record.get("ci95")),
        mean_return=_number(record.get("mean_return")),
        mean_steps=_number(record.get("mean_steps")),
        episodes=int(episodes) if episodes is not None else None,
        source=label,
    )


@dataclass(frozen=True)
class OffPolicyRow:
    """One policy's FQE estimate on held-out logs (`evaluate --dataset --json`'s "fqe" object)."""

    policy: str
    dataset: str | None
    value: float | None
    ci95: tuple[float, float] | None
    behaviour: float | None
    coverage: float | None
    episodes: int | None
    doubts: tuple[str, ...] | None  # evaluate's reasons not to act on the value; None where the file has none
    source: str
    bounds: tuple[float, float] | None = None  # the value whatever the policy does where the logs are silent
    value_auc: float | None = None  # the run's value network's first-step ROC AUC for success (learn/value.py)
    value_auc_ci95: tuple[float, float] | None = None


def off_policy_row(record: dict[str, Any], path: Path, label: str) -> OffPolicyRow:
    fqe = record["fqe"]
    episodes, doubts = _number(fqe.get("episodes")), fqe.get("doubts")
    return OffPolicyRow(
        policy=_policy_name(fqe, path),
        dataset=fqe.get("dataset") if isinstance(fqe.get("dataset"), str) else None,
        value=_number(fqe.get("fqe_value")),
        ci95=_interval(fqe.get("fqe_ci95")),
        behaviour=_number(fqe.get("behaviour_value")),
        coverage=_number(fqe.get("coverage")),
        episodes=int(episodes) if episodes is not None else None,
        doubts=tuple(str(d) for d in doubts) if isinstance(doubts, list) else None,
        source=label,
        bounds=_interval(fqe.get("fqe_bounds")),
        value_auc=_number(fqe.get("value_auc")),
        value_auc_ci95=_interval(fqe.get("value_auc_ci95")),
    )


@dataclass
class Evaluations:
    """What the evaluation files hold: simulated rows, off-policy rows, and notes on files skipped."""

    rows: list[EvalRow] = field(default_factory=list)
    off_policy: list[OffPolicyRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_evaluations(paths: Sequence[Path], root: Path) -> Evaluations:
    """One row per evaluation object (a file holds one object or a list of them): a simulated row where it has
    a success_rate, an off-policy row where it has an "fqe" object, both where it has both."""
    found = Evaluations()
    for path in paths:
        label = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        value = read_json(path)
        records = [r for r in (value if isinstance(value, list) else [value]) if isinstance(r, dict)]
        simulated = [r for r in records if "success_rate" in r]
        off_policy = [r for r in records if isinstance(r.get("fqe"), dict)]
        if not simulated and not off_policy:
            found.notes.append(
                f"skipped {label}: not an evaluation (a JSON object with success_rate, ci95, ... or an fqe object)"
            )
        found.rows.extend(eval_row(r, path, label) for r in simulated)
        found.off_policy.extend(off_policy_row(r, path, label) for r in off_policy)
    return found


# --- figures -----------------------------------------------------------------------------------------------


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def img_html(png: bytes, alt: str) -> str:
    return f'<img src="{png_data_uri(png)}" alt="{html.escape(alt)}">'


def return_histogram_png(returns: Sequence[float]) -> bytes:
    fig = new_figure(6.4, 3.0)
    ax = fig.add_subplot()
    values = [r for r in returns if r is not None and not math.isnan(r)]
    bins = max(5, min(40, int(math.sqrt(len(values))) + 1))
    ax.hist(values, bins=bins, color="#2b6cb0", edgecolor="white")
    ax.set_xlabel("episode return")
    ax.set_ylabel("episodes")
    ax.grid(alpha=0.3)
    return figure_png(fig)


def curves_png(frame: pl.DataFrame, x: str | None, columns: Sequence[str], title: str = "") -> bytes:
    """One panel per metric against x (row number when x is None); nulls are dropped per metric."""
    n_cols = min(3, max(1, len(columns)))
    n_rows = max(1, -(-len(columns) // n_cols))
    fig = new_figure(4.0 * n_cols, 2.7 * n_rows)
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    frame = frame if x else frame.with_row_index("row")
    x_name = x or "row"
    for ax, name in zip(axes.flat, columns, strict=False):
        points = frame.select(pl.col(x_name).cast(pl.Float64), pl.col(name).cast(pl.Float64)).drop_nulls().drop_nans()
        ax.plot(points[x_name].to_numpy(), points[name].to_numpy(), lw=1.3, color="#2b6cb0")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(x_name, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(columns) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=11)
    return figure_png(fig)


# --- sections: data -> HTML ---------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def section(section_id: str, title: str, body: str) -> str:
    return f'<section id="{html.escape(section_id)}">\n<h2>{html.escape(title)}</h2>\n{body}\n</section>'


def note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def not_run(section_id: str, title: str, reason: str) -> str:
    """The section of a stage whose inputs are absent: its heading and one line saying why."""
    return section(section_id, title, note(f"not run: {reason}"))


def table_html(headers: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Sequence[bool]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{html.escape(fmt(v))}</td>' if num else f"<td>{html.escape(fmt(v))}</td>"
            for v, num in zip(row, numeric, strict=True)
        )
        + "</tr>\n"
        for row in rows
    )
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def facts_html(facts: Sequence[tuple[str, Any]]) -> str:
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(fmt(v))}</dd>" for k, v in facts)
    return f'<dl class="facts">{items}</dl>'


def dataset_section(summary: dict[str, Any] | None, returns: Sequence[float] = (), reason: str = "") -> str:
    """Counts, success rate, return histogram, tools with their error rates, quarantine count."""
    if summary is None:
        return not_run("dataset", "Dataset", reason or "no dataset found; pass one with --dataset DATASET")
    r = summary.get("return") or {}
    facts = [
        ("dataset", f"{summary.get('name')} ({summary.get('dataset')})"),
        ("fingerprint", str(summary.get("fingerprint") or "-")[:16]),
        ("episodes", summary.get("episodes")),
        ("steps", summary.get("steps")),
        ("mean steps per episode", summary.get("mean_steps")),
        ("success rate", summary.get("success_rate")),
        ("episodes with an outcome", summary.get("episodes_with_outcome")),
        ("step error rate", summary.get("error_rate")),
        ("return (min / median / mean / max)", " / ".join(fmt(r.get(k)) for k in ("min", "median", "mean", "max"))),
        ("splits", ", ".join(f"{k} {v}" for k, v in (summary.get("splits") or {}).items()) or "-"),
        ("quarantined records", summary.get("quarantined")),
    ]
    parts = [facts_html(facts)]
    if returns:
        parts.append("<h3>Episode returns</h3>" + img_html(return_histogram_png(returns), "histogram of returns"))
    tools = summary.get("top_tools") or []
    if tools:
        parts.append(
            "<h3>Tools</h3>"
            + table_html(
                ["tool", "calls", "error rate"],
                ((t.get("tool"), t.get("calls"), t.get("error_rate")) for t in tools),
                [False, True, True],
            )
        )
    else:
        parts.append(note("no tool calls in this dataset"))
    return section("dataset", "Dataset", "\n".join(parts))


@dataclass(frozen=True)
class Curves:
    """One run's curves, ready to draw: which run, its algorithm, the frame, x column and metrics."""

    run: str
    algo: str | None
    frame: pl.DataFrame
    x: str | None
    columns: tuple[str, ...]


def curves_block(curves: Curves) -> str:
    heading = curves.run + (f" ({curves.algo})" if curves.algo else "")
    if not curves.columns or curves.frame.height == 0:
        return f"<h3>{html.escape(heading)}</h3>" + note("its metrics file has no rows or no numeric metric")
    png = curves_png(curves.frame, curves.x, curves.columns, title=heading)
    rows = f"{curves.frame.height} logged rows; x: {curves.x or 'row number'}; metrics: {', '.join(curves.columns)}"
    return f'<h3>{html.escape(heading)}</h3>\n<p class="meta">{html.escape(rows)}</p>\n' + img_html(
        png, f"training curves of {heading}"
    )


def curves_section(section_id: str, title: str, runs: Sequence[Curves], notes: Sequence[str], reason: str) -> str:
    if not runs and not notes:
        return not_run(section_id, title, reason)
    return section(section_id, title, "\n".join([*(curves_block(c) for c in runs), *(note(n) for n in notes)]))


def training_section(runs: Sequence[Curves], notes: Sequence[str] = ()) -> str:
    return curves_section(
        "training",
        "Offline training",
        runs,
        notes,
        f"no offline run with a {METRICS_FILE} (train one with `offline-agent train`)",
    )


def online_section(runs: Sequence[Curves], notes: Sequence[str] = ()) -> str:
    return curves_section(
        "online",
        "Online fine-tuning",
        runs,
        notes,
        f"no fine-tune run with a {METRICS_FILE} (iteration / env_steps and charts/, objective/)",
    )


def evaluation_section(found: Evaluations) -> str:
    if not found.rows and not found.off_policy and not found.notes:
        return not_run("evaluation", "Evaluation", "no eval*.json files")
    parts = []
    if found.rows:
        parts.append(
            table_html(
                ["policy", "env", "success rate", "95% interval", "mean return", "mean steps", "episodes", "file"],
                (
                    (
                        r.policy,
                        r.env,
                        r.success_rate,
                        _interval_text(r.ci95),
                        r.mean_return,
                        r.mean_steps,
                        r.episodes,
                        r.source,
                    )
                    for r in found.rows
                ),
                [False, False, True, True, True, True, True, False],
            )
        )
    if found.off_policy:
        parts.append("<h3>Off-policy estimates (FQE on held-out logs)</h3>")
        parts.append(
            table_html(
                ["policy", "dataset", "FQE value", "95% interval", "bounds", "logged behaviour", "coverage",
                 "held-out episodes", "act on it?", "value network's AUC", "95% interval", "file"],
                (
                    (r.policy, r.dataset, r.value, _interval_text(r.ci95), _interval_text(r.bounds), r.behaviour,
                     r.coverage, r.episodes, _trust_text(r.doubts), r.value_auc, _interval_text(r.value_auc_ci95),
                     r.source)
                    for r in found.off_policy
                ),
                [False, False, True, True, True, True, True, True, False, True, True, False],
            )
        )
        parts.append(note(
            "FQE values are discounted returns estimated from the logs alone; the simulated success rates above, "
            "where there are any, are what the policy really did. Bounds: the value whatever the policy does where "
            "the logs do not show its choice (FQE assuming the logs' lowest, then highest return there). "
            "The value network's AUC: how well the run's "
            "value network tells the held-out episodes that succeeded from the others at their first step "
            "(0.5 = chance)."
        ))
    parts.extend(note(n) for n in found.notes)
    return section("evaluation", "Evaluation", "\n".join(parts))


def _interval_text(ci95: tuple[float, float] | None) -> str | None:
    return f"{ci95[0]:.3f} - {ci95[1]:.3f}" if ci95 else None


def _trust_text(doubts: tuple[str, ...] | None) -> str | None:
    if doubts is None:
        return None  # written before evaluate said why: shown as unknown
    return "no: " + "; ".join(doubts) if doubts else "yes"


def page_html(title: str, header_lines: Sequence[str], sections: Sequence[str]) -> str:
    """The whole page: inline CSS, a CSP that forbids every external resource, the sections, the image check."""
    csp = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
    meta = "".join(f'<p class="meta">{html.escape(line)}</p>\n' for line in header_lines)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        f"<header>\n<h1>{html.escape(title)}</h1>\n{meta}</header>\n"
        + "\n".join(sections)
        + f"\n<script>\n{IMAGES_SCRIPT}\n</script>\n</body>\n</html>\n"
    )


# --- putting it together ----------------------------------------------------------------------------------


def split_curves(runs: Sequence[RunFolder]) -> tuple[list[Curves], list[Curves], list[str]]:
    """(offline curves, online curves, notes) from the runs' metrics files."""
    offline, online, notes = [], [], []
    for run in runs:
        if run.metrics is None:
            continue
        frame = read_metrics(run.metrics)
        algo = run.config.get("algo")
        algo = algo if isinstance(algo, str) else None
        if frame is None:
            notes.append(f"{run.name}: {METRICS_FILE} could not be read")
        elif is_online_metrics(frame):
            x = x_column(frame, ONLINE_X)
            online.append(Curves(run.name, algo, frame, x, tuple(curve_columns(frame, ONLINE_METRICS, x))))
        else:
            x = x_column(frame, ("step",))
            offline.append(Curves(run.name, algo, frame, x, tuple(curve_columns(frame, TRAINING_METRICS, x))))
    return offline, online, notes


def dataset_inputs(path: Path | None) -> tuple[dict[str, Any] | None, list[float], str]:
    """(summary, episode returns, reason when absent) of the report's dataset."""
    if path is None:
        return None, [], ""
    from offline_agent.dataset import TrajectoryDataset
    from offline_agent.info import dataset_summary

    try:
        ds = TrajectoryDataset.open(path)
    except UserError as exc:
        return None, [], f"the dataset at {path} cannot be opened: {exc}"
    _, episodes = ds.lazy()
    returns = episodes.select(pl.col("return").cast(pl.Float64)).collect()["return"].drop_nulls().to_list()
    return dataset_summary(ds), returns, ""


def build_report(inputs: ReportInputs) -> str:
    """The page's HTML from what `collect_inputs` found."""
    summary, returns, reason = dataset_inputs(inputs.dataset)
    offline, online, metric_notes = split_curves(inputs.runs)
    evaluations = read_evaluations(inputs.eval_files, inputs.root)
    run_names = ", ".join(
        r.name + (f" ({r.config['algo']})" if isinstance(r.config.get("algo"), str) else "") for r in inputs.runs
    )
    header = [
        f"folder {inputs.root.resolve()}",
        f"runs: {run_names or 'none'}; evaluation files: {len(inputs.eval_files)}",
        f"written {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')} by offline-agent report",
    ]
    sections = [
        dataset_section(summary, returns, reason or inputs.dataset_note or ""),
        training_section(offline, metric_notes),
        online_section(online),
        evaluation_section(evaluations),
    ]
    return page_html(f"offline-agent report: {inputs.root.resolve().name}", header, sections)


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary sibling, then rename: a reader sees the old page or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_report(run: str | Path, out: str | Path | None = None, dataset: str | Path | None = None) -> Path:
    """Write the report of `run` (a run or demo folder) to `out` (default RUN/report.html); returns its path."""
    inputs = collect_inputs(run, dataset)
    path = Path(out) if out is not None else inputs.root / REPORT_FILE
    if path.is_dir():
        raise UserError(f"--out {path} is a folder: pass a file name such as {path / REPORT_FILE}")
    write_text_atomic(path, build_report(inputs))
    return path
