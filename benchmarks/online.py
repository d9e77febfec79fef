"""Online fine-tuning: does PPO + KL from the CQL policy beat CQL, and PPO from scratch, per env step?

For each built-in simulator:

1. offline stage (cached under `--cache`, reused by later runs): ingest the
   bundled sample logs (`datasets/<sim>/logs.jsonl`, 100 episodes of
   `noisy:0.5`; with `--logs N`, N episodes of it simulated anew), embed them
   with the packaged MiniLM and train CQL;
2. evaluate the CQL policy (greedy, `--episodes` episodes, seeds from 1000,
   which no training rollout uses);
3. fine-tune it with PPO + KL (`--iterations` x `--num-envs` x `--num-steps`
   env steps, adaptive beta with `--target-kl`, the library's residual policy
   unless `--policy-init copy`, the fine-tuned and reference policy at
   temperature `--tau`), evaluate the result the same way;
4. PPO from scratch (same architecture, fresh weights, no KL) for the same
   number of env steps, evaluated the same way (`--no-scratch` skips it).

The table gives success rates with 95% Wilson intervals, the env steps at which
the (sampled) training success rate first reached 95%, the mean per-step KL to
the offline policy, and whether fine-tuning dipped more than 10 points below
the offline policy: the greedy policy after each of `--dip-iterations`
iterations, evaluated like the offline one. A second table gives rollout throughput (env steps/s,
policy and encoder included) with 1 and 8 environments, 1 and `--threads` torch threads, the encoder in
fp32 and in bf16, and the simulators' own speed through the same vector env
(`benchmarks/rollout_speed.py`, which runs it alone).

Prints the tables and writes them to benchmarks/results/online.md. With
`--safety SPEC`, every policy (the offline one too) is trained and evaluated
behind that safety filter: what a team that deploys the filter would see,
reported apart from what the learner does alone. A variant (`--logs`, `--tau`, `--seed`,
`--subgoal-shaping`, `--self-imitation`, `--safety`) keeps its runs in `<sim><tag>/` of the cache
(`support-tau0.5-safety/`) and its table in benchmarks/results/online<tag>.md (`online_tau05_safety.md`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import BEHAVIOUR, markdown_table, reproduce_command, write_result  # noqa: E402
from benchmarks.rollout_speed import ENV, ROLLOUT_HEADER, rollout_note  # noqa: E402
from offline_agent.online.config import PPOConfig  # noqa: E402
from offline_agent.online.validation import KEEP_RULES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIMS = {
    "pipeline": "offline_agent/PipelineRepair-v0",
    "logistics": "offline_agent/Logistics-v0",
    "support": "offline_agent/CustomerSupport-v0",
}
EVAL_SEED = 1000
#: The settings a run without flags uses, by which every variant is named: plain PPO + KL, as before the library's
#: default recipe (target KL 0.1, tau 0.2, shaping, self-imitation, a guard of 32 validation episodes, 48 iterations:
#: `PPOConfig`) took them up. Named variants keep their names and results; the recipe is the variant
#: `--tau 0.2 --subgoal-shaping 1 --self-imitation 1 --target-kl 0.1 --validation-episodes 32 --validation-keep guard
#: --iterations 48` (benchmarks/run_all.py: RECIPE_ARGS).
PLAIN_TARGET_KL = 0.05
PLAIN_VALIDATION_KEEP = "best"
#: What a run sets explicitly so that PPOConfig's recipe defaults do not leak into it (the scratch baseline).
PLAIN = {"tau": None, "subgoal_shaping": 0.0, "self_imitation": 0.0, "validation_episodes": 0}
# The residual's rate here, below PPOConfig's 3e-3: at 1e-2 one Adam step already crossed max_update_kl, so every
# iteration stopped after one minibatch step and the KL to the offline policy jumped to 0.6-0.8 (CustomerSupport
# and Logistics, 15k env steps: no gain); at 1e-3 all 16 minibatch steps of an iteration are taken. A copied
# network keeps PPOConfig's much smaller default (its logits are Q / tau).
RESIDUAL_LEARNING_RATE = 1e-3
#: The validation rules (`--validation-keep`) in the words of the table's notes and of its title.
KEEP_WORDS = {
    "best": "the best greedy one",
    "guard": "the latest greedy one that succeeds at least as often as the offline policy (until one does, the "
    "offline one)",
}
#: Fine-tuning iterations of a run (24 x 8 envs x 64 steps = 12,288 env steps); other counts are variants.
ITERATIONS = 24
TITLE_KEEP_WORDS = {"best": ", best of {n} validation episodes kept", "guard": ", guarded by {n} validation episodes"}


def offline_folder(cache: Path, sim: str, logs: int) -> Path:
    """Where a simulator's offline stage lives: `<sim>/` for the bundled logs, `<sim>-logs<N>/` for N simulated."""
    return cache / (f"{sim}-logs{logs}" if logs else sim)


