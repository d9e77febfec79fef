"""Training speed: gradient steps per second of our CQL and d3rlpy's DiscreteCQL on the same features.

Both learners train on one `Features` object (the same tensors), with the same
batch size, hidden width (two layers of 256), optimiser and learning rate, in
one process, one after the other, for each torch thread count asked for. The
features have the shape of a simulator dataset (N steps, D = 384 MiniLM
dimensions, V vocabulary actions, C = 8 candidates per step) with random unit
vectors for embeddings: speed does not depend on their values, and random
features keep this benchmark free of the encoder's cost (`embed.md` measures
that), and of grounding, which needs texts: `train_speed_logs.py` times the
learners at `train`'s defaults on the features of real and simulated logs.

The learners do different work per step. d3rlpy's Q network maps a state to
all V values at once (one MLP pass per state) and its conservative logsumexp
runs over the whole vocabulary. Ours scores each step's candidates, for the
current and the next state, with twin heads, a double-Q target and Cal-QL's
floor. Its default head (`--head factorised`) runs a state tower once per state
and an action tower once per distinct action, with a small per-pair layer on
top; the pairwise head (`--head pairwise`, the earlier design) runs every
(state, candidate) pair through its wide layers. BC (one pairwise head, current
state only) is listed as well. Each learner runs at its own default width
unless `--hidden` is given (factorised towers 128, pairwise 256, d3rlpy 256).
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
    from offline_agent.text.states import StateSettings

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
        state_settings=StateSettings(),
        gamma=0.99,
    )


#: The learners timed: a column label -> (algorithm, extra settings).
LEARNERS = {
    "CQL (ours, factorised head)": ("cql", {}),
    "CQL (ours, pairwise head)": ("cql", {"head": "pairwise"}),
    "d3rlpy DiscreteCQL": ("d3rlpy-cql", {}),
    "BC": ("bc", {}),
}


def steps_per_second(algo: str, features, steps: int, warmup: int, **settings) -> float:
    """Steps per second of `algo` with `settings` (None values: the learner's defaults) after `warmup` steps (a
    separate short run that warms caches and allocator)."""
    from offline_agent.learn.train import make_config, run_algorithm

    settings = {"log_every": max(steps, 1), **settings}
    run_algorithm(algo, features, make_config(algo, steps=warmup, **settings))
    start = time.perf_counter()
    run_algorithm(algo, features, make_config(algo, steps=steps, **settings))
    return steps / (time.perf_counter() - start)


def settings_of(algo: str, batch_size: int, hidden: int | None, **extra) -> dict:
    """A learner's settings here: `hidden` None is its own default width, and no grounding (synthetic features
    have no texts to ground candidates in)."""
    grounding = {} if algo == "d3rlpy-cql" else {"grounding": False}
    return {"batch_size": batch_size, "hidden": hidden, **grounding, **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed gradient steps per learner")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[128, 256])
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2], help="torch thread counts to time")
    parser.add_argument("--hidden", type=int, default=None, help="one width for every learner [default: each own]")
    parser.add_argument("--n-steps", type=int, default=20_000, help="dataset steps")
    parser.add_argument("--n-actions", type=int, default=150, help="vocabulary size")
    args = parser.parse_args()

    import torch

    features = synthetic_features(args.n_steps, args.n_actions, 384, 8, episode_len=13)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch_sizes:
            rate = {
                label: steps_per_second(algo, features, args.steps, args.warmup,
                                        **settings_of(algo, batch, args.hidden, **extra))
                for label, (algo, extra) in LEARNERS.items()
            }
            ours, d3 = rate["CQL (ours, factorised head)"], rate["d3rlpy DiscreteCQL"]
            rows.append([threads, batch, *(f"{r:.1f}" for r in rate.values()), f"{ours / d3:.2f}x"])
            print(rows[-1], file=sys.stderr, flush=True)
    widths = f"hidden width {args.hidden} for every learner" if args.hidden else (
        "each learner at its default width (factorised towers 128, pairwise head 256, d3rlpy 2 x 256, BC 256)")
    table = (
        f"Gradient steps per second on the same features ({features.n_steps} steps, D = 384, "
        f"V = {args.n_actions} actions, 8 candidates per step), {widths}, "
        f"{args.steps} timed steps after {args.warmup} warm-up steps, learners one after the other in one process.\n\n"
        + markdown_table(["torch threads", "batch", *LEARNERS, "factorised / d3rlpy"], rows)
    )
    name = "train_speed" if args.hidden is None else f"train_speed_hidden{args.hidden}"
    write_result(name, "Training speed: our CQL vs d3rlpy DiscreteCQL", table,
                 " ".join(["python benchmarks/train_speed.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
