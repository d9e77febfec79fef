"""State aliasing: can frozen MiniLM embeddings tell apart the states where the right action differs?

The offline learner scores actions over frozen embeddings of the state text.
If two states that call for different actions embed to nearly the same vector,
no head on top can separate them, and the encoder itself (or an adapter) would
have to be trained. This measures how often that happens in the built-in
simulators: it rolls out the `noisy:0.5` behaviour policy, renders every decision
state exactly as the learner does (`render_state`, k = 3 turns, 256 tokens),
labels it with the simulator's expert action, embeds the distinct states, and
counts the states whose most similar state *with a different expert action*
is closer than a cosine threshold. It also prints the closest such pairs, to see
what the encoder blurs. The findings are written up in offline_agent/learn/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, write_result  # noqa: E402

ENVS = ["offline_agent/PipelineRepair-v0", "offline_agent/Logistics-v0", "offline_agent/CustomerSupport-v0"]
THRESHOLDS = (0.98, 0.99, 0.995, 0.999)


def labelled_states(env_spec: str, episodes: int, encoder, k: int, seed: int = 0) -> dict[str, set[str]]:
    """Distinct state texts -> the expert actions seen in them (a set: the same text may need several)."""
    from offline_agent.actions import canonical_action
    from offline_agent.envs.loading import make_env
    from offline_agent.envs.policies import make_policy
    from offline_agent.simulate import episode_seed
    from offline_agent.text.states import StateSettings, render_state

    settings = StateSettings(k=k).for_encoder(encoder)
    env = make_env(env_spec)
    behaviour = make_policy("noisy:0.5", seed)
    states: dict[str, set[str]] = {}
    for i in range(episodes):
        obs, info = env.reset(seed=episode_seed(seed, i))
        task = info.get("task") or getattr(env.unwrapped, "task", None)
        turns: list[tuple[str, str]] = []
        done = False
        while not done:
            text = render_state(task, turns, obs["text"], settings, encoder.count_tokens)
            expert = canonical_action(obs["candidates"][env.unwrapped.expert_action()])
            states.setdefault(text, set()).add(expert)
            index = behaviour(env, obs)
            turns.append((obs["text"], canonical_action(obs["candidates"][index])))
            obs, _, terminated, truncated, _ = env.step(index)
            done = terminated or truncated
    return states


def aliasing(states: dict[str, set[str]], encoder) -> tuple[list[int], list[tuple[float, str, str]], int]:
    """Per threshold, the number of states with a conflicting neighbour that close; the closest conflicting
    pairs; the number of texts that need more than one action themselves (aliased by the text, k too small)."""
    import torch

    texts = list(states)
    emb = torch.from_numpy(encoder.encode(texts))  # (S, D)
    sim = emb @ emb.T  # (S, S)
    label = [frozenset(states[t]) for t in texts]
    same = torch.tensor([[a == b for b in label] for a in label])
    sim = sim.masked_fill(same, -1.0)  # only pairs whose expert actions differ
    nearest, index = sim.max(1)
    counts = [int((nearest >= t).sum()) for t in THRESHOLDS]
    order = torch.argsort(nearest, descending=True)[:6:2]  # pairs come twice
    pairs = [(float(nearest[i]), texts[i], texts[int(index[i])]) for i in order]
    return counts, pairs, sum(len(v) > 1 for v in states.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=256)
    args = parser.parse_args()

    import torch

    from offline_agent.text.encoder import TextEncoder

    torch.set_num_threads(1)
    encoder = TextEncoder(max_length=args.max_length)
    rows, examples = [], []
    for env in ENVS:
        states = labelled_states(env, args.episodes, encoder, args.k)
        counts, pairs, ambiguous = aliasing(states, encoder)
        n = len(states)
        rows.append([env.split("/")[-1], n, ambiguous, *(f"{c} ({c / n:.1%})" for c in counts)])
        for cos, a, b in pairs[:1]:
            examples.append(f"- {env.split('/')[-1]}, cosine {cos:.4f}:\n\n```\n{a[-400:]}\n```\n```\n{b[-400:]}\n```")
        print(rows[-1], file=sys.stderr, flush=True)
    table = (
        f"Distinct decision states of {args.episodes} `noisy:0.5` episodes per simulator (k = {args.k} turns, "
        f"{args.max_length} tokens), and how many have a state with a *different* expert action whose "
        "MiniLM embedding is at least this similar (cosine).\n\n"
        + markdown_table(["environment", "states", "texts needing 2+ actions",
                          *(f"conflict at >= {t}" for t in THRESHOLDS)], rows)
        + "\n\nThe closest conflicting pair of each simulator (last 400 characters of each state):\n\n"
        + "\n\n".join(examples)
    )
    write_result("state_aliasing", "Frozen embeddings: aliased states in the simulators", table,
                 f"python benchmarks/state_aliasing.py --episodes {args.episodes}")


if __name__ == "__main__":
    main()