def cached_run_fits(run: Path, views: Any, cql_steps: int) -> bool:
    """Whether `run` holds a policy trained as `offline_stage` trains one now: states rendered and embedded as
    `views` (a `StateSettings`) ask, k and the token budget aside, and CQL's config the default one of
    `cql_steps` steps. A run cached before a default changed (per-turn vectors, CQL's discount) sits where the
    default run goes, and is retrained rather than reused."""
    from offline_agent.learn.train import make_config
    from offline_agent.text.states import StateSettings

    if not (run / "policy.json").is_file():
        return False
    meta = json.loads((run / "policy.json").read_text())
    cached = StateSettings.from_meta(meta)
    same_config = meta.get("config") == asdict(make_config("cql", steps=cql_steps, seed=0))
    return same_config and replace(cached, k=views.k, max_tokens=views.max_tokens) == views


def offline_stage(
    sim: str,
    cache: Path,
    cql_steps: int,
    retrain: bool = False,
    logs: int = 0,
    keep_opening: bool = False,
    observation_view: bool = False,
    per_turn: bool = True,
) -> Path:
    """The CQL run of `sim`, trained once and kept in `cache` (CQL on 2 busy cores takes 0.2-0.4 s per step:
    minutes per simulator, the longest stage of this benchmark). Its logs: the bundled 100 episodes, or with
    `logs` N that many episodes of the same behaviour (`noisy:0.5`, seed 0) simulated anew. With `keep_opening`
    its state texts keep each episode's first turn (`cql-opening/`, beside `cql/` on the same data); with
    `observation_view` its encoder embeds each state's current observation as a second view (`cql-obsview/`);
    without `per_turn` its state vectors are whole-text ones (`cql-wholetext/`)."""
    from offline_agent.ingest import ingest
    from offline_agent.learn.train import train
    from offline_agent.simulate import simulate
    from offline_agent.text.states import StateSettings

    folder = offline_folder(cache, sim, logs)
    data = folder / "data"
    run = folder / ("cql" + ("-opening" if keep_opening else "") + ("-obsview" if observation_view else "")
                    + ("" if per_turn else "-wholetext"))
    views = StateSettings(keep_opening=keep_opening, observation_view=observation_view, per_turn=per_turn)
    if cached_run_fits(run, views, cql_steps) and not retrain:
        return run
    started = time.perf_counter()
    if not (data / "dataset.json").is_file():
        shutil.rmtree(data, ignore_errors=True)
        source = REPO / "datasets" / sim / "logs.jsonl"
        if logs:
            source = simulate(SIMS[sim], logs, BEHAVIOUR, 0, folder / "logs.jsonl").path
        ingest([source], data)
    train(data, "cql", run, steps=cql_steps, seed=0, state_settings=views, overwrite=True, progress=sys.stderr.isatty())
    print(f"[{sim}] offline stage (ingest, embed, CQL {cql_steps} steps): {time.perf_counter() - started:.0f} s")
    return run


def evaluate_run(
    run: Path, env: str, episodes: int, safety: str | None = None, precision: str = "fp32"
) -> tuple[int, int]:
    """(successes, episodes) of the greedy policy; behind `safety`, or the rules saved with the run if None; the
    encoder in `precision`."""
    from offline_agent.evaluate import evaluate

    report = evaluate(run, env, episodes=episodes, seed=EVAL_SEED, safety=safety, encoder_precision=precision)
    return report.successes, report.episodes


def offline_evaluation(run: Path, env: str, args: argparse.Namespace) -> tuple[int, int]:
    """The offline policy's evaluation, kept in its run folder (`evaluations.json`): every variant and seed of a
    simulator starts from the same policy and plays the same episodes, so they share one evaluation per episode
    count, precision and thread count (threads change the encoder's sums in their last bits). Evaluations behind
    a safety filter are not kept."""
    from offline_agent.online.finetune import file_sha256

    key = f"{args.episodes}-{args.encoder_precision}-threads{args.threads}"
    path, weights = run / "evaluations.json", file_sha256(run / "policy.safetensors")
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if saved.get("weights") != weights:  # retrained (--retrain): the evaluations kept are of other weights
        saved = {"weights": weights}
    if args.safety is None and key in saved:
        return tuple(saved[key])
    result = evaluate_run(run, env, args.episodes, args.safety, args.encoder_precision)
    if args.safety is None:
        saved[key] = list(result)
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(saved, indent=1) + "\n")
        partial.replace(path)
    return result


