"""Does the rollouts' encoder precision change what a policy does? Greedy success in fp32, bf16 and int8.

bf16 and int8 (`--encoder-precision`) stand in for the fp32 vectors a policy was trained on; bf16's are within
cosine 0.9999 of them, int8's within 0.99. Each simulator's CQL policy of the online benchmark's offline stage
(trained on `--logs` simulated episodes, cached under `--cache`, shared with `benchmarks/online.py`) plays the same
`--episodes` evaluation episodes (seed 12345) once per precision, 8 environments, 2 torch threads; the table
gives the success rate with its 95% Wilson interval, and the evaluation's seconds (the encoder's built int8
model included, ~3 s).

Writes benchmarks/results/encoder_precision.md. About 10 minutes on 2 cores with the offline stages cached:
`python benchmarks/encoder_precision.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16", "int8")


def precision_rows(runs: dict[str, Path], episodes: int, seed: int, threads: int) -> list[list[object]]:
    """One row per simulator: success [95% interval] and seconds of `episodes` greedy episodes per precision."""
    import torch

    from benchmarks.online import SIMS
    from offline_agent.evaluate import evaluate

    torch.set_num_threads(threads)
    rows = []
    for sim, run in runs.items():
        row: list[object] = [SIMS[sim]]
        for precision in PRECISIONS:
            start = time.perf_counter()
            report = evaluate(run, SIMS[sim], episodes=episodes, seed=seed, encoder_precision=precision, n_envs=8)
            seconds = time.perf_counter() - start
            low, high = report.ci95
            row += [f"{report.success_rate:.3f} [{low:.3f}, {high:.3f}]", f"{seconds:.0f}"]
            print(f"{sim} {precision}: success {report.success_rate:.3f} in {seconds:.0f} s", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    from benchmarks.online import SIMS, offline_stage

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sims", nargs="*", default=list(SIMS), choices=list(SIMS))
    parser.add_argument("--cache", default=str(REPO / "benchmarks" / "out" / "online"),
                        help="the online benchmark's offline stages")
    parser.add_argument("--logs", type=int, default=800, help="simulated episodes the CQL policies were trained on")
    parser.add_argument("--cql-steps", type=int, default=2000, help="CQL steps of an offline stage not yet cached")
    parser.add_argument("--episodes", type=int, default=200, help="evaluation episodes per precision")
    parser.add_argument("--seed", type=int, default=12345, help="evaluation seed")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()

    runs = {sim: offline_stage(sim, Path(args.cache), args.cql_steps, logs=args.logs) for sim in args.sims}
    rows = precision_rows(runs, args.episodes, args.seed, args.threads)
    header = ["simulator"] + [f"{p} {what}" for p in PRECISIONS for what in ("success", "seconds")]
    table = markdown_table(header, rows) + (
        f"\n\nThe CQL policy of each simulator (the online benchmark's offline stage: {args.logs} simulated episodes "
        f"of the noisy:0.5 behaviour, trained on fp32 vectors), greedy, on the same {args.episodes} evaluation "
        f"episodes (seed {args.seed}) with each rollout encoder precision; 8 environments, {args.threads} torch "
        "threads. Success: rate [95% Wilson interval]. Seconds: the whole evaluation, the policy's load and, for "
        "int8, the quantised model's build included. A checkpoint's known texts (`texts.safetensors`), where it "
        "has them, are fp32 vectors in every column."
    )
    command = "python benchmarks/encoder_precision.py " + " ".join(sys.argv[1:])
    if args.no_write:
        print(table)
    else:
        write_result("encoder_precision", "Rollout encoder precision: greedy success in fp32, bf16 and int8", table,
                     command.strip())


if __name__ == "__main__":
    main()
