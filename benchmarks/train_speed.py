"""Training speed: gradient steps per second of our CQL and d3rlpy's DiscreteCQL on the same features.

Both learners train on one `Features` object (the same tensors), with the same
batch size, hidden width (two layers of 256), optimiser and learning rate, in
one process, one after the other, for each torch thread count asked for. The
features have the shape of a simulator dataset (N steps, D = 384 MiniLM
dimensions, V vocabulary actions, C = 8 candidates per step) with random unit
vectors for embeddings: speed does not depend on their values, and random
features keep this benchmark free of the encoder's cost (`embed.md` measures
that). `--dataset PATH --encoder` would use a real dataset's features instead.

The two do different work per step, which is the point of the comparison:
d3rlpy's Q network maps a state to all V values at once (one MLP pass per
state) and its conservative logsumexp runs over the whole vocabulary; ours
scores each (state, candidate) pair with an MLP over [phi(s), psi(a),
phi(s) * psi(a)] (one pass per candidate, for the current and the next state,
twin heads) and its logsumexp runs over the step's candidates only. BC (one
head, current state only) is listed as the floor of a pairwise scorer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, write_result  # noqa: E402


def synthetic_features(n_steps: int, n_actions: int, dim: int, n_candidates: int, episode_len: int, seed: int = 0):
    """A `Features` with random unit embeddings and the structure of a logged dataset."""
    import torch

    from offline_agent.learn.features import Features

    g = torch.Generator().manual_seed(seed)
    n_episodes = n_steps // episode_len
    n = n_episodes * episode_len
    episode_index = torch.arange(n_episodes).repeat_interleave(episode_len)
    last = torch.zeros(n, dtype=torch.bool)
    last[episode_len - 1 :: episode_len] = True
    next_index = torch.where(last, torch.tensor(-1), torch.arange(1, n + 1))
    candidate_ids = torch.stack([torch.randperm(n_actions, generator=g)[:n_candidates] for _ in range(n)])
    action_id = candidate_ids[torch.arange(n), torch.randint(n_candidates, (n,), generator=g)]
    reward = (last & (torch.rand(n, generator=g) < 0.4)).float()
    return Features(
        state_emb=torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=1),
        action_emb=torch.nn.functional.normalize(torch.randn(n_actions, dim, generator=g), dim=1),
        vocab=[f"action {i}" for i in range(n_actions)],
        action_id=action_id,
        reward=reward,
        terminated=last,
        next_index=next_index,
        candidate_ids=candidate_ids,
        has_candidates=torch.ones(n, dtype=torch.bool),
        return_to_go=reward,  # not used for speed
        split=torch.zeros(n, dtype=torch.int64),
        episode_index=episode_index,
        step=torch.arange(n) % episode_len,
        episode_ids=[str(i) for i in range(n_episodes)],
        episode_return=reward.view(n_episodes, episode_len).sum(1),
        episode_success=reward.view(n_episodes, episode_len).sum(1),
        episode_split=torch.zeros(n_episodes, dtype=torch.int64),
        encoder_id="random",
        k=3,
        max_tokens=None,
        gamma=0.99,
    )


def steps_per_second(algo: str, features, batch_size: int, hidden: int, steps: int, warmup: int) -> float:
    """Steps per second of `algo` after `warmup` steps (a separate short run that warms caches and allocator)."""
    from offline_agent.learn.train import make_config, run_algorithm

    settings = {"batch_size": batch_size, "hidden": hidden, "log_every": max(steps, 1)}
    if algo != "d3rlpy-cql":
        settings["grounding"] = False  # synthetic features have no texts to ground candidates in
    run_algorithm(algo, features, make_config(algo, steps=warmup, **settings))
    start = time.perf_counter()
    run_algorithm(algo, features, make_config(algo, steps=steps, **settings))
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed gradient steps per learner")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[128, 256])
    parser.add_argument("--threads", type=int, nargs="*", default=[1], help="torch thread counts to time")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--n-steps", type=int, default=20_000, help="dataset steps")
    parser.add_argument("--n-actions", type=int, default=150, help="vocabulary size")
    args = parser.parse_args()

    import torch

    features = synthetic_features(args.n_steps, args.n_actions, 384, 8, episode_len=13)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch_sizes:
            ours = steps_per_second("cql", features, batch, args.hidden, args.steps, args.warmup)
            d3 = steps_per_second("d3rlpy-cql", features, batch, args.hidden, args.steps, args.warmup)
            bc = steps_per_second("bc", features, batch, args.hidden, args.steps, args.warmup)
            rows.append([threads, batch, f"{ours:.1f}", f"{d3:.1f}", f"{ours / d3:.2f}x", f"{bc:.1f}"])
            print(rows[-1], file=sys.stderr, flush=True)
    table = (
        f"Gradient steps per second on the same features ({features.n_steps} steps, D = 384, "
        f"V = {args.n_actions} actions, 8 candidates per step), hidden width {args.hidden}, "
        f"{args.steps} timed steps after {args.warmup} warm-up steps.\n\n"
        + markdown_table(
            ["torch threads", "batch", "CQL (ours) steps/s", "d3rlpy DiscreteCQL steps/s", "ours / d3rlpy",
             "BC steps/s"],
            rows,
        )
    )
    write_result("train_speed", "Training speed: our CQL vs d3rlpy DiscreteCQL", table,
                 "python benchmarks/train_speed.py")


if __name__ == "__main__":
    main()