def rate(successes: int, n: int, digits: int = 2) -> str:
    """'0.88 (0.76-0.94)': a success rate and its 95% Wilson interval, to `digits` decimals."""
    from offline_agent.simulate import wilson_interval

    low, high = wilson_interval(successes, n)
    return f"{successes / n:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def first_reaching(metrics, threshold: float = 0.95, min_episodes: int = 10) -> str:
    """Env steps at the first iteration whose episodes, pooled with the previous iteration's, succeeded at
    `threshold` or more, counting only windows of `min_episodes` episodes (one iteration holds ~8)."""
    successes = (metrics["charts/success_rate"].fill_nan(0.0) * metrics["charts/episodes"]).to_list()
    episodes = metrics["charts/episodes"].to_list()
    for i in range(1, len(episodes)):
        n = episodes[i] + episodes[i - 1]
        if n >= min_episodes and (successes[i] + successes[i - 1]) / n >= threshold:
            return f"{int(metrics['env_steps'][i]):,}"
    return "not reached"


def first_validated(metrics, threshold: float = 0.95) -> str:
    """Env steps, training and (in brackets) validation, spent until the first iteration whose greedy policy
    succeeded on `threshold` of the validation episodes. It measures the policy a team would deploy (greedy,
    on the same episodes every iteration) where `first_reaching` measures the sampled one; it is still one
    score of N episodes, so a lucky iteration can reach it before the policy is there to stay."""
    reached = metrics.filter(metrics["validation/success_rate"] >= threshold)
    if reached.is_empty():
        return "not reached"
    return f"{int(reached['env_steps'][0]):,} (+{int(reached['validation/env_steps'][0]):,})"


def variant(args: argparse.Namespace) -> str:
    """'' for the default settings, else a tag of what differs ('-tau0.5', '-shaping1', '-tau0.5-safety',
    '-logs400-tau0.3', '-tau0.5-seed1'): the runs, evaluations and result file of a variant are kept apart from the
    default's."""
    tag = f"-logs{args.logs}" if args.logs else ""
    tag += "-opening" if args.keep_opening else ""
    tag += "-obsview" if args.observation_view else ""
    tag += "-wholetext" if args.whole_text else ""
    tag += "" if args.tau is None else f"-tau{args.tau:g}"
    tag += f"-shaping{args.subgoal_shaping:g}" if args.subgoal_shaping else ""
    tag += kl_tag(args)
    if args.self_imitation:
        epochs = args.self_imitation_epochs
        tag += f"-sil{args.self_imitation:g}" + (f"x{epochs:g}" if epochs != PPOConfig.self_imitation_epochs else "")
        tag += f"b{args.self_imitation_buffer}" if args.self_imitation_buffer != PPOConfig.self_imitation_buffer else ""
        tag += f"s{args.self_imitation_start}" if args.self_imitation_start else ""
    if args.validation_episodes:
        tag += f"-val{args.validation_episodes}" + ("" if args.validation_keep == "best" else args.validation_keep)
    tag += f"-it{args.iterations}" if args.iterations != ITERATIONS else ""
    tag += f"-gain{args.kl_gain:g}" if args.kl_gain != PPOConfig.kl_gain else ""
    tag += f"-tr{args.trust_region:g}" if args.trust_region != PPOConfig.trust_region else ""
    tag += f"-{args.encoder_precision}" if args.encoder_precision != "fp32" else ""
    tag += "-safety" if args.safety else ""
    return tag + (f"-seed{args.seed}" if args.seed else "")


def kl_tag(args: argparse.Namespace) -> str:
    """'' for the plain KL control (target 0.05), else '-kl0.2' (another target) or '-beta0.01' (fixed)."""
    if args.beta is not None:
        return f"-beta{args.beta:g}"
    return "" if args.target_kl == PLAIN_TARGET_KL else f"-kl{args.target_kl:g}"


def kl_words(args: argparse.Namespace) -> str:
    """The KL control of the fine-tuning runs in a few words ('target KL 0.05', 'fixed beta 0.01')."""
    return f"fixed beta {args.beta:g}" if args.beta is not None else f"target KL {args.target_kl}"


def runs_folder(cache: Path, sim: str, args: argparse.Namespace) -> Path:
    """Where a simulator's online runs and evaluations go (its offline stage is shared by every variant with the
    same logs)."""
    return cache / f"{sim}{variant(args)}"


