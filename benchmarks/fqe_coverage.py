"""Does evaluate's FQE interval cover the value the policy really gets?

For each built-in simulator and each log size (`--logs`, default 150, 600 and
800 episodes of the `noisy:0.5` behaviour, seed 0): simulate and ingest the logs,
train CQL with the library's defaults (the same offline stage as the online
benchmark's `--logs N` starts, in the same cache folders, so the 800-episode
runs are the fine-tuning benchmark's starts and are trained once), then ask the product what a user would
ask, `evaluate RUN --dataset DATA` (`off_policy_value`: FQE fitted on the
dataset's held-out test split, a 95% interval over the split's first states and
3 refits on resamples of its episodes, and the coverage of the policy's choices
by the logs).
The truth is the same greedy policy played in the simulator on `--episodes`
fresh episodes: its mean discounted return (gamma of the run), with a 95%
normal interval of its own. "Covers" means the FQE interval contains the
simulated mean. Beside it, evaluate's bounds (`--fqe-bounds`, the default):
fits on every logged transition assuming the logs' lowest, then highest return
wherever the logs do not show the policy's choice near a state, and whether
they contain it. `--reuse-simulated` refits FQE but keeps a cached row's
simulated value when its policy's weights are the same.

Everything is cached under `--workdir` (logs, datasets with their embedding
caches, runs, and each row's numbers), so `--tables-only` rebuilds the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import BEHAVIOUR, markdown_table, reproduce_command, write_result  # noqa: E402
from benchmarks.online import SIMS, offline_folder, offline_stage  # noqa: E402

EVAL_SEED = 3000  # simulated episodes never used in the logs (seed 0) or the other benchmarks' evaluations


def mean_interval(values: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """(mean, low, high): the normal 95% interval of a mean of independent episodes."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def covers(low: float, high: float, value: float) -> bool:
    return low <= value <= high


def run_row(sim: str, logs: int, args: argparse.Namespace) -> dict:
    """One simulator and log size: train (or reuse) CQL, FQE it on the test split, play it in the simulator."""
    from offline_agent.evaluate import off_policy_value
    from offline_agent.learn.cql import CQLConfig
    from offline_agent.learn.policy import Policy
    from offline_agent.online.finetune import file_sha256
    from offline_agent.online.play import rollout_policy

    folder = offline_folder(Path(args.workdir), sim, logs)
    saved = folder / "fqe_coverage.json"
    if saved.is_file() and args.reuse:
        return json.loads(saved.read_text())
    started = time.perf_counter()
    data, run = folder / "data", offline_stage(sim, Path(args.workdir), CQLConfig().steps, logs=logs)
    weights = file_sha256(run / "policy.safetensors")
    report = off_policy_value(run, data, runs=args.fqe_runs)
    # The ablation: FQE whose Q also reads each pair's grounding (`--fqe-grounding`), without bounds.
    grounded = off_policy_value(run, data, runs=args.fqe_runs, bounds=False, grounding=True)
    old = json.loads(saved.read_text()) if saved.is_file() else {}
    if args.reuse_simulated and old.get("weights") == weights and old.get("episodes") == args.episodes:
        # The same policy played the same episodes before: its simulated value is that one.
        true, (true_low, true_high), outcomes = old["true"], old["true_ci95"], None
    else:
        policy = Policy.load(run, precision=args.encoder_precision)
        outcomes = rollout_policy(SIMS[sim], policy, args.episodes, EVAL_SEED, report.gamma)
        true, true_low, true_high = mean_interval([o.discounted_return for o in outcomes])
    row = {
        "sim": sim, "logs": logs, "test_episodes": report.episodes, "fqe": report.fqe_value,
        "fqe_ci95": list(report.fqe_ci95), "fqe_bounds": list(report.fqe_bounds), "coverage": report.coverage,
        "grounded": grounded.fqe_value, "grounded_ci95": list(grounded.fqe_ci95),
        "behaviour": report.behaviour_value, "logged_returns": list(report.logged_returns),
        "true": true, "true_ci95": [true_low, true_high], "episodes": args.episodes, "weights": weights,
        "success": old["success"] if outcomes is None else sum(o.success for o in outcomes) / len(outcomes),
        "seconds": time.perf_counter() - started,
    }
    saved.write_text(json.dumps(row, indent=1) + "\n")
    print(f"[{sim}, {logs} logs] FQE {row['fqe']:.3f} {row['fqe_ci95']} vs simulated {true:.3f} "
          f"({row['seconds']:.0f} s)", flush=True)
    return row


