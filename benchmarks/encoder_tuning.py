"""Frozen encoder, tuned top layer, or LoRA: which features let a policy imitate each simulator's expert?

The imitation ceiling (`benchmarks/imitation_ceiling.py`) shows that BC over frozen MiniLM features
cannot imitate the expert of Logistics (a third of the shifts) or CustomerSupport (three in four). This
benchmark asks whether training the encoder with the loss changes that, with the easiest learning
problem there is (BC on expert logs, which succeed every time), so that only the features differ:

- frozen: the library default;
- top layer: the encoder's last transformer layer trained with the BC loss (`tune_encoder_layers=1`);
- LoRA: the same layer frozen, with rank-8 LoRA updates on its Linear layers (`encoder_lora_rank=8`);
- top layer, actions too: the top layer trained from the batch's action texts as well as its states
  (`encoder_action_gradient=True`; otherwise actions follow the layer without gradient).

Each learner trains `--steps` steps of batch `--batch-size` (small: every tuned step runs a transformer
layer forward and backward over the batch's states on the CPU) and plays `--eval-episodes` fresh
episodes greedily. The table also gives the training fit (geometric-mean probability of the expert's
action on the last batches) and the training time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, write_result  # noqa: E402

ENVS = ["offline_agent/Logistics-v0", "offline_agent/CustomerSupport-v0"]
EVAL_SEED = 7  # the imitation ceiling's evaluation episodes
VARIANTS = {
    "frozen": {},
    "top layer": {"tune_encoder_layers": 1, "encoder_learning_rate": 1e-4},
    "LoRA r=8": {"tune_encoder_layers": 1, "encoder_lora_rank": 8, "encoder_learning_rate": 1e-3},
    "top layer, actions too": {"tune_encoder_layers": 1, "encoder_learning_rate": 1e-4,
                               "encoder_action_gradient": True},
}


def run_env(env: str, args: argparse.Namespace, workdir: Path, log) -> list[list[str]]:
    from offline_agent.evaluate import evaluate
    from offline_agent.ingest import ingest
    from offline_agent.learn.train import train
    from offline_agent.simulate import simulate

    folder = workdir / env.split("/")[-1]
    folder.mkdir(parents=True, exist_ok=True)
    simulate(env, args.episodes, "expert", 0, folder / "logs.jsonl")
    ingest([folder / "logs.jsonl"], folder / "dataset", overwrite=True)
    rows = []
    for name, settings in VARIANTS.items():
        started = time.perf_counter()
        # Without grounding (learn/grounding.py): the question here is what the text features carry.
        result = train(folder / "dataset", "bc", folder / name, steps=args.steps, batch_size=args.batch_size,
                       seed=0, overwrite=True, settings={"grounding": False, **settings})
        trained = time.perf_counter() - started
        report = evaluate(folder / name, env, episodes=args.eval_episodes, seed=EVAL_SEED)
        low, high = report.ci95
        tuning = json.loads((folder / name / "train.json").read_text()).get("encoder_tuning") or {}
        rows.append([
            env.split("/")[-1], name, f"{tuning.get('trainable_parameters', 0):,}",
            f"{result.final_metrics['policy/data_prob']:.2f}",
            f"{report.success_rate:.2f} [{low:.2f}, {high:.2f}]", f"{trained / 60:.1f}",
        ])
        log(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="*", default=ENVS)
    parser.add_argument("--episodes", type=int, default=150, help="expert episodes logged per simulator")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--eval-episodes", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    started, rows = time.perf_counter(), []
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        for env in args.envs:
            rows += run_env(env, args, Path(tmp), log)
    table = (
        markdown_table(["simulator", "encoder", "trained encoder parameters", "training fit",
                        "BC on the expert's logs (greedy)", "train min"], rows)
        + f"\n\n{args.episodes} expert episodes per simulator; BC {args.steps} steps of batch {args.batch_size}; "
        f"top layer: MiniLM's last layer trained at lr 1e-4; LoRA: rank 8 (alpha 16) on that layer's six Linear "
        f"layers at lr 1e-3; actions too: the top layer also learns from the batch's action texts; the head at "
        f"3e-4 everywhere. Training fit: geometric-mean probability of the "
        f"expert's action on the last batch. {args.eval_episodes} fresh episodes (seeds from {EVAL_SEED}) with "
        f"95% Wilson intervals; {args.threads} torch threads. Whole run: "
        f"{(time.perf_counter() - started) / 60:.1f} min."
    )
    command = "python benchmarks/encoder_tuning.py " + " ".join(sys.argv[1:])
    if args.no_write:
        print(table)
    else:
        write_result("encoder_tuning", "Frozen encoder, tuned top layer or LoRA (BC on expert logs)", table,
                     command.strip())


if __name__ == "__main__":
    main()