def online_runs(sim: str, env: str, run: Path, cache: Path, args: argparse.Namespace) -> dict:
    import polars as pl

    common = dict(
        iterations=args.iterations, num_envs=args.num_envs, num_steps=args.num_steps, seed=args.seed, vector="sync",
        torch_threads=args.threads,
    )
    out = {}
    for name, settings in (
        ("finetune", dict(target_kl=None if args.beta is not None else args.target_kl, beta=args.beta,
                          kl_gain=args.kl_gain, trust_region=args.trust_region, value_init=args.value_init,
                          policy_init=args.policy_init, learning_rate=args.learning_rate, tau=args.tau,
                          subgoal_shaping=args.subgoal_shaping, self_imitation=args.self_imitation,
                          self_imitation_epochs=args.self_imitation_epochs,
                          self_imitation_buffer=args.self_imitation_buffer,
                          self_imitation_start=args.self_imitation_start,
                          validation_episodes=args.validation_episodes, validation_keep=args.validation_keep)),
        ("scratch", dict(beta=0.0, from_scratch=True, value_init="zero", learning_rate=args.scratch_learning_rate,
                         **PLAIN)),
    ):
        if name == "scratch" and args.no_scratch:
            continue
        folder = runs_folder(cache, sim, args) / name
        started = time.perf_counter()
        config = PPOConfig(**{**common, **settings})
        train_unless_cached(folder, run, env, config, args, progress=sys.stderr.isatty())
        seconds = time.perf_counter() - started
        metrics = pl.read_parquet(folder / "metrics.parquet")
        evaluation = evaluate_run(folder, env, args.episodes, precision=args.encoder_precision)
        out[name] = {"metrics": metrics, "seconds": seconds, "eval": evaluation}
        print(f"[{sim}] {name}: {seconds:.0f} s, training success by iteration "
              f"{[round(x, 2) for x in metrics['charts/success_rate'].to_list()]}", flush=True)
        if name == "finetune":
            out["early"] = early_evals(sim, env, run, cache, args, PPOConfig, {**common, **settings})
    return out


def early_evals(sim: str, env: str, run: Path, cache: Path, args: argparse.Namespace, config_type, settings: dict
                ) -> dict[int, tuple[int, int]]:
    """The greedy policy's evaluation after each of `--dip-iterations` iterations of the fine-tuning run.

    A run is deterministic and nothing in it depends on its total length, so the policy after k of its
    iterations is the final policy of the same run cut at k: each is trained anew and evaluated like the
    offline policy (the sampled training episodes, 3-9 an iteration, are too few to see a 10-point dip).
    """
    evals = {}
    for k in args.dip_iterations:
        folder = runs_folder(cache, sim, args) / f"finetune-{k}"
        config = config_type(**{**settings, "iterations": k})
        train_unless_cached(folder, run, env, config, args)
        evals[k] = evaluate_run(folder, env, args.episodes, precision=args.encoder_precision)
        print(f"[{sim}] after {k} iteration(s): {rate(*evals[k])}", flush=True)
    return evals


def train_unless_cached(folder: Path, run: Path, env: str, config, args: argparse.Namespace,
                        progress: bool = False) -> None:
    """Fine-tune into `folder`, except under `--reuse`: a finished run of the same settings is kept, and one
    that was stopped part-way (a killed benchmark) is resumed from its last checkpoint, exactly as if it had
    not stopped (`finetune`'s resume is exact), instead of starting over."""
    from offline_agent.online.finetune import finetune

    if args.reuse and finished_run(folder, run, env, config, args.safety):
        return
    resume = args.reuse and interrupted_run(folder, run, env, config, args.safety)
    finetune(run, env, folder, config, safety=args.safety, resume=resume, overwrite=not resume, progress=progress,
             encoder_precision=args.encoder_precision)


def same_settings(saved: dict, run: Path, env: str, config, safety: str | None) -> bool:
    """Whether a run's saved identity (finetune.json or its resume state) names the same offline weights (by
    hash: `--retrain` keeps the folder, not the weights), environment, safety rules and config."""
    from dataclasses import asdict

    from offline_agent.envs.safety import SafetyFilter
    from offline_agent.online.finetune import file_sha256

    return (
        saved.get("source_weights_sha256") == file_sha256(run / "policy.safetensors")
        and saved.get("env") == env
        and saved.get("safety") == SafetyFilter.from_spec(safety).specs
        and saved.get("config") == asdict(config)
    )


