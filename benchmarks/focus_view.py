"""Experiment (not part of `make bench`): does a second view of the state, its current observation, help?

The learner's state vector is MiniLM's mean-pooled embedding of a long text (task + last k turns +
current observation). This script trains over the encoder's observation view instead (`TextEncoder(
observation_view=True)`, what `train --observation-view` uses): a state text's vector is
[MiniLM(state); MiniLM(current observation)] / sqrt(2), an action's [MiniLM(action); MiniLM(action)] /
sqrt(2), and the product phi(s) * psi(a) also pairs the current observation with the action. It trains the given
learners on the logs that `benchmarks/offline_quality.py` writes (run that first) with its default
budget, and plays fresh episodes with the same reset seeds, so its numbers compare with that table's.

    python benchmarks/focus_view.py --env offline_agent/Logistics-v0 --algos cql bc --seeds 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.offline_quality import BUDGETS, EVAL_SEED, make_dataset  # noqa: E402


def main() -> None:
    import torch

    from offline_agent.learn.features import build_features
    from offline_agent.learn.policy import Policy
    from offline_agent.learn.train import make_config, run_algorithm
    from offline_agent.online.play import rollout_policy
    from offline_agent.text.encoder import TextEncoder
    from offline_agent.text.states import StateSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="offline_agent/Logistics-v0")
    parser.add_argument("--algos", nargs="*", default=["cql", "bc"])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--workdir", default=str(Path(__file__).parent / "out" / "offline_quality"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    budget = BUDGETS["default"]
    dataset = make_dataset(args.env, budget["episodes"], Path(args.workdir))
    encoder = TextEncoder(max_length=budget["max_length"], observation_view=True)
    state_settings = StateSettings(k=budget["k"], observation_view=True)
    features = build_features(dataset, encoder, state_settings, cache_root=Path(args.workdir) / "focus_cache")
    memo: dict = {}
    for seed in range(args.seeds):
        for algo in args.algos:
            t = time.perf_counter()
            config = make_config(algo, steps=budget["steps"], batch_size=budget["batch_size"],
                                 hidden=budget["hidden"], seed=seed)
            network, _ = run_algorithm(algo, features, config)
            meta = {"algo": algo, "tau": config.tau, **features.state_settings.to_meta()}
            outcomes = rollout_policy(args.env, Policy(network, encoder, meta, memo=memo),
                                      budget["eval_episodes"], EVAL_SEED + seed)
            wins = sum(o.success for o in outcomes)
            print(f"{args.env} seed {seed} {algo} + focus view: {wins}/{len(outcomes)} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
