"""Built-in simulators: steps per second on one core, and how the scripted behaviour policies do.

Speed: each simulator steps for `--seconds` with uniformly random candidate
indices drawn ahead of time, so the number is the environment's own cost
(reset included, as episodes end); once unwrapped, once through `gym.make`'s
wrappers (order enforcing, passive checker) as training code would see it.
Target: 5,000+ steps/s per core.

Quality: success rate, with a 95% Wilson interval, of `expert`, `random`,
`noisy:0.5` and `llm-like` over `--episodes` episodes each (seed 0). The
offline-RL benchmark needs random well below 15% and noisy:0.5 in 20-50%.
Prints markdown tables and writes them to benchmarks/results/envs.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, write_result  # noqa: E402
from offline_agent.envs import BUILTIN_ENVS, make_env, make_policy  # noqa: E402
from offline_agent.simulate import rollout, wilson_interval  # noqa: E402

POLICIES = ("expert", "random", "noisy:0.5", "llm-like")


def steps_per_second(env, seconds: float) -> float:
    rng = random.Random(0)
    actions = [rng.randrange(env.action_space.n) for _ in range(4096)]
    steps = episode = 0
    env.reset(seed=episode)
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for action in actions:
            _, _, terminated, truncated, _ = env.step(action)
            steps += 1
            if terminated or truncated:
                episode += 1
                env.reset(seed=episode)
    return steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="timed stepping per simulator and mode")
    parser.add_argument("--episodes", type=int, default=1000, help="episodes per behaviour policy")
    args = parser.parse_args()

    speed_rows, quality_rows = [], []
    for env_id in sorted(BUILTIN_ENVS):
        raw = steps_per_second(make_env(env_id).unwrapped, args.seconds)
        wrapped = steps_per_second(make_env(env_id), args.seconds)
        speed_rows.append([f"`{env_id}`", f"{raw:,.0f}", f"{wrapped:,.0f}"])
        row = [f"`{env_id}`"]
        for spec in POLICIES:
            results = rollout(make_env(env_id), make_policy(spec, 0), args.episodes, seed=0)
            wins = sum(r.success for r in results)
            low, high = wilson_interval(wins, args.episodes)
            mean_steps = sum(r.n_steps for r in results) / args.episodes
            row.append(f"{wins / args.episodes:.3f} [{low:.2f}, {high:.2f}] ({mean_steps:.1f} steps)")
        quality_rows.append(row)
        print(f"{env_id}: done", file=sys.stderr)

    speed = markdown_table(["simulator", "steps/s (unwrapped)", "steps/s (gym.make)"], speed_rows)
    quality = markdown_table(["simulator", *POLICIES], quality_rows)
    table = (
        f"{speed}\n\nBehaviour policies: success rate [95% Wilson interval] (mean episode length), "
        f"{args.episodes} episodes each, seed 0.\n\n{quality}"
    )
    command = f"python benchmarks/envs.py --seconds {args.seconds:g} --episodes {args.episodes}"
    write_result("envs", "Built-in simulators: speed on one core, behaviour policies", table, command)


if __name__ == "__main__":
    main()