def interrupted_run(folder: Path, run: Path, env: str, config, safety: str | None) -> bool:
    """Whether `folder` holds a run of exactly these settings that stopped before its end: a resume state
    (written every few iterations) and no finetune.json (written at the end)."""
    from offline_agent.online.finetune import STATE_FILE, SUMMARY_FILE, read_state_metadata

    state = folder / STATE_FILE
    if (folder / SUMMARY_FILE).is_file() or not state.is_file():
        return False
    try:
        saved = read_state_metadata(state)
    except Exception:  # a state cut short by the kill itself: the run starts over
        return False
    if same_settings(saved, run, env, config, safety):
        print(f"resuming {folder} after iteration {saved.get('iteration')} (stopped part-way, same settings)",
              flush=True)
        return True
    return False


def finished_run(folder: Path, run: Path, env: str, config, safety: str | None) -> bool:
    """Whether `folder` holds a finished fine-tuning run of exactly these settings (what `--reuse` skips): its
    finetune.json names the same offline weights (by hash: `--retrain` keeps the folder, not the weights),
    environment, safety rules and config. A run is deterministic, so training it again would give the same
    policy."""
    summary = folder / "finetune.json"
    if not (summary.is_file() and (folder / "policy.json").is_file()):
        return False
    same = same_settings(json.loads(summary.read_text()), run, env, config, safety)
    if same:
        print(f"reusing {folder} (finished, same settings)", flush=True)
    return same


def cached_runs(folder: Path) -> tuple[tuple[int, int], dict]:
    """(offline evaluation, runs) of a simulator from a previous run's cache, for --tables-only."""
    import polars as pl

    evals = json.loads((folder / "evals.json").read_text())
    runs = {
        name: {"metrics": pl.read_parquet(folder / name / "metrics.parquet"), "eval": tuple(evals[name])}
        for name in ("finetune", "scratch")
        if name in evals
    }
    runs["early"] = {int(k): tuple(v) for k, v in evals.get("early", {}).items()}
    return tuple(evals["offline"]), runs


def training_minutes(folder: Path) -> float:
    """Minutes the online runs under a simulator's `folder` took to train, from each run's finetune.json: what they
    cost even where a later invocation reused them (`--reuse`), or they ran in another process (`--sims`)."""
    seconds = 0.0
    for summary in folder.glob("*/finetune.json"):
        seconds += json.loads(summary.read_text()).get("seconds_this_process", 0.0)
    return seconds / 60


def resumed_runs(folder: Path) -> int:
    """How many of a simulator's runs were resumed after a stop: their finetune.json counts only the time after
    it, so `training_minutes` undercounts them."""
    return sum(
        json.loads(summary.read_text()).get("resumed_from") is not None for summary in folder.glob("*/finetune.json")
    )


def quality_row(sim: str, offline: tuple[int, int], runs: dict) -> list[object]:
    ft, scratch = runs["finetune"]["metrics"], runs.get("scratch", {}).get("metrics")
    start = offline[0] / offline[1]
    early = {k: s / n for k, (s, n) in runs.get("early", {}).items()}
    worst = min(early, key=early.get) if early else None
    steps, reached = f"{int(ft['env_steps'].max()):,}", first_reaching(ft)
    if "validation/env_steps" in ft.columns:  # the validation episodes were played in the environment too
        steps += f" (+{int(ft['validation/env_steps'].max()):,} validation)"
        reached += f"; greedy: {first_validated(ft)}"
    return [
        sim,
        rate(*offline),
        rate(*runs["finetune"]["eval"]),
        rate(*runs["scratch"]["eval"]) if scratch is not None else "not run",
        steps,
        reached,
        first_reaching(scratch) if scratch is not None else "-",
        f"{ft['objective/kl'].mean():.3f} / {ft['objective/kl'].max():.3f}",
        f"{start:.2f} -> {early[worst]:.2f} after {worst}: {'yes' if early[worst] < start - 0.10 else 'no'}"
        if early else "-",
    ]


