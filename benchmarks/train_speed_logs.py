"""Training speed on logs, at `train`'s defaults: our CQL (grounding included) vs d3rlpy's DiscreteCQL.

`train_speed.py` times the learners on random features with 8 logged candidates a step and no texts, so
without grounding. What a user runs is this: real features of real logs, and CQL reading each (step,
candidate) pair's grounding (`offline_agent.learn.grounding`). Logs without candidates (most real ones)
make CQL score sampled vocabulary actions at every step, so the pairs are new at every step.

For each dataset (a simulated CustomerSupport one of 150 episodes; τ-bench airline and InterCode SQL from
../shared/data/real when it is there), its features are built once through its embedding cache (MiniLM,
the default settings), then: the seconds to build its grounding table (once per training run), and the
gradient steps per second of our CQL at its defaults, of our CQL without grounding, and of d3rlpy's
DiscreteCQL, on the same features, one after the other, each timed after a warm-up run.
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
from benchmarks.common import REAL_SOURCES, markdown_table, write_result  # noqa: E402
from benchmarks.train_speed import steps_per_second  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "train_speed_logs"
#: label -> (source, reward spec); used where ../shared/data/real is present.
REAL_LOGS = {name: REAL_SOURCES[name] for name in ("τ-bench airline", "InterCode SQL")}
SIMULATED = ("CustomerSupport-v0", 150)


def datasets() -> dict[str, Path]:
    """Each dataset's folder, ingested into OUT on first use."""
    from offline_agent.ingest import ingest
    from offline_agent.simulate import simulate

    env, episodes = SIMULATED
    found = {}
    sim = OUT / f"support{episodes}"
    if not (sim / "dataset.json").exists():
        simulate(f"offline_agent/{env}", episodes, "noisy:0.5", 0, OUT / f"support{episodes}.jsonl")
        ingest([OUT / f"support{episodes}.jsonl"], sim, overwrite=True)
    found[f"{env}, {episodes} simulated logs"] = sim
    for label, (source, reward) in REAL_LOGS.items():
        if not source.exists():
            print(f"skipping {label}: {source} is absent", file=sys.stderr)
            continue
        out = OUT / label.split()[0].lower().replace("τ-", "tau")
        if not (out / "dataset.json").exists():
            ingest([source], out, reward=reward, overwrite=True)
        found[label] = out
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed gradient steps per learner")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=None, help="[default: CQL's own, 256]")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()

    import torch

    from offline_agent.learn.cql import CQLConfig
    from offline_agent.learn.features import build_features
    from offline_agent.learn.grounding import GroundingTable
    from offline_agent.text.encoder import TextEncoder, default_encoder_path

    torch.set_num_threads(args.threads)
    batch = args.batch_size or CQLConfig().batch_size
    encoder = TextEncoder(default_encoder_path())
    rows = []
    for label, path in datasets().items():
        features = build_features(path, encoder, keep_texts=True, progress=True)
        start = time.perf_counter()
        GroundingTable(features.state_texts, features.vocab, features.action_id, features.episode_index)
        build = time.perf_counter() - start
        features.grounding_table()  # the learners' own, built before the timing (its cost is the column above)
        ours = steps_per_second("cql", features, args.steps, args.warmup, batch_size=batch)
        plain = steps_per_second("cql", features, args.steps, args.warmup, batch_size=batch, grounding=False)
        d3 = steps_per_second("d3rlpy-cql", features, args.steps, args.warmup, batch_size=batch)
        logged = "all" if bool(features.has_candidates.all()) else (
            "none" if not bool(features.has_candidates.any()) else "some")
        rows.append([label, features.n_steps, len(features.vocab), logged, f"{build:.1f}", f"{ours:.1f}",
                     f"{plain:.1f}", f"{d3:.1f}", f"{ours / d3:.2f}x"])
        print(rows[-1], file=sys.stderr, flush=True)
    table = (
        f"Gradient steps per second at `train`'s defaults (batch {batch}, {args.threads} torch "
        f"thread{'s' if args.threads > 1 else ''}) on "
        "each dataset's own MiniLM features: our CQL reading each pair's grounding (the default), without it, "
        "and d3rlpy's DiscreteCQL (2 x 256, its logsumexp over the whole vocabulary); "
        f"{args.steps} timed steps after {args.warmup} warm-up steps, one after the other in one process. "
        "Steps with logged candidates: where none are, CQL scores 16 sampled vocabulary actions a step. "
        "Grounding table: seconds to build it, once per training run.\n\n"
        + markdown_table(
            ["logs", "steps", "actions", "steps with logged candidates", "grounding table (s)",
             "CQL (ours, default)", "CQL without grounding", "d3rlpy DiscreteCQL", "ours / d3rlpy"],
            rows,
        )
    )
    write_result("train_speed_logs", "Training speed on logs, at the defaults: our CQL vs d3rlpy DiscreteCQL",
                 table, " ".join(["python benchmarks/train_speed_logs.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
