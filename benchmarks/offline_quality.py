"""Offline quality: what each learner makes of mediocre logs, measured in the simulators that wrote them.

For each built-in simulator: roll out the `noisy:0.5` behaviour policy (the expert
half of the time, else a random candidate; it succeeds in 30-45% of episodes) for
`--episodes` episodes, ingest the logs, embed them once (frozen MiniLM), then train
BC, filtered BC (top 20% of episodes by return), d3rlpy's DiscreteCQL and our CQL
on the same features with the same number of gradient steps and batch size, for
each of `--seeds` seeds. Every policy then plays `--eval-episodes` fresh episodes
per seed (reset seeds never used in the logs); the behaviour policy plays the same
episodes. Success rates pool the seeds' episodes, with 95% Wilson intervals. For
our CQL, FQE's estimate of its value on the logs' held-out test split is reported
next to the discounted return it actually got in the simulator.

The default budget fits a small CPU box (hidden width 128, 1200 steps of batch 128,
50 evaluation episodes per seed; with 25, CQL and the behaviour policy on CustomerSupport
overlapped by 0.03, and with 50 they still do); `--full` trains longer on more logs with the
library defaults. State texts keep the library's 256 tokens in both: Logistics'
task alone (the order list) is ~100 tokens, and a 128-token window cuts it.
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
from benchmarks.common import BEHAVIOUR, markdown_table, write_result  # noqa: E402

ENVS = ["offline_agent/PipelineRepair-v0", "offline_agent/Logistics-v0", "offline_agent/CustomerSupport-v0"]
ALGOS = ["bc", "filtered-bc", "d3rlpy-cql", "cql-ungrounded", "cql-pairwise", "cql"]
LABELS = {"bc": "BC", "filtered-bc": "filtered BC", "d3rlpy-cql": "d3rlpy DiscreteCQL", "cql": "CQL (ours)",
          "cql-ungrounded": "CQL without grounding", "cql-adapter": "CQL + trainable state adapter",
          "cql-pairwise": "CQL, pairwise head", "cql-mc5": "CQL + Monte-Carlo loss (weight 5)"}
#: Variants: a label of the table -> (algorithm, extra config settings).
VARIANTS = {"cql-adapter": ("cql", {"state_adapter": True}), "cql-ungrounded": ("cql", {"grounding": False}),
            "cql-pairwise": ("cql", {"head": "pairwise"}), "cql-mc5": ("cql", {"mc_weight": 5.0})}
EVAL_SEED = 10_000  # evaluation episodes use reset seeds derived from this, never the logs' seed 0
BUDGETS = {
    "default": {"episodes": 150, "seeds": 3, "steps": 1200, "batch_size": 128, "hidden": 128, "eval_episodes": 50,
                "k": 3, "max_length": 256, "fqe_steps": 1500},
    "full": {"episodes": 600, "seeds": 3, "steps": 3000, "batch_size": 256, "hidden": 256, "eval_episodes": 100,
             "k": 3, "max_length": 256, "fqe_steps": 2000},
}


def cell(successes: int, n: int) -> str:
    from offline_agent.evaluate import wilson_interval

    low, high = wilson_interval(successes, n)
    return f"{successes / n:.2f} [{low:.2f}, {high:.2f}]"


def make_dataset(env: str, episodes: int, workdir: Path) -> Path:
    """The env's behaviour logs, ingested (reused from `workdir` when already there)."""
    from offline_agent.ingest import ingest
    from offline_agent.simulate import simulate

    folder = workdir / env.split("/")[-1] / f"{BEHAVIOUR.replace(':', '_')}-{episodes}"
    dataset = folder / "dataset"
    if not (dataset / "dataset.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        simulate(env, episodes, BEHAVIOUR, 0, folder / "logs.jsonl")
        ingest([folder / "logs.jsonl"], dataset, overwrite=True)
    return dataset


def run_env(env: str, budget: dict, algos: list[str], encoder, workdir: Path, log) -> dict:
    from offline_agent.learn.features import build_features
    from offline_agent.learn.fqe import FQEConfig, fitted_q_evaluation
    from offline_agent.learn.policy import Policy
    from offline_agent.learn.train import make_config, run_algorithm
    from offline_agent.online.play import rollout_policy
    from offline_agent.text.states import StateSettings

    t0 = time.perf_counter()
    dataset = make_dataset(env, budget["episodes"], workdir)
    settings = StateSettings(k=budget["k"], per_turn=encoder.per_turn)
    features = build_features(dataset, encoder, settings, progress=sys.stderr.isatty())
    logged = features.episode_success
    log(f"{env}: {features.describe()} ({features.cache_misses} texts encoded) in {time.perf_counter() - t0:.0f}s")
    result = {"env": env, "logged": (int(logged.nansum()), int((~logged.isnan()).sum())), "algos": {}}
    memo: dict = {}  # embeddings of evaluation states, shared: policies that succeed visit the same ones
    wins = {algo: [0, 0] for algo in ["behaviour", *algos]}
    fqe_values, true_values = [], []
    for seed in range(budget["seeds"]):
        eval_seed = EVAL_SEED + seed
        outcomes = rollout_policy(env, f"behaviour:{BEHAVIOUR}", budget["eval_episodes"], eval_seed)
        wins["behaviour"][0] += sum(o.success for o in outcomes)
        wins["behaviour"][1] += len(outcomes)
        for name in algos:
            algo, extra = VARIANTS.get(name, (name, {}))
            t = time.perf_counter()
            config = make_config(algo, steps=budget["steps"], batch_size=budget["batch_size"], hidden=budget["hidden"],
                                 seed=seed, **extra)
            network, _ = run_algorithm(algo, features, config)
            trained = time.perf_counter() - t
            meta = {"algo": algo, "tau": config.tau, **features.state_settings.to_meta()}
            policy = Policy(network, encoder, meta, memo=memo)
            outcomes = rollout_policy(env, policy, budget["eval_episodes"], eval_seed)
            wins[name][0] += sum(o.success for o in outcomes)
            wins[name][1] += len(outcomes)
            if name == "cql":
                fqe = fitted_q_evaluation(
                    features, network,
                    FQEConfig(steps=budget["fqe_steps"], batch_size=budget["batch_size"], hidden=budget["hidden"],
                              seed=seed, split="test"),
                )
                fqe_values.append(fqe.value)
                true_values.append(sum(o.discounted_return for o in outcomes) / len(outcomes))
                result["behaviour_test_value"] = fqe.behaviour_value
            log(f"  seed {seed} {name}: {sum(o.success for o in outcomes)}/{len(outcomes)} "
                f"(train {trained:.0f}s, eval {time.perf_counter() - t - trained:.0f}s)")
    result["wins"] = wins
    result["fqe"] = sum(fqe_values) / len(fqe_values) if fqe_values else float("nan")
    result["true"] = sum(true_values) / len(true_values) if true_values else float("nan")
    result.setdefault("behaviour_test_value", float("nan"))
    result["seconds"] = time.perf_counter() - t0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the larger budget (more logs, steps, episodes)")
    parser.add_argument("--envs", nargs="*", default=ENVS, help="environments (default: the three built-ins)")
    parser.add_argument("--workdir", default=str(Path(__file__).parent / "out" / "offline_quality"),
                        help="where logs, datasets and their embedding caches are kept between runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared box)")
    parser.add_argument("--with-adapter", action="store_true", help="also CQL with a trainable state adapter")
    parser.add_argument("--algos", nargs="*", default=None, choices=[*ALGOS, "cql-adapter", "cql-mc5"],
                        help="only these learners (a quick check; the table is written to a file of its own)")
    parser.add_argument("--whole-text", action="store_true",
                        help="every learner on whole-text state vectors (`train --whole-text`; a table of its own)")
    parser.add_argument("--encoder-precision", default="fp32", choices=["fp32", "bf16", "int8"],
                        help="embed the logs in this precision (`train --encoder-precision`; a table of its own)")
    for name, value in BUDGETS["default"].items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    args = parser.parse_args()

    import torch

    from offline_agent.text.encoder import TextEncoder

    torch.set_num_threads(args.threads)
    base = BUDGETS["full" if args.full else "default"]
    budget = dict(base)
    budget.update({k: v for k, v in vars(args).items() if k in budget and v is not None})
    encoder = TextEncoder(max_length=budget["max_length"], per_turn=not args.whole_text,
                          precision=args.encoder_precision)
    start = time.perf_counter()
    algos = args.algos or ALGOS + (["cql-adapter"] if args.with_adapter else [])
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    results = [run_env(env, budget, algos, encoder, Path(args.workdir), log) for env in args.envs]

    header = ["environment", "behaviour (logs)", "behaviour (eval)", *(LABELS[a] for a in algos)]
    rows = []
    for r in results:
        w = r["wins"]
        rows.append([r["env"].split("/")[-1], cell(*r["logged"]), cell(*w["behaviour"]),
                     *(cell(*w[a]) for a in algos)])
    fqe_rows = [[r["env"].split("/")[-1], f"{r['fqe']:.3f}", f"{r['true']:.3f}", f"{r['behaviour_test_value']:.3f}"]
                for r in results]
    total = time.perf_counter() - start
    b = budget
    table = (
        f"Success rate [95% Wilson interval] over {b['seeds']} seeds x {b['eval_episodes']} fresh episodes; "
        f"{b['episodes']} logged episodes of `{BEHAVIOUR}` per environment; every learner {b['steps']} steps of "
        f"batch {b['batch_size']}, hidden width {b['hidden']}, on the same frozen MiniLM features (k = {b['k']} "
        "turns, " + ("whole-text state vectors, a text" if args.whole_text else "per-turn state vectors, a block")
        + f" cut to {b['max_length']} tokens"
        + (f", embedded in {args.encoder_precision}" if args.encoder_precision != "fp32" else "")
        + "); BC, filtered BC and CQL also read each candidate's grounding in the "
        f"episode (their default; d3rlpy's network sees states only). Total {total / 60:.1f} min.\n\n"
        + markdown_table(header, rows)
        + "\n\nOur CQL's value: FQE on the logs' held-out test split vs the discounted return it got in the "
        "simulator (gamma 0.99), and what the logged behaviour got on that split.\n\n"
        + markdown_table(["environment", "FQE estimate", "simulator", "behaviour (test logs)"], fqe_rows)
    )
    command = " ".join(["python benchmarks/offline_quality.py", *sys.argv[1:]])
    # Another amount of logs is another table (the README shows the default's and 600 episodes').
    name, title = "offline_quality", "Offline RL quality on the built-in simulators"
    if b["episodes"] != base["episodes"]:
        name, title = f"{name}_{b['episodes']}", f"{title}, from {b['episodes']} logged episodes"
    if args.algos:  # a subset of the learners never overwrites the whole table
        name, title = f"{name}_{'_'.join(args.algos)}", f"{title}: {' vs '.join(LABELS[a] for a in algos)}"
    if args.whole_text:
        name, title = f"{name}_wholetext", f"{title}, whole-text state vectors"
    if args.encoder_precision != "fp32":
        name, title = f"{name}_{args.encoder_precision}", f"{title}, logs embedded in {args.encoder_precision}"
    write_result(name, title, table, command)


if __name__ == "__main__":
    main()
