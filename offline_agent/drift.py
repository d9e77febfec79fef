"""Reward-drift monitor: has the reward or outcome distribution moved between two datasets?

Compares a REFERENCE dataset (e.g. last month's logs, or the training data) with a NEW one, overall
and per tool (`tool_name`): continuous quantities (step reward, episode return, the log's outcome)
with a two-sample Kolmogorov-Smirnov test, rates (success, tool error) with a two-proportion z-test,
the tool mix with a chi-square test, and every quantity with the population stability index (PSI)
over bins fixed by the reference. A check flags drift when PSI > `psi_threshold` or p <
`p_threshold`, provided both sides have at least `min_count` samples (small samples are reported,
never flagged). The tests are not corrected for multiplicity: with many tools, expect the odd
false alarm at p < 0.01 and read the PSI column too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from scipy import stats

from offline_agent.errors import UserError

# --- pure statistics -------------------------------------------------------------------------------


def reference_bin_edges(reference: np.ndarray, bins: int) -> np.ndarray:
    """Interior bin edges (K-1,) from the reference's quantiles, K <= `bins`.

    The bins are (-inf, e_1], (e_1, e_2], ..., (e_{K-1}, inf). Edges are reference values
    (quantile method "lower") and duplicates are dropped, so a discrete reward (0/1 outcomes)
    gets one bin per value instead of empty phantom bins.
    """
    reference = np.asarray(reference, dtype=np.float64)
    if reference.size == 0:
        return np.zeros(0)
    quantiles = np.quantile(reference, np.linspace(0.0, 1.0, bins + 1)[1:-1], method="lower")
    return np.unique(quantiles)


def bin_proportions(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """(K,) share of `values` in each bin of `reference_bin_edges` (K = len(edges) + 1)."""
    values = np.asarray(values, dtype=np.float64)
    counts = np.bincount(np.searchsorted(edges, values, side="left"), minlength=edges.shape[0] + 1)
    return counts / max(values.shape[0], 1)


def psi_from_proportions(expected: np.ndarray, actual: np.ndarray, epsilon: float = 1e-4) -> float:
    """Population stability index `sum_k (a_k - e_k) * ln(a_k / e_k)` over K bins.

    expected, actual: (K,) proportions (reference, new). Empty bins count as `epsilon` so that
    the log stays finite. Rule of thumb: < 0.1 stable, 0.1-0.2 moderate, > 0.2 shifted.
    """
    e = np.maximum(np.asarray(expected, dtype=np.float64), epsilon)
    a = np.maximum(np.asarray(actual, dtype=np.float64), epsilon)
    return float(np.sum((a - e) * np.log(a / e)))


def psi(reference: np.ndarray, new: np.ndarray, bins: int = 10, epsilon: float = 1e-4) -> float:
    """PSI of `new` against `reference` over up to `bins` quantile bins fixed by the reference."""
    edges = reference_bin_edges(reference, bins)
    return psi_from_proportions(bin_proportions(reference, edges), bin_proportions(new, edges), epsilon)


def rate_psi(k_reference: int, n_reference: int, k_new: int, n_new: int, epsilon: float = 1e-4) -> float:
    """PSI of a rate: two bins, (1 - p, p)."""
    p_ref, p_new = k_reference / n_reference, k_new / n_new
    return psi_from_proportions(np.array([1 - p_ref, p_ref]), np.array([1 - p_new, p_new]), epsilon)


def two_proportion_test(k_reference: int, n_reference: int, k_new: int, n_new: int) -> tuple[float, float]:
    """Pooled two-proportion z-test: `z = (p2 - p1) / sqrt(p (1 - p) (1/n1 + 1/n2))`, two-sided p-value.

    Same p-value as a 2x2 chi-square test without continuity correction. When the pooled rate is
    0 or 1 the samples cannot differ: z = 0, p = 1.
    """
    p1, p2 = k_reference / n_reference, k_new / n_new
    pooled = (k_reference + k_new) / (n_reference + n_new)
    variance = pooled * (1 - pooled) * (1 / n_reference + 1 / n_new)
    if variance <= 0:
        return 0.0, 1.0
    z = (p2 - p1) / math.sqrt(variance)
    return z, float(2 * stats.norm.sf(abs(z)))


def ks_test(reference: np.ndarray, new: np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov test: (sup |F_ref - F_new|, two-sided p-value)."""
    result = stats.ks_2samp(np.asarray(reference, np.float64), np.asarray(new, np.float64))
    return float(result.statistic), float(result.pvalue)


