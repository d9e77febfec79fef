"""One online fine-tuning setting over several fine-tuning seeds, in one table.

`python benchmarks/online_seeds.py --seeds 0 1 2 --name NAME -- ONLINE_ARGS` runs
`benchmarks/online.py ONLINE_ARGS --seed N --reuse` for each seed (a finished run
of the same settings is kept, and evaluated again), then reads every seed's
cached evaluations and metrics and writes `benchmarks/results/NAME.md`: per
simulator, the offline start, the fine-tuned greedy policy of each seed, all
seeds' evaluation episodes pooled (95% Wilson interval), the per-step KL to the
offline policy (mean over seeds' runs / the largest iteration of any seed), and
the worst early dip of any seed. The seeds share the offline stage and the
evaluation episodes, so the seeds' spread is the fine-tuning's own.

Each seed's own table stays in benchmarks/results/online<tag>_seedN.md (seed 0:
no suffix). `--tables-only` skips the runs. `--sims` and `--seeds` run a part
(e.g. one simulator and seed per process, side by side on 2 cores), after
which a `--tables-only` call writes the whole table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, reproduce_command, write_result  # noqa: E402
from benchmarks.online import cached_runs, parse_args, rate, runs_folder, variant  # noqa: E402

HERE = Path(__file__).resolve().parent


def seed_runs(online_args: list[str], seed: int, sim: str) -> tuple[tuple[int, int], dict] | None:
    """The cached (offline evaluation, runs) of one seed's run of `sim` under `online_args`; None where that seed
    has not finished (no evaluation of its fine-tuned policy yet)."""
    args = parse_args([*online_args, "--seed", str(seed)])
    folder = runs_folder(Path(args.cache), sim, args)
    if not (folder / "evals.json").is_file():
        return None
    cached = cached_runs(folder)
    return cached if "finetune" in cached[1] else None


def result_name(online_args: list[str], seed: int) -> str:
    """The name `benchmarks/online.py` gives one seed's result ('online_logs800_tau03_..._seed1')."""
    return "online" + variant(parse_args([*online_args, "--seed", str(seed)])).replace("-", "_").replace(".", "")


def pooled_rate(successes: int, n: int) -> str:
    """A pooled success rate to three decimals ('0.948 (0.927-0.964)'): 600 episodes tell 0.948 from 0.95."""
    return rate(successes, n, digits=3)


def pooled(evals: list[tuple[int, int]]) -> tuple[int, int]:
    """Successes and episodes of several evaluations taken together."""
    return sum(s for s, _ in evals), sum(n for _, n in evals)


def worst_dip(start: float, early: list[dict[int, tuple[int, int]]]) -> str:
    """The lowest early evaluation of any seed against the offline start ('0.88 -> 0.84 after 1: no')."""
    points = [(s / n, k) for runs in early for k, (s, n) in runs.items()]
    if not points:
        return "-"
    low, k = min(points)
    return f"{start:.2f} -> {low:.2f} after {k}: {'yes' if low < start - 0.10 else 'no'}"


def seeds_row(sim: str, seeds: list[int], online_args: list[str]) -> list[object]:
    """One simulator's row: offline, each seed ("not run" where it has not finished), the finished seeds pooled,
    KL, worst dip."""
    by_seed = [seed_runs(online_args, seed, sim) for seed in seeds]
    runs = [r for r in by_seed if r is not None]
    if not runs:
        raise SystemExit(f"{sim}: no seed of these settings has finished: run it first (without --tables-only)")
    offline = runs[0][0]
    if any(r[0] != offline for r in runs):
        raise SystemExit(f"{sim}: the seeds' offline evaluations differ ({[r[0] for r in runs]}): rerun with one "
                         "--episodes for every seed")
    finetuned = [r[1]["finetune"]["eval"] for r in runs]
    kl = [r[1]["finetune"]["metrics"]["objective/kl"] for r in runs]
    kl_mean = sum(float(k.mean()) for k in kl) / len(kl)
    return [
        sim, rate(*offline), *("not run" if r is None else rate(*r[1]["finetune"]["eval"]) for r in by_seed),
        pooled_rate(*pooled(finetuned)),
        f"{kl_mean:.3f} / {max(float(k.max()) for k in kl):.3f}",
        worst_dip(offline[0] / offline[1], [r[1]["early"] for r in runs]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--name", required=True, help="the result's name (benchmarks/results/NAME.md)")
    parser.add_argument("--title", default="Online fine-tuning over fine-tuning seeds")
    parser.add_argument("--tables-only", action="store_true", help="only rebuild the table from the caches")
    parser.add_argument("online_args", nargs=argparse.REMAINDER, help="-- then benchmarks/online.py's arguments")
    args = parser.parse_args()
    online_args = [a for a in args.online_args if a != "--"]
    settings = parse_args(online_args)
    if not args.tables_only:
        for seed in args.seeds:
            subprocess.run([sys.executable, str(HERE / "online.py"), *online_args, "--seed", str(seed), "--reuse"],
                           check=True)
    rows = [seeds_row(sim, args.seeds, online_args) for sim in settings.sims]
    per_seed = ", ".join(f"benchmarks/results/{result_name(online_args, s)}.md" for s in args.seeds)
    table = (
        markdown_table(
            ["simulator", "offline CQL", *(f"fine-tuned, seed {s}" for s in args.seeds), "all seeds",
             "KL to offline (mean / max)", "worst early dip > 10 pts"],
            rows,
        )
        + f"\n\nSuccess rate (95% Wilson interval) of the greedy policy over {settings.episodes} evaluation episodes "
        f"(the same for every policy and seed); all seeds: the evaluation episodes of the seeds that ran "
        "pooled. KL: the per-step KL to the offline policy of the sampled rollouts, the mean over the seeds' "
        "iterations / the largest iteration of any seed. Early dip: the lowest greedy evaluation of any seed "
        f"after {', '.join(map(str, settings.dip_iterations))} iteration(s) against the offline policy. Each "
        f"seed's settings, timings and steps to 95% are in its own table: {per_seed}."
    )
    write_result(args.name, args.title, table, reproduce_command("online_seeds.py"))


if __name__ == "__main__":
    main()
