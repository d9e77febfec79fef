"""Diagnostic (not part of `make bench`): where does a run's greedy policy leave the expert in the episodes it fails?

Plays a run's greedy policy on the episodes `offline-agent evaluate` plays (seeds `episode_seed(seed, i)`),
and at every step asks the simulator which candidate its expert would take. For each failed episode it
prints the steps where the policy's call differs from the expert's: the status line, both calls with
their probabilities pi(a|s) = softmax(Q / tau), and the grounding of both (`learn/grounding.py`). A
departure is not always a mistake (the expert's plan is one of several), but in a failed episode the
mistakes are among them. The summary counts departures by (picked tool -> expert tool) and the failed
episodes in which the policy picked an action it had already taken.

    python benchmarks/greedy_failures.py benchmarks/out/online/logistics-logs400/cql \
        offline_agent/Logistics-v0 --tau 0.3
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    from offline_agent.actions import canonical_action, parse_action
    from offline_agent.envs.loading import make_env, task_text
    from offline_agent.learn.grounding import GROUNDING_FEATURES, grounding
    from offline_agent.learn.policy import EpisodeHistory, Policy
    from offline_agent.simulate import episode_seed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run folder (offline or fine-tuned)")
    parser.add_argument("env", help="a built-in simulator id, e.g. offline_agent/Logistics-v0")
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1000, help="evaluation seed (the online benchmark's)")
    parser.add_argument("--tau", type=float, default=None, help="temperature of the printed probabilities")
    parser.add_argument("--quiet", action="store_true", help="the summary only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = Policy.load(args.run)
    tau = policy.tau if args.tau is None else args.tau
    env = make_env(args.env)
    taken_before = GROUNDING_FEATURES.index("taken_before")
    departures: Counter[tuple[str, str]] = Counter()
    failed = repeated = 0
    for i in range(args.episodes):
        observation, info = env.reset(seed=episode_seed(args.seed, i))
        history = EpisodeHistory(task_text(info, env, observation))
        steps, done = [], False
        while not done:
            text, candidates = str(observation["text"]), observation["candidates"]
            texts = [canonical_action(c) for c in candidates]
            state = policy.render(history, text)
            q = policy.score_batch([state], [candidates], [history.actions()])[0]
            probs = torch.softmax(torch.from_numpy(q) / tau, 0).numpy()
            pick, expert = int(np.argmax(q)), int(env.unwrapped.expert_action())
            if pick != expert:
                steps.append((len(history.turns), text.split("\n")[-1], texts[pick], probs[pick], texts[expert],
                              probs[expert], grounding(state, texts[pick], history.actions()),
                              grounding(state, texts[expert], history.actions())))
            history.turns.append((text, texts[pick]))
            observation, _, terminated, truncated, info = env.step(pick)
            done = terminated or truncated
        if info.get("success", False):
            continue
        failed += 1
        repeated += any(g_pick[taken_before] for *_, g_pick, _ in steps)
        if not args.quiet:
            print(f"--- episode {i} failed after {len(history.turns)} steps")
        for step, status, picked, p_pick, wanted, p_expert, g_pick, g_expert in steps:
            departures[str(parse_action(picked).tool_name), str(parse_action(wanted).tool_name)] += 1
            if not args.quiet:
                print(f"  step {step}: {status[:140]}\n    picked {picked} ({p_pick:.2f}), expert {wanted} "
                      f"({p_expert:.2f})\n    grounding picked {np.round(g_pick, 2)}, expert {np.round(g_expert, 2)}")
    print(f"\n{args.env}: {args.episodes - failed}/{args.episodes} greedy successes; in the {failed} failures, "
          f"{repeated} include a picked action taken before. Grounding order: {', '.join(GROUNDING_FEATURES)}.")
    print("departures in failed episodes (picked tool -> expert tool):")
    for (picked, wanted), n in departures.most_common():
        print(f"  {n:4d}  {picked} -> {wanted}")


if __name__ == "__main__":
    main()