def category_shares(reference: list[str], new: list[str]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Categories (sorted union) with their counts (C,) in reference and new."""
    categories = sorted(set(reference) | set(new))
    index = {c: i for i, c in enumerate(categories)}
    counts_ref = np.bincount([index[c] for c in reference], minlength=len(categories))
    counts_new = np.bincount([index[c] for c in new], minlength=len(categories))
    return categories, counts_ref, counts_new


def chi_square_test(counts_reference: np.ndarray, counts_new: np.ndarray) -> tuple[float, float]:
    """Chi-square test of homogeneity on a 2 x C table of counts; (statistic, p-value)."""
    table = np.vstack([counts_reference, counts_new])
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2 or (table.sum(axis=1) == 0).any():
        return 0.0, 1.0
    result = stats.chi2_contingency(table, correction=False)
    return float(result.statistic), float(result.pvalue)


# --- checks over two datasets ----------------------------------------------------------------------


@dataclass(frozen=True)
class DriftConfig:
    """Thresholds of the drift monitor."""

    psi_threshold: float = 0.2  # flag when PSI > this
    p_threshold: float = 0.01  # flag when a test's p-value < this
    bins: int = 10  # quantile bins of the reference for PSI
    epsilon: float = 1e-4  # proportion used for an empty bin in PSI
    min_count: int = 20  # fewer samples on either side: report, never flag

    def __post_init__(self) -> None:
        if self.psi_threshold <= 0:
            raise UserError(f"--psi-threshold must be > 0, got {self.psi_threshold}; 0.2 is the usual choice")
        if not 0 < self.p_threshold < 1:
            raise UserError(f"--p-threshold must be in (0, 1), got {self.p_threshold}; e.g. 0.01")
        if self.bins < 2:
            raise UserError(f"--bins must be >= 2, got {self.bins}; e.g. 10")
        if not 0 < self.epsilon < 1:
            raise UserError(f"epsilon must be in (0, 1), got {self.epsilon}")
        if self.min_count < 1:
            raise UserError(f"--min-count must be >= 1, got {self.min_count}")


@dataclass(frozen=True)
class DriftCheck:
    """One comparison. `reference_value`/`new_value` are means (continuous) or rates."""

    scope: str  # "all" or "tool:<name>"
    metric: str  # reward | return | outcome | success_rate | error_rate | tool_mix
    test: str  # ks | two_proportion | chi_square
    n_reference: int
    n_new: int
    reference_value: float
    new_value: float
    statistic: float
    p_value: float
    psi: float
    drift: bool
    reason: str


@dataclass(frozen=True)
class DriftReport:
    reference: str
    new: str
    config: DriftConfig
    checks: list[DriftCheck] = field(default_factory=list)

    @property
    def drift(self) -> bool:
        return any(c.drift for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: NaN (a test that could not run) becomes null."""

        def clean(value: Any) -> Any:
            return None if isinstance(value, float) and not math.isfinite(value) else value

        return {
            "reference": self.reference,
            "new": self.new,
            "drift": self.drift,
            "config": asdict(self.config),
            "checks": [{k: clean(v) for k, v in asdict(c).items()} for c in self.checks],
        }


def _judge(
    config: DriftConfig,
    scope: str,
    metric: str,
    test: str,
    n: tuple[int, int],
    values: tuple[float, float],
    statistic: float = math.nan,
    p_value: float = math.nan,
    psi_value: float = math.nan,
) -> DriftCheck:
    """A check with its verdict: drift when PSI or p crosses its threshold and both sides are big enough."""
    reasons = []
    if min(n) == 0:
        reasons.append("one side empty")
    elif min(n) < config.min_count:
        reasons.append(f"too few samples (< {config.min_count})")
    else:
        if psi_value > config.psi_threshold:
            reasons.append(f"psi {psi_value:.3g} > {config.psi_threshold:g}")
        if p_value < config.p_threshold:
            reasons.append(f"p {p_value:.3g} < {config.p_threshold:g}")
    drift = min(n) >= config.min_count and bool(reasons)
    return DriftCheck(
        scope, metric, test, *n, *values, statistic, p_value, psi_value, drift, ", ".join(reasons)
    )


def continuous_check(
    scope: str, metric: str, reference: np.ndarray, new: np.ndarray, config: DriftConfig
) -> DriftCheck:
    """KS test + PSI of a continuous quantity; values are the two means."""
    n = (len(reference), len(new))
    means = (float(np.mean(reference)) if n[0] else math.nan, float(np.mean(new)) if n[1] else math.nan)
    if min(n) == 0:
        return _judge(config, scope, metric, "ks", n, means)
    statistic, p_value = ks_test(reference, new)
    psi_value = psi(reference, new, config.bins, config.epsilon)
    return _judge(config, scope, metric, "ks", n, means, statistic, p_value, psi_value)


def rate_check(
    scope: str, metric: str, k_ref: int, n_ref: int, k_new: int, n_new: int, config: DriftConfig
) -> DriftCheck:
    """Two-proportion z-test (statistic: z) + two-bin PSI of a rate k/n; values are the two rates."""
    n = (n_ref, n_new)
    rates = (k_ref / n_ref if n_ref else math.nan, k_new / n_new if n_new else math.nan)
    if min(n) == 0:
        return _judge(config, scope, metric, "two_proportion", n, rates)
    z, p_value = two_proportion_test(k_ref, n_ref, k_new, n_new)
    psi_value = rate_psi(k_ref, n_ref, k_new, n_new, config.epsilon)
    return _judge(config, scope, metric, "two_proportion", n, rates, z, p_value, psi_value)


def tool_mix_check(reference: list[str], new: list[str], config: DriftConfig) -> DriftCheck:
    """Chi-square test + categorical PSI of which tools are called; values: numbers of distinct tools."""
    _, counts_ref, counts_new = category_shares(reference, new)
    n = (len(reference), len(new))
    distinct = (float((counts_ref > 0).sum()), float((counts_new > 0).sum()))
    if min(n) == 0:
        return _judge(config, "all", "tool_mix", "chi_square", n, distinct)
    statistic, p_value = chi_square_test(counts_ref, counts_new)
    psi_value = psi_from_proportions(counts_ref / n[0], counts_new / n[1], config.epsilon)
    return _judge(config, "all", "tool_mix", "chi_square", n, distinct, statistic, p_value, psi_value)


STEP_COLUMNS = ["tool_name", "reward", "is_error"]
EPISODE_COLUMNS = ["return", "success", "outcome"]


def compare_frames(
    reference_steps: pl.DataFrame,
    reference_episodes: pl.DataFrame,
    new_steps: pl.DataFrame,
    new_episodes: pl.DataFrame,
    config: DriftConfig | None = None,
) -> list[DriftCheck]:
    """All checks, overall then per tool. Steps frames need STEP_COLUMNS, episode frames EPISODE_COLUMNS."""
    config = config or DriftConfig()
    checks = [
        continuous_check(
            "all", "reward", _floats(reference_steps, "reward"), _floats(new_steps, "reward"), config
        ),
        continuous_check(
            "all", "return", _floats(reference_episodes, "return"), _floats(new_episodes, "return"), config
        ),
    ]
    outcome_ref, outcome_new = _floats(reference_episodes, "outcome"), _floats(new_episodes, "outcome")
    if len(outcome_ref) or len(outcome_new):
        checks.append(continuous_check("all", "outcome", outcome_ref, outcome_new, config))
    success_ref, success_new = _counts(reference_episodes, "success"), _counts(new_episodes, "success")
    if success_ref[1] or success_new[1]:
        checks.append(rate_check("all", "success_rate", *success_ref, *success_new, config))
    checks.append(
        rate_check(
            "all",
            "error_rate",
            *_counts(reference_steps, "is_error"),
            *_counts(new_steps, "is_error"),
            config,
        )
    )
    tools_ref = reference_steps["tool_name"].drop_nulls().to_list()
    tools_new = new_steps["tool_name"].drop_nulls().to_list()
    if tools_ref or tools_new:
        checks.append(tool_mix_check(tools_ref, tools_new, config))
    for tool in sorted(set(tools_ref) | set(tools_new)):
        ref = reference_steps.filter(pl.col("tool_name") == tool)
        new = new_steps.filter(pl.col("tool_name") == tool)
        scope = f"tool:{tool}"
        checks.append(
            continuous_check(scope, "reward", _floats(ref, "reward"), _floats(new, "reward"), config)
        )
        checks.append(
            rate_check(scope, "error_rate", *_counts(ref, "is_error"), *_counts(new, "is_error"), config)
        )
    return checks


def _floats(frame: pl.DataFrame, column: str) -> np.ndarray:
    return frame[column].drop_nulls().cast(pl.Float64).to_numpy()


def _counts(frame: pl.DataFrame, column: str) -> tuple[int, int]:
    """(number true, number known) of a boolean column."""
    values = frame[column].drop_nulls()
    return int(values.sum()), len(values)


def compare_datasets(
    reference: str | Path, new: str | Path, config: DriftConfig | None = None
) -> DriftReport:
    """Open two datasets and run `compare_frames` on the columns it needs (nothing else is read)."""
    from offline_agent.dataset import TrajectoryDataset

    frames = []
    for path in (reference, new):
        dataset = TrajectoryDataset.open(path)
        steps, episodes = dataset.lazy()
        episodes = episodes.select(EPISODE_COLUMNS).collect()
        if episodes.height == 0:
            raise UserError(f"{path} has no episodes; there is nothing to compare, check the dataset")
        frames += [steps.select(STEP_COLUMNS).collect(), episodes]
    checks = compare_frames(frames[0], frames[1], frames[2], frames[3], config)
    return DriftReport(str(reference), str(new), config or DriftConfig(), checks)


def render_table(report: DriftReport):  # -> rich.table.Table
    """A rich table of the checks, drifted rows in red."""
    from rich.table import Table

    def fmt(value: float) -> str:
        return "-" if math.isnan(value) else f"{value:.4g}"

    table = Table(title=f"reward drift of {report.new} against {report.reference}")
    for column in ("scope", "metric", "test", "n ref", "n new", "ref", "new", "stat", "p", "psi", "status"):
        table.add_column(
            column,
            justify="right" if column in ("n ref", "n new", "ref", "new", "stat", "p", "psi") else "left",
        )
    for c in report.checks:
        status = f"[bold red]drift[/] ({c.reason})" if c.drift else (c.reason or "ok")
        cells = (c.reference_value, c.new_value, c.statistic, c.p_value, c.psi)
        row = [c.scope, c.metric, c.test, str(c.n_reference), str(c.n_new), *map(fmt, cells), status]
        table.add_row(*row, style="red" if c.drift else None)
    return table


def summary_line(report: DriftReport) -> str:
    """One line for the end of the output: the verdict and which checks drifted."""
    drifted = [f"{c.scope}/{c.metric}" for c in report.checks if c.drift]
    if not drifted:
        return f"no drift ({len(report.checks)} checks)"
    return f"DRIFT in {len(drifted)} of {len(report.checks)} checks: {', '.join(drifted)}"
