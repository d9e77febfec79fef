"""Diagnostic (not part of `make bench`): how often does a learned policy pick the expert's candidate?

Trains the given learners on the logs `benchmarks/offline_quality.py` writes (run that first), with
its default budget and seed 0, then walks expert episodes: at each state the simulator's expert
acts, and the learned policy is asked what it would have picked among the same candidates. Per-step
agreement on expert-visited states separates "the features cannot tell the right call" (low
agreement) from "small errors compound in the learner's own episodes" (high agreement, low success).

    python benchmarks/expert_agreement.py --env offline_agent/Logistics-v0 --algos bc cql
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.offline_quality import BUDGETS, make_dataset  # noqa: E402


def main() -> None:
    import torch

    from offline_agent.actions import canonical_action, parse_action
    from offline_agent.envs.loading import make_env
    from offline_agent.learn.features import build_features
    from offline_agent.learn.policy import EpisodeHistory, Policy
    from offline_agent.learn.train import make_config, run_algorithm
    from offline_agent.text.encoder import TextEncoder
    from offline_agent.text.states import StateSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="offline_agent/Logistics-v0")
    parser.add_argument("--algos", nargs="*", default=["bc", "cql"])
    parser.add_argument("--episodes", type=int, default=8, help="expert episodes walked (reset seeds 20000+)")
    parser.add_argument("--workdir", default=str(Path(__file__).parent / "out" / "offline_quality"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    budget = BUDGETS["default"]
    encoder = TextEncoder(max_length=budget["max_length"])
    dataset = make_dataset(args.env, budget["episodes"], Path(args.workdir))
    features = build_features(dataset, encoder, StateSettings(k=budget["k"]))
    env = make_env(args.env)
    for algo in args.algos:
        config = make_config(algo, steps=budget["steps"], batch_size=budget["batch_size"], hidden=budget["hidden"])
        network, _ = run_algorithm(algo, features, config)
        meta = {"algo": algo, "tau": config.tau, **features.state_settings.to_meta()}
        policy = Policy(network, encoder, meta)
        by_tool: dict[str, list[int]] = {}
        for episode in range(args.episodes):
            observation, info = env.reset(seed=20_000 + episode)
            history = EpisodeHistory(info.get("task") or getattr(env.unwrapped, "task", None) or observation["text"])
            done = False
            while not done:
                text, candidates = str(observation["text"]), observation["candidates"]
                expert = int(env.unwrapped.expert_action())
                pick = int(np.argmax(policy.score(policy.render(history, text), candidates)))
                action = canonical_action(candidates[expert])
                tally = by_tool.setdefault(str(parse_action(action).tool_name or "message"), [0, 0])
                tally[0] += pick == expert
                tally[1] += 1
                history.turns.append((text, action))
                observation, _, terminated, truncated, info = env.step(expert)
                done = terminated or truncated
        agree, total = (sum(t[i] for t in by_tool.values()) for i in (0, 1))
        detail = ", ".join(f"{tool} {a}/{n}" for tool, (a, n) in by_tool.items())
        print(f"{args.env} {algo}: the expert's candidate in {agree}/{total} expert-visited states ({detail})")


if __name__ == "__main__":
    main()