def throughput(run: Path, whole_text_run: Path, env: str, steps: int, threads: int) -> list[list[object]]:
    """The rollout throughput table (`benchmarks/rollout_speed.py`, which also runs it alone): env steps/s with
    the encoder in fp32 and bf16, and of the policy on whole-text state vectors (`whole_text_run`) in fp32,
    bf16 and fp32 one text per pass, for 1 and 8 envs, with one torch thread and with `threads`."""
    from benchmarks.rollout_speed import rollout_rows

    return rollout_rows(run, whole_text_run, env, steps, threads)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's settings from the command line (`argv`, default sys.argv), with the residual policy's
    learning rate filled in."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sims", nargs="*", default=list(SIMS), choices=list(SIMS))
    parser.add_argument("--cache", default=str(REPO / "benchmarks" / "out" / "online"), help="offline stage and runs")
    parser.add_argument("--cql-steps", type=int, default=1000, help="CQL gradient steps of the offline stage")
    parser.add_argument("--retrain", action="store_true", help="retrain the cached CQL runs")
    parser.add_argument("--logs", type=int, default=0,
                        help="train the offline stage on this many newly simulated episodes of the bundled logs' "
                        "behaviour (noisy:0.5, seed 0) instead of the bundled 100; a variant of its own")
    parser.add_argument("--keep-opening", action="store_true",
                        help="the offline stage's state texts keep each episode's first turn (the user's request)")
    parser.add_argument("--observation-view", action="store_true",
                        help="the offline stage's encoder also embeds each state's current observation on its own")
    parser.add_argument("--whole-text", action="store_true",
                        help="the offline stage's state vectors are whole-text ones (`train --whole-text`)")
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--num-steps", type=int, default=64, help="steps per env per iteration")
    parser.add_argument("--target-kl", type=float, default=PLAIN_TARGET_KL,
                        help="per-step KL the adaptive controller steers fine-tuning to")
    parser.add_argument("--beta", type=float, default=None,
                        help="a fixed KL weight instead of the adaptive controller (replaces --target-kl)")
    parser.add_argument("--kl-gain", type=float, default=PPOConfig.kl_gain, help="the KL controller's gain")
    parser.add_argument("--trust-region", type=float, default=PPOConfig.trust_region,
                        help="x the target KL past which a minibatch steps back toward the offline policy (0 = off)")
    parser.add_argument("--encoder-precision", choices=["fp32", "bf16", "int8"], default="fp32",
                        help="the encoder's precision in rollouts and evaluations (bf16: ~1.5x as fast with bf16 "
                        "instructions; int8, ONNX Runtime: ~1.3x bf16 with VNNI; `auto`, the product's default, "
                        "picks int8 there)")
    parser.add_argument("--policy-init", default="residual", choices=["residual", "copy"])
    parser.add_argument("--learning-rate", type=float, default=None,
                        help=f"fine-tuning learning rate [default: {RESIDUAL_LEARNING_RATE} for the residual policy, "
                        "PPOConfig's for a copy]")
    parser.add_argument("--scratch-learning-rate", type=float, default=3e-4, help="PPO-from-scratch learning rate")
    parser.add_argument("--value-init", default="zero", choices=["critic", "zero"])
    parser.add_argument("--tau", type=float, default=None,
                        help="temperature of the fine-tuned and reference policy [default: the CQL checkpoint's]")
    parser.add_argument("--subgoal-shaping", type=float, default=0.0,
                        help="weight of potential-based sub-goal shaping in fine-tuning (scratch trains without)")
    parser.add_argument("--self-imitation", type=float, default=0.0,
                        help="weight of self-imitation of successful episodes in fine-tuning (scratch trains without)")
    parser.add_argument("--self-imitation-epochs", type=float, default=PPOConfig.self_imitation_epochs,
                        help="passes of self-imitation over its buffer per iteration")
    parser.add_argument("--self-imitation-buffer", type=int, default=PPOConfig.self_imitation_buffer,
                        help="steps of recent successful episodes kept for self-imitation")
    parser.add_argument("--self-imitation-start", type=int, default=PPOConfig.self_imitation_start,
                        help="steps of successful episodes collected before self-imitation begins")
    parser.add_argument("--validation-episodes", type=int, default=0,
                        help="fine-tuning plays the offline policy and each iteration's greedily on this many "
                        "held-out validation episodes and keeps one by --validation-keep instead of the last (0 = the "
                        "last)")
    parser.add_argument("--validation-keep", choices=KEEP_RULES, default=PLAIN_VALIDATION_KEEP,
                        help="which validated policy fine-tuning keeps: best (the most successes) or guard (the "
                        "latest with at least the offline policy's)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the online runs (sampling, minibatches, training environments); the offline "
                        "stage and the evaluation episodes stay the same, so runs with other seeds are a variant")
    parser.add_argument("--episodes", type=int, default=50, help="evaluation episodes per policy")
    parser.add_argument("--dip-iterations", type=int, nargs="*", default=[1, 2, 4],
                        help="iterations after which the fine-tuned greedy policy is evaluated for the early dip")
    parser.add_argument("--throughput-steps", type=int, default=256, help="rollout env steps timed per setting")
    parser.add_argument("--safety", default=None,
                        help="a safety-filter spec every policy (the offline one too) trains and is evaluated behind; "
                        "its runs, tables and result file are kept apart from the unfiltered ones")
    parser.add_argument("--no-scratch", action="store_true", help="skip the PPO-from-scratch baseline")
    parser.add_argument("--reuse", action="store_true",
                        help="keep a cached fine-tuning run whose settings match (runs are deterministic) instead of "
                        "training it again, and resume one of them that was stopped part-way; it is still evaluated")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (this machine has 2 cores)")
    parser.add_argument("--no-write", action="store_true", help="print the tables only")
    parser.add_argument(
        "--tables-only", action="store_true", help="rebuild the tables from the cached runs and evaluations"
    )
    args = parser.parse_args(argv)
    args.trust_region = args.trust_region or None
    if args.learning_rate is None and args.policy_init == "residual":
        args.learning_rate = RESIDUAL_LEARNING_RATE
    return args


