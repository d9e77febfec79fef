"""Imitation ceiling: how well can any policy over frozen MiniLM features (and grounding) play each simulator?

The quality targets (offline CQL above the behaviour policy, online fine-tuning to
95%) assume a policy over these features *can* play well. This benchmark measures
that directly, with the easiest learning problem there is: BC on the simulator's
expert, which succeeds in every episode it logs. For each built-in simulator: roll
out `expert` for `--episodes` episodes, ingest, train BC (the library's defaults, 1200
steps of batch 128, as `offline-agent train --algo bc` would), and evaluate the
greedy policy on fresh episodes.

A simulator whose expert cannot be imitated over the frozen features is one where
no learner on those features (CQL, PPO on top of it) can be expected to reach the
expert: the features, not the learner, are what to change there (see
`offline_agent/learn/README.md`, "Frozen encoder, trainable encoder, or an adapter?").
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, write_result  # noqa: E402

ENVS = ["offline_agent/PipelineRepair-v0", "offline_agent/Logistics-v0", "offline_agent/CustomerSupport-v0"]
EVAL_SEED = 7


def ceiling(env: str, episodes: int, steps: int, eval_episodes: int, workdir: Path) -> dict:
    """Expert logs -> BC -> greedy evaluation of one simulator; returns the table's numbers."""
    from offline_agent.evaluate import evaluate
    from offline_agent.ingest import ingest
    from offline_agent.learn.train import train
    from offline_agent.simulate import simulate

    folder = workdir / env.split("/")[-1]
    folder.mkdir(parents=True, exist_ok=True)
    expert = simulate(env, episodes, "expert", 0, folder / "logs.jsonl")
    ingest([folder / "logs.jsonl"], folder / "dataset", overwrite=True)
    train(folder / "dataset", "bc", folder / "bc", steps=steps, batch_size=128, seed=0, overwrite=True)
    report = evaluate(folder / "bc", env, episodes=eval_episodes, seed=EVAL_SEED)
    return {"expert": expert, "bc": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=150, help="expert episodes logged per simulator")
    parser.add_argument("--steps", type=int, default=1200, help="BC gradient steps (batch 128)")
    parser.add_argument("--eval-episodes", type=int, default=50)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()

    started, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for env in ENVS:
            result = ceiling(env, args.episodes, args.steps, args.eval_episodes, Path(tmp))
            bc = result["bc"]
            low, high = bc.ci95
            rows.append([env.split("/")[-1], f"{result['expert'].successes / result['expert'].episodes:.2f}",
                         f"{bc.success_rate:.2f} [{low:.2f}, {high:.2f}]", f"{bc.error_rate:.2f}"])
            print(rows[-1], flush=True)
    table = (
        markdown_table(["simulator", "expert (logs)", "BC on the expert's logs (greedy)", "error observations"],
                       rows)
        + f"\n\n{args.episodes} expert episodes per simulator; BC {args.steps} steps of batch 128 on the frozen "
        f"MiniLM features (k = 3 turns, 256 tokens) and each candidate's grounding, the library defaults otherwise; "
        f"{args.eval_episodes} fresh "
        f"episodes (seeds from {EVAL_SEED}) with 95% Wilson intervals. Whole run: "
        f"{(time.perf_counter() - started) / 60:.1f} min."
    )
    command = "python benchmarks/imitation_ceiling.py " + " ".join(sys.argv[1:])
    if args.no_write:
        print(table)
    else:
        title = "Imitation ceiling of frozen features with grounding (BC on expert logs)"
        write_result("imitation_ceiling", title, table,
                     command.strip())


if __name__ == "__main__":
    main()