def table_row(row: dict) -> list[object]:
    from offline_agent.evaluate import LOW_COVERAGE, digits_below, fqe_doubt_reasons

    low, high = row["fqe_ci95"]
    t_low, t_high = row["true_ci95"]
    logged_returns = tuple(row.get("logged_returns", (math.nan, math.nan)))  # rows saved before it: not checked
    reasons = fqe_doubt_reasons(row["coverage"], row["test_episodes"], row["fqe"], logged_returns)
    doubts = [fact for fact, _ in reasons]  # evaluate's words
    trusted = f"no: {'; '.join(doubts)}" if doubts else "yes"
    b_low, b_high = row.get("fqe_bounds", [math.nan, math.nan])
    g_low, g_high = row.get("grounded_ci95", [math.nan, math.nan])
    return [
        row["sim"], row["logs"], row["test_episodes"], f"{row['fqe']:.3f} [{low:.3f}, {high:.3f}]",
        f"{row['true']:.3f} [{t_low:.3f}, {t_high:.3f}]", "yes" if covers(low, high, row["true"]) else "**no**",
        f"{row.get('grounded', math.nan):.3f} [{g_low:.3f}, {g_high:.3f}]",
        "yes" if covers(g_low, g_high, row["true"]) else "**no**",
        f"[{b_low:.3f}, {b_high:.3f}]", "yes" if covers(b_low, b_high, row["true"]) else "**no**",
        digits_below(row["coverage"], LOW_COVERAGE), trusted, f"{row['behaviour']:.3f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sims", nargs="*", default=list(SIMS), choices=list(SIMS))
    parser.add_argument("--logs", type=int, nargs="*", default=[150, 600, 800], help="logged episodes per setting")
    parser.add_argument("--episodes", type=int, default=300, help="simulated episodes for the true value")
    parser.add_argument("--fqe-runs", type=int, default=3, help="FQE refits per estimate (evaluate's default)")
    parser.add_argument("--encoder-precision", choices=["fp32", "bf16"], default="bf16",
                        help="the encoder's precision in the simulated episodes")
    parser.add_argument("--workdir", default=str(Path(__file__).parent / "out" / "online"),
                        help="where <sim>-logs<N>/ keeps logs, dataset, run and row (the online benchmark's cache)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reuse", action="store_true", help="keep the rows already measured in --workdir")
    parser.add_argument("--tables-only", action="store_true", help="rebuild the table from --workdir")
    parser.add_argument("--reuse-simulated", action="store_true",
                        help="refit FQE but keep a row's simulated value where its policy's weights are unchanged")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    args.reuse = args.reuse or args.tables_only
    started = time.perf_counter()
    rows = []
    for sim in args.sims:
        for logs in args.logs:
            if args.tables_only and not (offline_folder(Path(args.workdir), sim, logs) / "fqe_coverage.json").is_file():
                continue
            rows.append(run_row(sim, logs, args))
    covered = sum(covers(*r["fqe_ci95"], r["true"]) for r in rows)
    bounded = sum(covers(*r.get("fqe_bounds", [math.nan, math.nan]), r["true"]) for r in rows)
    grounded = sum(covers(*r.get("grounded_ci95", [math.nan, math.nan]), r["true"]) for r in rows)
    table = (
        f"CQL (library defaults, seed 0) trained on N logged episodes of `{BEHAVIOUR}`; `evaluate --dataset`'s "
        "FQE on the dataset's test split (the fit on the split gives the value; its 95% normal interval adds the "
        f"variance over the split's first states and that of {args.fqe_runs} refits on bootstrap resamples of its "
        "episodes), against the "
        f"same greedy policy's mean discounted return over {args.episodes} simulated episodes (95% normal "
        f"interval; seeds from {EVAL_SEED}). FQE's Q reads the state and action vectors (the "
        "default); with grounding (`--fqe-grounding`): the same value and interval from a Q that also reads each "
        "(state, action) pair's grounding in its episode, as the policies do. Coverage: the share of the policy's "
        "test-split choices logged in one "
        "of the 10 most similar states; below 0.5, or with a test split of fewer than 50 episodes, `evaluate` says "
        "not to trust the value. Bounds: as many fits on every logged transition (valued at the test split's first "
        "states) assuming the logs' lowest, then highest discounted return wherever the policy's choice is not the "
        "logged action of one of the 10 most similar logged states (the 2.5% point of the first, the 97.5% point of "
        "the second).\n\n"
        + markdown_table(
            ["simulator", "logs", "test episodes", "FQE [95% interval]", "simulated [95% interval]", "covers",
             "FQE with grounding", "covers", "bounds", "bounds cover", "coverage", "trusted by evaluate",
             "behaviour (test logs)"],
            [table_row(r) for r in rows],
        )
        + f"\n\nThe interval covers the simulated value in {covered} of {len(rows)} settings (with grounding "
        f"{grounded}), the bounds in {bounded}."
        + ("" if args.tables_only else f" Wall time {(time.perf_counter() - started) / 60:.1f} min"
           + (", the simulated values of unchanged policies reused." if args.reuse_simulated else "."))
    )
    write_result("fqe_coverage", "Off-policy evaluation: does the FQE interval cover the true value?", table,
                 reproduce_command("fqe_coverage.py", leave_out=("--tables-only", "--reuse", "--reuse-simulated")))


if __name__ == "__main__":
    main()