def main() -> None:
    args = parse_args()
    cache = Path(args.cache)
    tag = variant(args)
    started = time.perf_counter()
    quality, cql_steps = [], {}
    for sim in args.sims:
        env = SIMS[sim]
        run = offline_stage(
            sim, cache, args.cql_steps, args.retrain and not args.tables_only, args.logs, args.keep_opening,
            args.observation_view, not args.whole_text,
        )
        cql_steps[sim] = json.loads((run / "policy.json").read_text())["config"]["steps"]
        if args.tables_only:
            quality.append(quality_row(sim, *cached_runs(runs_folder(cache, sim, args))))
            continue
        offline = offline_evaluation(run, env, args)
        print(f"[{sim}] offline CQL: {rate(*offline)}", flush=True)
        runs = online_runs(sim, env, run, cache, args)
        evals = {"offline": offline, **{name: runs[name]["eval"] for name in ("finetune", "scratch") if name in runs},
                 "early": runs["early"]}
        (runs_folder(cache, sim, args) / "evals.json").write_text(json.dumps(evals) + "\n")
        quality.append(quality_row(sim, offline, runs))
    header = [
        "simulator", "offline CQL", "CQL + PPO/KL", "PPO from scratch", "env steps each",
        "steps to 95% (fine-tune)", "steps to 95% (scratch)", "KL to offline (mean / max)", "early dip > 10 pts",
    ]
    if args.tables_only:
        speed, minutes = json.loads((cache / "throughput.json").read_text()) if not tag else [], float("nan")
    else:  # a variant changes nothing of the rollout speed: the throughput table is the default run's
        speed = [] if tag else throughput(
            offline_stage(args.sims[0], cache, args.cql_steps, logs=args.logs),  # the default run, trained above
            offline_stage(args.sims[0], cache, args.cql_steps, logs=args.logs, per_turn=False),
            SIMS[args.sims[0]], args.throughput_steps, args.threads,
        )
        minutes = (time.perf_counter() - started) / 60
        if not tag:
            (cache / "throughput.json").write_text(json.dumps(speed) + "\n")
        (cache / f"minutes{tag}.json").write_text(json.dumps(minutes) + "\n")
    if args.tables_only and (cache / f"minutes{tag}.json").is_file():
        minutes = json.loads((cache / f"minutes{tag}.json").read_text())
    resumed = sum(resumed_runs(runs_folder(cache, sim, args)) for sim in args.sims)
    resumed_note = f" ({resumed} run(s) resumed after a stop count only the time after it)" if resumed else ""

    fine_lr = PPOConfig(policy_init=args.policy_init, learning_rate=args.learning_rate).learning_rate
    table = (
        markdown_table(header, quality)
        + f"\n\nSuccess rate (95% Wilson interval) of the greedy policy over {args.episodes} evaluation episodes "
        f"(seeds from {EVAL_SEED}); steps to 95%: the first iteration whose sampled training episodes, pooled "
        "with the previous iteration's (10+ episodes), succeed 95% of the time"
        + ("; greedy: the first iteration whose greedy policy succeeds on 95% of the validation episodes, its "
           "training env steps (+ validation env steps until then)" if args.validation_episodes else "")
        + "; early dip: the offline greedy "
        f"policy against the worst of the fine-tuned greedy policies after {', '.join(map(str, args.dip_iterations))} "
        "iteration(s), each evaluated like it (a run cut at k iterations is the same run's first k). Fine-tuning: "
        f"{args.iterations} iterations x {args.num_envs} envs x {args.num_steps} steps, {kl_words(args)}"
        + ("" if args.beta is not None else f" (gain {args.kl_gain:g}, "
           + (f"trust region {args.trust_region:g}x the target)" if args.trust_region else "no trust region)"))
        + ", "
        f"policy {args.policy_init}, lr {fine_lr}, "
        f"tau {'of the CQL checkpoint' if args.tau is None else args.tau}, "
        + (f"sub-goal shaping {args.subgoal_shaping:g}, " if args.subgoal_shaping else "")
        + (f"self-imitation {args.self_imitation:g} ({args.self_imitation_epochs:g} passes over its buffer of "
           f"{args.self_imitation_buffer:,} steps an iteration"
           + (f", from {args.self_imitation_start:,} steps on" if args.self_imitation_start else "") + "), "
           if args.self_imitation else "")
        + (f"the kept policy: {KEEP_WORDS[args.validation_keep]} on {args.validation_episodes} validation "
           f"episodes (seeds from {PPOConfig.validation_seed}; the offline policy and each iteration's, a tie to "
           "the later; their env steps in brackets), " if args.validation_episodes else "")
        + f"value head {args.value_init}, seed {args.seed}; "
        + ("scratch: not run" if args.no_scratch else f"scratch: same steps, beta 0, the CQL checkpoint's tau, "
           f"lr {args.scratch_learning_rate}")
        + f". Offline stage: CQL ({', '.join(f'{k} {v}' for k, v in cql_steps.items())} "
        "gradient steps) on "
        + (f"{args.logs} episodes of {BEHAVIOUR} simulated anew (seed 0)" if args.logs
           else f"the bundled 100-episode {BEHAVIOUR} logs")
        + ("; its state texts keep each episode's first turn (`--keep-opening`)" if args.keep_opening else "")
        + ("; its encoder also embeds each state's current observation on its own (`--observation-view`)"
           if args.observation_view else "")
        + ("; its state vectors are whole-text ones (`--whole-text`)" if args.whole_text else "")
        + f". Encoder: packaged all-MiniLM-L6-v2 ({args.encoder_precision} in rollouts and evaluations), "
        f"{args.threads} torch thread(s). "
        f"Wall time of the last invocation: {minutes:.1f} min; the online runs' own training times add up to "
        f"{sum(training_minutes(runs_folder(cache, sim, args)) for sim in args.sims):.1f} min{resumed_note}. "
        "At the rollout rates of the throughput table (MiniLM encodes every new state "
        "text on CPU) "
        "a run of 12k env steps takes about a quarter of an hour on one core, so each simulator's runs take the "
        "better part of an hour; `--sims` runs one simulator (three of them run side by side on 2 cores), and "
        "`--tables-only` rebuilds this table from their caches."
    )
    if args.safety:
        table += (
            f" Every policy, the offline CQL one included, acts behind the safety filter `{args.safety}`: the "
            "online runs roll out behind it and every evaluation applies it, so a forbidden candidate is never "
            "offered (the same settings without the filter are the table without `--safety`)."
        )
    if tag:
        table += " The rollout throughput of these runs is the default run's (benchmarks/results/online.md)."
    else:
        table += (
            "\n\n"
            + markdown_table(ROLLOUT_HEADER, speed)
            + "\n\n" + rollout_note(args.throughput_steps).replace(ENV, SIMS[args.sims[0]])
            + " `python benchmarks/rollout_speed.py` measures it alone, with the encoder's own speed."
        )
    command = reproduce_command("online.py", leave_out=("--tables-only", "--reuse"))
    if args.no_write:
        print(table)
    else:
        title = "Online fine-tuning (PPO + KL from CQL)" + (f", tau {args.tau:g}" if args.tau is not None else "")
        title += "" if tag else ": plain PPO + KL, the defaults before the recipe"
        title += f", offline stage on {args.logs} logged episodes" if args.logs else ""
        title += ", states keep the opening turn" if args.keep_opening else ""
        title += ", observation view" if args.observation_view else ""
        title += ", whole-text state vectors" if args.whole_text else ""
        title += f", sub-goal shaping {args.subgoal_shaping:g}" if args.subgoal_shaping else ""
        title += f", self-imitation {args.self_imitation:g}" if args.self_imitation else ""
        buffer = args.self_imitation_buffer
        title += f" (buffer {buffer:,})" if buffer != PPOConfig.self_imitation_buffer else ""
        title += f" (from {args.self_imitation_start:,} steps)" if args.self_imitation_start else ""
        title += f", {kl_words(args)}" if kl_tag(args) else ""
        if args.validation_episodes:
            title += TITLE_KEEP_WORDS[args.validation_keep].format(n=args.validation_episodes)
        title += f", {args.iterations} iterations" if args.iterations != ITERATIONS else ""
        title += ", behind a safety filter" if args.safety else ""
        title += f", fine-tuning seed {args.seed}" if args.seed else ""
        write_result("online" + tag.replace("-", "_").replace(".", ""), title, table, command.strip())


if __name__ == "__main__":
    main()
