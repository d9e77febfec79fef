"""The `offline-agent` command: one verb per stage of the pipeline, each a thin layer over library functions.

Each verb parses its flags, calls one library function and prints a summary.
Bad input raises `UserError` (or a ValueError from a config's validation),
which `main` turns into one line on stderr and exit code 2; a Python
traceback reaching the user is a bug.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from typer.core import TyperGroup  # noqa: E402

from offline_agent.errors import UserError  # noqa: E402

console = Console(stderr=True)

BACKEND_HELP = "local | ray (needs the extra: pip install 'offline-agent[ray]')"
PER_TURN_HELP = (
    "each block of a state text (task, every observation and action) is embedded on its own and the state is "
    "their mean, so a new step encodes one block; --whole-text embeds the whole text in one pass (3-4x slower"
)
RAY_ADDRESS_HELP = "with --backend ray: 'auto' joins this machine's cluster, HOST:PORT another [default: a local Ray]"
PRECISION_HELP = (
    "auto | fp32 | bf16 | int8: the rollouts' encoder in int8 (ONNX Runtime; cosine >= 0.99 to fp32) is ~1.3x as "
    "fast as in bfloat16 (cosine >= 0.9999), which is ~1.5x fp32, on CPUs with their instructions{fqe}; auto is "
    "int8 where the CPU has int8 ones (VNNI), else bf16 where the device has bf16 ones, else fp32"
)
EMBED_PRECISION_HELP = (
    "fp32 | bf16 | int8 | auto: the precision the dataset's texts are embedded in; on CPUs with the instructions, "
    "int8 (ONNX Runtime; cosine >= 0.985 to fp32) embeds real logs 2.3-3.3x as fast as fp32, bf16 1.7-1.8x; auto "
    "as for rollouts (--encoder-precision of evaluate)"
)
RAY_ACTORS_HELP = "with --backend ray: actors the environments are spread over [default: one per cluster CPU]"


class _OneLineErrors(TyperGroup):
    """Bad input becomes one line on stderr and exit code 2, for every verb, however it is invoked."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            # escaped: a message's own brackets ("offline-agent[ray]", a JSON list) are text, not rich markup
            console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None


app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Reinforcement learning on the logs of LLM agents: ingest, query, train, fine-tune, evaluate.",
)


def _stdout() -> Console:
    # Piped output (CI logs, files) gets wide tables instead of rich's 80-column default.
    return Console() if sys.stdout.isatty() else Console(width=160)


# --- verbs are registered below, one section per stage ---------------------------------------------


# --- data: ingest, info, query (offline_agent/ingest, offline_agent/dataset.py) ---------------------------


@app.command("ingest")
def ingest_command(
    paths: list[str] = typer.Argument(..., help="log files or folders (.jsonl, .json)"),
    out: str = typer.Option(..., "--out", "-o", help="dataset folder to write"),
    fmt: str = typer.Option(
        "auto", "--format", "-f", help="auto | openai-chat | anthropic | parallel-lists | steps-jsonl | module:function"
    ),
    map_: list[str] = typer.Option([], "--map", help="NAME=FIELD: where a field lives (e.g. messages=traj)"),
    reward: str = typer.Option("outcome", "--reward", help="outcome | per-step | score-delta"),
    gamma: float = typer.Option(0.99, "--gamma", help="discount for return_to_go"),
    success_threshold: float = typer.Option(1.0, "--success-threshold", help="outcome >= this counts as success"),
    split: str = typer.Option("0.8,0.1,0.1", "--split", help="train,valid,test fractions"),
    strict: bool = typer.Option(False, "--strict", help="fail (write nothing) if any record is quarantined"),
    append: bool = typer.Option(False, "--append", help="add these sources to an existing dataset"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing dataset"),
    name: str | None = typer.Option(None, "--name", help="dataset name (default: folder name)"),
    engine: str = typer.Option(
        "auto", "--engine", help="auto (fast paths where a format has one) | python (reference adapters; same result)"
    ),
    backend: str = typer.Option("local", "--backend", help=BACKEND_HELP + ": files and byte ranges as Ray tasks"),
    ray_address: str | None = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
) -> None:
    """Convert agent logs into a Parquet trajectory dataset; unreadable records go to its quarantine."""
    from offline_agent.dataset import validate_split_fractions
    from offline_agent.ingest import ingest
    from offline_agent.ingest.options import parse_mapping

    try:
        fractions = [float(x) for x in split.split(",")]
    except ValueError:
        raise UserError(f"--split expects three numbers like 0.8,0.1,0.1, got {split!r}") from None
    if len(fractions) != 3:
        raise UserError(f"--split expects three numbers like 0.8,0.1,0.1, got {split!r}")
    summary = ingest(
        paths, out, fmt=fmt, mapping=parse_mapping(map_), reward=reward, gamma=gamma,
        success_threshold=success_threshold, split=validate_split_fractions(*fractions), strict=strict,
        append=append, overwrite=overwrite, name=name, progress=sys.stderr.isatty(), engine=engine,
        backend=backend, ray_address=ray_address,
    )
    _print_ingest_summary(summary)


def _print_ingest_summary(summary) -> None:
    from rich.table import Table

    table = Table(title=f"ingested into {summary.dataset}")
    for col in ("source", "format", "records read", "episodes", "steps", "quarantined", "duplicates"):
        table.add_column(col, justify="left" if col in ("source", "format") else "right")
    for s in summary.sources:
        if s.skipped:
            table.add_row(s.path, s.format, "-", "-", "-", "-", s.skipped)
        else:
            table.add_row(s.path, s.format, *(str(v) for v in (
                s.records_read, s.episodes, s.steps, s.quarantined, s.duplicates)))
    out = _stdout()
    out.print(table)
    read, kept = summary.total("records_read"), summary.total("records_ingested")
    q, d = summary.total("quarantined"), summary.total("duplicates")
    verdict = "reconciled" if summary.reconciles else "DOES NOT RECONCILE (a bug: please report it)"
    out.print(f"records read {read} = ingested {kept} + quarantined {q} + duplicates {d}: {verdict}")
    for ex in summary.quarantine_examples:
        out.print(f"  quarantined {ex['source']} {ex['location']}: {ex['reason']}", highlight=False)
    if q:
        out.print(f"see all with: offline-agent query {summary.dataset} \"SELECT * FROM quarantine\"")


@app.command("info")
def info_command(
    dataset: str = typer.Argument(..., help="dataset folder"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Counts, success rate, return distribution, top tools and their error rates, quarantine count."""
    import json

    from offline_agent.dataset import TrajectoryDataset, write_catalog
    from offline_agent.info import dataset_summary

    ds = TrajectoryDataset.open(dataset)
    summary = dataset_summary(ds)
    try:
        write_catalog(ds.path)  # refresh the DuckDB catalog's absolute paths (the folder may have moved)
    except OSError:
        pass
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    _print_info(summary)


def _print_info(s: dict) -> None:
    from rich.table import Table

    out = _stdout()

    def fmt(x):
        return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))

    out.print(f"[bold]{s['name']}[/]  {s['dataset']}  fingerprint {str(s['fingerprint'])[:12]}")
    out.print(
        f"episodes {s['episodes']}  steps {s['steps']}  mean steps/episode {fmt(s['mean_steps'])}  "
        f"success rate {fmt(s['success_rate'])} (of {s['episodes_with_outcome']} with an outcome)  "
        f"quarantined {s['quarantined']}"
    )
    out.print(f"splits {s['splits']}  action kinds {s['action_kinds']}  step error rate {fmt(s['error_rate'])}")
    out.print("return: " + "  ".join(f"{k} {fmt(v)}" for k, v in s["return"].items()))
    if s["top_tools"]:
        table = Table(title="top tools")
        table.add_column("tool")
        table.add_column("calls", justify="right")
        table.add_column("error rate", justify="right")
        for t in s["top_tools"]:
            table.add_row(t["tool"], str(t["calls"]), f"{t['error_rate']:.3f}")
        out.print(table)


@app.command("query")
def query_command(
    dataset: str = typer.Argument(..., help="dataset folder"),
    sql: str = typer.Argument(..., help="SQL over the views steps, episodes, quarantine"),
    fmt: str = typer.Option("table", "--format", "-f", help="table | csv | json | parquet"),
    output: str | None = typer.Option(None, "--output", "-o", help="write to this file instead of stdout"),
) -> None:
    """Run SQL (DuckDB) over a dataset."""
    from offline_agent.dataset import TrajectoryDataset

    if fmt not in ("table", "csv", "json", "parquet"):
        raise UserError(f"unknown --format {fmt!r}: use table, csv, json or parquet")
    if fmt == "parquet" and not output:
        raise UserError("--format parquet needs --output FILE")
    frame = TrajectoryDataset.open(dataset).sql(sql)
    if fmt == "parquet":
        frame.write_parquet(output)
    elif fmt == "csv":
        text = frame.write_csv()
    elif fmt == "json":
        text = frame.write_ndjson()
    else:
        import polars as pl

        with pl.Config(tbl_rows=50, tbl_cols=20, fmt_str_lengths=60):
            text = str(frame) + "\n"
    if fmt != "parquet":
        if output:
            with open(output, "w") as f:
                f.write(text)
        else:
            sys.stdout.write(text)



# --- rewards: relabel, drift (offline_agent/rewards.py, offline_agent/drift.py) ------------------------


@app.command("relabel")
def relabel_command(
    dataset: str = typer.Argument(..., help="dataset folder to read (it is never modified)"),
    reward: str = typer.Option(
        ...,
        "--reward",
        help="reward spec: terms outcome[:W], subgoal[:W], step:C, current[:W], shaping:subgoals, "
        "shaping:module:function joined with '+', e.g. 'outcome+subgoal:0.1+step:-0.01'",
    ),
    out: str = typer.Option(..., "--out", help="folder of the new dataset"),
    gamma: float | None = typer.Option(None, "--gamma", help="discount of return_to_go (default: dataset's)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing dataset at --out"),
) -> None:
    """Recompute reward, return_to_go and episode returns under a new reward spec, into a new dataset."""
    from offline_agent.rewards import relabel

    new = relabel(dataset, reward, out, gamma=gamma, overwrite=overwrite)
    counts = new.meta["counts"]
    console.print(
        f"relabelled {counts['episodes']} episodes, {counts['steps']} steps -> {new.path} "
        f"(reward {new.meta['reward']['spec']}, gamma {new.meta['gamma']})",
        highlight=False,
    )


@app.command("drift")
def drift_command(
    reference: str = typer.Argument(..., help="reference dataset (e.g. the training data)"),
    new: str = typer.Argument(..., help="dataset to check against the reference"),
    json_output: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    psi_threshold: float = typer.Option(0.2, "--psi-threshold", help="flag drift when PSI > this"),
    p_threshold: float = typer.Option(0.01, "--p-threshold", help="flag drift when a test's p-value < this"),
    bins: int = typer.Option(10, "--bins", help="quantile bins of the reference for PSI"),
    min_count: int = typer.Option(20, "--min-count", help="fewer samples on a side: report, never flag"),
) -> None:
    """Compare reward and outcome distributions, overall and per tool.

    Exit code 1 when drift is found, 0 when not, 2 on bad input.
    """
    from offline_agent.drift import DriftConfig, compare_datasets, render_table, summary_line

    config = DriftConfig(psi_threshold=psi_threshold, p_threshold=p_threshold, bins=bins, min_count=min_count)
    report = compare_datasets(reference, new, config)
    if json_output:
        import orjson

        sys.stdout.write(orjson.dumps(report.to_dict()).decode() + "\n")
    else:
        stdout = _stdout()
        stdout.print(render_table(report))
        stdout.print(summary_line(report), style="bold red" if report.drift else "green", highlight=False)
    # SystemExit, not typer.Exit: main() runs the app with standalone_mode=False, which returns
    # typer.Exit's code instead of raising it
    if report.drift:
        raise SystemExit(1)


# --- embed: state/action embeddings into DATASET/embeddings (offline_agent/text/) ---------------------------


@app.command("embed")
def embed_command(
    dataset: str = typer.Argument(..., help="dataset folder; vectors go to DATASET/embeddings"),
    encoder: str | None = typer.Option(
        None, "--encoder", help="local transformers model folder (default: the packaged all-MiniLM-L6-v2)"
    ),
    k: int = typer.Option(3, "--k", min=0, help="previous (observation, action) turns in each state text"),
    keep_opening: bool = typer.Option(
        False, "--keep-opening", help="each state text also keeps its episode's first turn (the user's request) "
        "after it has left the last k"
    ),
    observation_view: bool = typer.Option(
        False, "--observation-view", help="each state's current observation is also embedded on its own, "
        "beside the whole state text (vectors twice as wide)"
    ),
    per_turn: bool = typer.Option(
        True, "--per-turn/--whole-text", help=PER_TURN_HELP + "; tuned encoders need it)"
    ),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="texts per encoder forward pass"),
    encoder_precision: str = typer.Option(
        "fp32", "--encoder-precision", help=EMBED_PRECISION_HELP + "; train with the same to use these vectors"
    ),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    backend: str = typer.Option("local", "--backend", help=BACKEND_HELP + ": new texts encoded by Ray actors"),
    ray_address: str | None = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
) -> None:
    """Embed every step's state text, every action and every candidate action, through the embedding cache."""
    from offline_agent.dataset import TrajectoryDataset
    from offline_agent.ray_backend import check_backend, require_ray
    from offline_agent.text.cache import CACHE_DIRNAME, EmbeddingCache
    from offline_agent.text.encoder import TextEncoder
    from offline_agent.text.states import StateSettings, dataset_texts

    state_settings = StateSettings(
        k=k, keep_opening=keep_opening, observation_view=observation_view, per_turn=per_turn
    )
    if check_backend(backend) == "ray":
        require_ray()  # before the encoder loads and the texts are rendered
    ds = TrajectoryDataset.open(dataset)
    text_encoder = TextEncoder(
        encoder, device=device, batch_size=batch_size, observation_view=state_settings.observation_view,
        per_turn=state_settings.per_turn, precision=encoder_precision,
    )
    texts = dataset_texts(ds, state_settings.for_encoder(text_encoder), text_encoder.count_tokens)
    cache = EmbeddingCache(ds.path / CACHE_DIRNAME, text_encoder)
    cache.embed(
        [*texts.states, *texts.actions, *texts.candidates], progress=sys.stderr.isatty(), backend=backend,
        ray_address=ray_address,
    )
    console.print(
        f"{len(texts.states)} states, {len(texts.actions)} actions, {len(texts.candidates)} candidates: "
        f"{cache.misses} new texts encoded, {cache.hits} cached -> {cache.folder}",
        highlight=False,
    )


# --- simulate: behaviour-policy rollouts in a simulator, written as chat logs (offline_agent/simulate.py) ---


@app.command("simulate")
def simulate_command(
    env: str = typer.Argument(
        ..., help="environment: a registered id (offline_agent/Logistics-v0, ...) or module.path:factory"
    ),
    episodes: int = typer.Option(100, "--episodes", "-n", help="episodes to roll out"),
    policy: str = typer.Option(
        "noisy:0.5", "--policy", help="behaviour policy: expert, random, noisy:EPS, flaky:EPS or llm-like"
    ),
    seed: int = typer.Option(0, "--seed", help="run seed: episode i resets with a seed derived from (seed, i)"),
    out: str = typer.Option(..., "--out", "-o", help="JSONL file to write (OpenAI chat format, one episode a line)"),
) -> None:
    """Roll out a behaviour policy in a simulator, write its logs, and print its success rate."""
    from offline_agent.simulate import simulate

    summary = simulate(env, episodes, policy, seed, out, progress=sys.stderr.isatty())
    low, high = summary.success_interval
    typer.echo(
        f"wrote {summary.episodes} episodes ({summary.steps} steps) to {summary.path}\n"
        f"policy {summary.policy} on {summary.env}: success rate {summary.success_rate:.3f} "
        f"(95% CI {low:.3f}-{high:.3f}), mean return {summary.mean_return:.3f}, "
        f"mean steps {summary.steps / summary.episodes:.1f}"
    )


# --- report: one self-contained HTML page per run or demo folder (offline_agent/report.py) ----------------


@app.command("report")
def report_command(
    run: str = typer.Argument(..., help="run folder (offline or fine-tune run) or a demo folder holding several"),
    out: str | None = typer.Option(None, "--out", "-o", help="HTML file to write (default: RUN/report.html)"),
    dataset: str | None = typer.Option(
        None, "--dataset", help="dataset folder to summarise (default: the one the runs' configs name)"
    ),
) -> None:
    """Write one HTML page: dataset summary, training and fine-tuning curves, evaluation table."""
    from offline_agent.report import write_report

    path = write_report(run, out=out, dataset=dataset)
    typer.echo(f"wrote {path}")


# --- end report ---------------------------------------------------------------------------------------------


# --- finetune: PPO + KL to the offline policy in simulated envs (offline_agent/online/) ---------------------


@app.command("finetune")
def finetune_command(
    run: str = typer.Argument(..., help="offline checkpoint (run folder or its policy.json)"),
    env: str = typer.Option(..., "--env", help="registered env id (offline_agent/Logistics-v0) or module:factory"),
    out: str = typer.Option(..., "--out", "-o", help="run folder of the fine-tuned policy"),
    num_envs: int = typer.Option(8, "--num-envs", help="environments stepped in parallel"),
    iterations: int = typer.Option(48, "--iterations", help="rollout + update iterations"),
    num_steps: int = typer.Option(64, "--num-steps", help="steps per environment per iteration"),
    target_kl: float | None = typer.Option(None, "--target-kl", help="adapt beta to this KL per step [default: 0.1]"),
    beta: float | None = typer.Option(None, "--beta", help="fixed KL weight instead of --target-kl (0 = no KL)"),
    kl_gain: float = typer.Option(
        1.0, "--kl-gain", help="how fast --target-kl's controller follows the KL: beta *= (KL / target) ** gain "
        "after each rollout, 4x up or 1.25x down at most"
    ),
    trust_region: float | None = typer.Option(
        1.5, "--trust-region",
        help="a minibatch whose KL to the offline policy exceeds this many times --target-kl steps back toward it "
        "instead of its objective (with --target-kl only)",
    ),
    no_trust_region: bool = typer.Option(False, "--no-trust-region", help="turn the trust region off"),
    safety: list[str] = typer.Option(
        [], "--safety", help="deny:TOOL,.. | regex:PATTERN | callable:mod:fn (join with ';' or repeat)"
    ),
    seed: int = typer.Option(0, "--seed", help="seed of sampling, minibatches and environments"),
    policy_init: str = typer.Option(
        "residual", "--policy-init",
        help="residual: train a correction of the frozen offline network; copy: train a copy of it",
    ),
    kl_gradient: bool = typer.Option(
        True, "--kl-gradient/--no-kl-gradient",
        help="also descend the KL penalty's own gradient (off: the penalty acts through the rewards only)",
    ),
    learning_rate: float | None = typer.Option(
        None, "--learning-rate", help="Adam learning rate of the policy [default: 1e-3 residual, 1e-5 copy]"
    ),
    value_learning_rate: float | None = typer.Option(
        None, "--value-learning-rate", help="Adam learning rate of the value head [default: PPOConfig's]"
    ),
    tau: float = typer.Option(
        0.2, "--tau",
        help="temperature of the fine-tuned and reference policy softmax(Q / tau) (CQL trains at 0.1): a warmer one "
        "keeps greedy play and lets PPO sample alternatives, where sampled episodes still succeed (docs/finetuning.md)",
    ),
    subgoal_shaping: float = typer.Option(
        1.0, "--subgoal-shaping",
        help="weight of potential-based shaping on the env's sub-goals (info sub_goals_done / sub_goals_total): "
        "credits a step that completes one at once, leaves the best policy unchanged (0 = off; no effect in an "
        "env that reports no sub-goals)",
    ),
    self_imitation: float = typer.Option(
        1.0, "--self-imitation",
        help="weight of self-imitation: after each PPO update, imitate the calls of recent successful episodes "
        "where they did better than the value head expected (Oh et al. 2018; 0 = off)",
    ),
    self_imitation_epochs: float = typer.Option(
        2.0, "--self-imitation-epochs", help="passes of self-imitation over its buffer per iteration"
    ),
    self_imitation_buffer: int = typer.Option(
        2048, "--self-imitation-buffer", help="steps of recent successful episodes kept for self-imitation"
    ),
    self_imitation_start: int = typer.Option(
        0, "--self-imitation-start",
        help="steps of successful episodes to collect before self-imitation begins (a warm-up) [default: 0]",
    ),
    checkpoint_every: int = typer.Option(
        5, "--checkpoint-every", help="resumable checkpoint (and env reset) every N iterations"
    ),
    resume: bool = typer.Option(False, "--resume", help="continue OUT from its last checkpoint"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a run already in OUT"),
    vector: str = typer.Option("auto", "--vector", help="auto | sync | process environments (local backend)"),
    backend: str = typer.Option("local", "--backend", help=BACKEND_HELP),
    ray_address: str | None = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
    ray_actors: int | None = typer.Option(None, "--ray-actors", help=RAY_ACTORS_HELP),
    encoder: str | None = typer.Option(None, "--encoder", help="encoder folder [default: RUN's own]"),
    encoder_precision: str = typer.Option(
        "auto", "--encoder-precision",
        help=PRECISION_HELP.format(fqe="") + "; a --resume needs the same (auto: what the run started in)",
    ),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    from_scratch: bool = typer.Option(False, "--from-scratch", help="re-initialise the policy (baseline)"),
    validation_episodes: int = typer.Option(
        32, "--validation-episodes",
        help="play the offline policy and each iteration's greedily on N held-out episodes and keep one by "
        "--validation-keep, not the last (0 = off: the last)",
    ),
    validation_keep: str = typer.Option(
        "guard", "--validation-keep",
        help="best: the most validation successes; guard: the latest policy with at least the offline one's "
        "(no early dip, and the last policy once it has passed)",
    ),
    validation_seed: int | None = typer.Option(
        None, "--validation-seed", help="seed of the validation episodes [default: PPOConfig's, 2000]"
    ),
    torch_threads: int = typer.Option(
        1, "--torch-threads",
        help="torch threads (encoding states is most of a rollout: 2 on 2 cores nearly doubles env steps/s; "
        "results depend on it, so a --resume needs the same)",
    ),
) -> None:
    """Fine-tune an offline policy online with PPO, kept near it by a KL penalty, behind a safety filter."""
    from offline_agent.online.config import PPOConfig
    from offline_agent.online.finetune import finetune

    config = PPOConfig(
        iterations=iterations, num_envs=num_envs, num_steps=num_steps, target_kl=target_kl, beta=beta, seed=seed,
        kl_gain=kl_gain, trust_region=None if no_trust_region else trust_region,
        policy_init=policy_init, kl_gradient=kl_gradient, learning_rate=learning_rate, vector=vector, device=device,
        from_scratch=from_scratch, validation_episodes=validation_episodes, validation_keep=validation_keep,
        checkpoint_every=checkpoint_every, torch_threads=torch_threads, tau=tau, subgoal_shaping=subgoal_shaping,
        self_imitation=self_imitation, self_imitation_epochs=self_imitation_epochs,
        self_imitation_buffer=self_imitation_buffer, self_imitation_start=self_imitation_start,
        **({} if value_learning_rate is None else {"value_learning_rate": value_learning_rate}),
        **({} if validation_seed is None else {"validation_seed": validation_seed}),
    )
    result = finetune(
        run, env, out, config, safety=safety, resume=resume, overwrite=overwrite, encoder=encoder,
        encoder_precision=encoder_precision, progress=sys.stderr.isatty(), backend=backend,
        ray_address=ray_address, ray_actors=ray_actors,
    )
    m = result.final_metrics
    console.print(
        f"fine-tuned {result.iterations} iterations ({result.env_steps} env steps"
        + (f", resumed after iteration {result.resumed_from}" if result.resumed_from is not None else "")
        + f") -> {result.run_dir}: success rate {m.get('charts/success_rate', float('nan')):.3f}, "
        f"KL {m.get('objective/kl', float('nan')):.4f}, beta {m.get('objective/beta', float('nan')):.4f}, "
        f"blocked {int(m.get('safety/blocked', 0))}"
        + ("" if result.ray is None else f"; {_ray_summary(result.ray)}"),
        highlight=False,
    )


# --- end finetune -------------------------------------------------------------------------------------------


# --- learn: train, evaluate (offline_agent/learn/, offline_agent/evaluate.py) --------------------------------


@app.command("train")
def train_command(
    dataset: str = typer.Argument(..., help="dataset folder (from `offline-agent ingest`)"),
    algo: str = typer.Option("cql", "--algo", help="cql | bc | filtered-bc | d3rlpy-cql"),
    out: str = typer.Option(..., "--out", "-o", help="run folder to write (checkpoint, metrics, curves)"),
    steps: int | None = typer.Option(None, "--steps", help="gradient steps [default: 2000]"),
    batch_size: int | None = typer.Option(None, "--batch-size", help="transitions per step [default: 256]"),
    seed: int = typer.Option(0, "--seed", help="seed of initialisation and batch sampling"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    alpha: float | None = typer.Option(None, "--alpha", help="CQL conservative weight [default: 1.0]"),
    gamma: float | None = typer.Option(
        None, "--gamma", help="cql/d3rlpy-cql: discount of the TD targets (not the dataset's, which its reported "
        "returns and the value network keep) [default: 0.95]"
    ),
    encoder: str | None = typer.Option(None, "--encoder", help="encoder folder [default: packaged MiniLM]"),
    encoder_precision: str = typer.Option(
        "fp32", "--encoder-precision", help=EMBED_PRECISION_HELP + "; the run records it and plays in any"
    ),
    k: int | None = typer.Option(None, "--k", help="previous turns in the state text [default: 3]"),
    keep_opening: bool = typer.Option(
        False, "--keep-opening", help="each state text also keeps its episode's first turn (the user's request) "
        "after it has left the last k"
    ),
    observation_view: bool = typer.Option(
        False, "--observation-view", help="each state's current observation is also embedded on its own, "
        "beside the whole state text (vectors twice as wide)"
    ),
    per_turn: bool | None = typer.Option(
        None, "--per-turn/--whole-text",
        help=PER_TURN_HELP + ") [default: per turn; whole text with --tune-encoder-layers]"
    ),
    cal_ql: bool = typer.Option(
        True, "--cal-ql/--no-cal-ql", help="CQL: floor pushed-down values at the MC return (Cal-QL)"
    ),
    mc_weight: float = typer.Option(
        0.0, "--mc-weight", help="cql: weight of an auxiliary regression of the logged action's Q on its "
        "Monte-Carlo return; not for a policy to deploy: at 5 it cut the simulators' greedy success below the "
        "logs' own (to predict outcomes, the value network of --value-head does it apart) [default: 0 = off]"
    ),
    value_head: bool = typer.Option(
        True, "--value-head/--no-value-head", help="also train the logs' value network: the logged agent's "
        "expected return from each step, regressed on the logs' returns, apart from the policy (what `advise` "
        "predicts returns with and `evaluate --dataset` scores for success; not with --tune-encoder-layers)"
    ),
    tune_encoder_layers: int = typer.Option(
        0, "--tune-encoder-layers", help="cql/bc: fine-tune the encoder's top N layers with the loss [default: 0]"
    ),
    encoder_lr: float | None = typer.Option(
        None, "--encoder-lr", help="learning rate of the tuned encoder layers [default: 5e-5]"
    ),
    encoder_lora_rank: int = typer.Option(
        0, "--encoder-lora-rank", help="tune those layers through LoRA updates of this rank [default: 0 = fully]"
    ),
    encoder_action_gradient: bool = typer.Option(
        False, "--encoder-action-gradient", help="tuned layers also learn from the batch's action texts"
    ),
    grounding: bool = typer.Option(
        True, "--grounding/--no-grounding", help="cql/bc: score each candidate with its grounding in the episode "
        "(argument values found in the task and observations, actions already taken)"
    ),
    head: str = typer.Option(
        "factorised", "--head", help="cql: factorised (state and action towers, a small per-pair head; fast) | "
        "pairwise (an MLP over every state-candidate pair; the earlier design)"
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a policy already in OUT"),
) -> None:
    """Train an offline policy on a dataset: CQL over candidate actions, or a baseline."""
    from offline_agent.learn.train import train
    from offline_agent.text.states import DEFAULT_K, StateSettings

    state_settings = StateSettings(
        k=DEFAULT_K if k is None else k, keep_opening=keep_opening, observation_view=observation_view,
        # A tuned encoder is tuned over whole state texts (`train`'s default for it too).
        per_turn=not tune_encoder_layers if per_turn is None else per_turn,
    )
    # Settings only some algorithms have are passed when they differ from the default, so that the
    # others' configs (which lack them) only complain when asked for something they cannot do.
    settings: dict[str, object] = {} if cal_ql else {"cal_ql": False}
    if tune_encoder_layers:
        settings["tune_encoder_layers"] = tune_encoder_layers
    if encoder_lora_rank:
        settings["encoder_lora_rank"] = encoder_lora_rank
    if encoder_action_gradient:
        settings["encoder_action_gradient"] = True
    if encoder_lr is not None:
        settings["encoder_learning_rate"] = encoder_lr
    if not grounding:
        settings["grounding"] = False
    if head != "factorised":
        settings["head"] = head
    if mc_weight:
        settings["mc_weight"] = mc_weight
    if gamma is not None:
        settings["gamma"] = gamma
    result = train(
        dataset, algo, out, steps=steps, batch_size=batch_size, seed=seed, device=device, alpha=alpha,
        encoder=encoder, encoder_precision=encoder_precision, state_settings=state_settings, overwrite=overwrite,
        progress=sys.stderr.isatty(), settings=settings, value_head=value_head,
    )
    final = ", ".join(f"{name} {value:.4f}" for name, value in result.final_metrics.items() if name != "step")
    console.print(
        f"trained {result.algo} for {result.steps} steps in {result.seconds:.1f}s "
        f"({result.steps_per_second:.1f} steps/s; embeddings: {result.cache_hits} cached, "
        f"{result.cache_misses} encoded) -> {result.run_dir}\n{final}",
        highlight=False,
        soft_wrap=True,
    )


@app.command("evaluate")
def evaluate_command(
    run: str = typer.Argument(..., help="run folder, or behaviour:SPEC (e.g. behaviour:noisy:0.5)"),
    env: str | None = typer.Option(None, "--env", help="registered env id or module:factory to roll out in"),
    episodes: int = typer.Option(100, "--episodes", "-n", help="episodes to roll out"),
    seed: int = typer.Option(0, "--seed", help="episode i resets with a seed derived from (seed, i)"),
    dataset: str | None = typer.Option(None, "--dataset", help="also estimate the value by FQE on its test split"),
    fqe_steps: int = typer.Option(1500, "--fqe-steps", help="FQE gradient steps"),
    fqe_runs: int = typer.Option(
        3, "--fqe-runs",
        help="FQE refits (seeds SEED, SEED+1, ...) on bootstrap resamples of the test episodes, beside the fit on "
        "the test split that gives the value: their spread widens its interval (0 or 1: the test episodes' spread "
        "alone)",
    ),
    fqe_bounds: bool = typer.Option(
        True, "--fqe-bounds/--no-fqe-bounds",
        help="also fit FQE assuming the logs' lowest and then highest return wherever they do not show the "
        "policy's choice near a state: the range its value lies in whatever it does there (3x the FQE time)",
    ),
    fqe_grounding: bool = typer.Option(
        False, "--fqe-grounding/--no-fqe-grounding",
        help="FQE's Q also reads each (state, action) pair's grounding in the episode, as the policies do (it can then "
        "tell a call whose values come from the conversation from a made-up one; on the simulators its interval "
        "covered fewer settings: docs/evaluation.md)",
    ),
    encoder: str | None = typer.Option(None, "--encoder", help="encoder folder [default: the run's own]"),
    encoder_precision: str = typer.Option(
        "auto", "--encoder-precision",
        help=PRECISION_HELP.format(fqe=" (FQE embeds the dataset as the run was trained: fp32 by default)"),
    ),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    json_output: bool = typer.Option(False, "--json", help="print one JSON object"),
    safety: list[str] = typer.Option(
        [], "--safety", help="replace the run's saved safety rules: deny:TOOL,.. | regex:PATTERN | callable:mod:fn"
    ),
    no_safety: bool = typer.Option(False, "--no-safety", help="roll out without the run's saved safety rules"),
    backend: str = typer.Option("local", "--backend", help=BACKEND_HELP),
    ray_address: str | None = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
    ray_actors: int | None = typer.Option(None, "--ray-actors", help=RAY_ACTORS_HELP),
    n_envs: int = typer.Option(16, "--num-envs", help="environments played at once (one encoder batch a round)"),
) -> None:
    """Success rate (95% Wilson interval), returns, steps and error recovery of a policy in a simulator,
    behind the safety rules saved with the run; with --dataset, its off-policy (FQE) value on held-out logs."""
    import json

    from offline_agent.evaluate import evaluate, off_policy_value

    if env is None and dataset is None:
        raise UserError("evaluate needs --env ENV (simulated rollouts) and/or --dataset DATASET (FQE on logs)")
    if dataset is not None and run.startswith("behaviour:"):
        raise UserError("--dataset (FQE) needs a trained run, not a behaviour policy")
    rules = _safety_override(safety, no_safety, env)
    out: dict = {}
    if env is not None:
        out = evaluate(
            run, env, episodes=episodes, seed=seed, device=device, encoder=encoder, safety=rules,
            encoder_precision=encoder_precision, n_envs=n_envs, backend=backend, ray_address=ray_address,
            ray_actors=ray_actors,
        ).to_dict()
    if dataset is not None:
        fqe = off_policy_value(
            run, dataset, steps=fqe_steps, seed=seed, device=device, encoder=encoder, runs=fqe_runs,
            bounds=fqe_bounds, grounding=fqe_grounding,
        )
        out["fqe"] = fqe.to_dict()
    if json_output:
        sys.stdout.write(json.dumps(out) + "\n")
        return
    if env is not None:
        low, high = out["ci95"]
        retries = out["mean_retries_to_recover"]
        recovery = "n/a" if retries is None else f"{retries:.2f} ({out['recoveries']} recoveries"
        typer.echo(
            f"{out['policy']} on {out['env']}, {out['episodes']} episodes"
            + ("" if out["encoder_precision"] is None else f" (encoder in {out['encoder_precision']})")
            + f": success rate {out['success_rate']:.3f} "
            f"(95% CI {low:.3f}-{high:.3f}), mean return {out['mean_return']:.3f}, mean steps {out['mean_steps']:.1f}, "
            f"error steps {out['error_rate']:.1%}, retries to recover {recovery}"
            + ("" if retries is None else f", {out['unrecovered']} unrecovered)")
            + f"; {_safety_summary(out)}"
            + ("" if out["ray"] is None else f"; {_ray_summary(out['ray'])}")
        )
    if dataset is not None:
        typer.echo(_fqe_summary(out["fqe"]))


def _fqe_summary(f: dict) -> str:
    import math

    from offline_agent.evaluate import LOW_COVERAGE, digits_below, fqe_doubts

    low, high = f["fqe_ci95"]
    line = (
        f"FQE on {f['episodes']} held-out episodes of {f['dataset']} ({f['split']} split): value "
        f"{f['fqe_value']:.3f} (95% CI {low:.3f}-{high:.3f}, {f['fqe_runs']} refits) vs {f['behaviour_value']:.3f} "
        f"for the logged behaviour (gamma {f['gamma']}); coverage {digits_below(f['coverage'], LOW_COVERAGE)} of the "
        f"policy's choices logged in one of the {f['coverage_k']} most similar states"
    )
    bounds = f.get("fqe_bounds") or [math.nan, math.nan]
    if all(math.isfinite(b) for b in bounds):
        line += (
            f". Whatever the policy does where the logs do not show its choice, its value lies in "
            f"{bounds[0]:.3f}-{bounds[1]:.3f} (95%)"
        )
    logged_returns = tuple(f.get("logged_returns") or (math.nan, math.nan))
    doubts = fqe_doubts(f["coverage"], f["episodes"], f["fqe_value"], logged_returns)
    line += f". Do not act on this value: {'; '.join(doubts)}" if doubts else ""
    if f.get("value_auc") is not None and math.isfinite(f["value_auc"]):
        low, high = f["value_auc_ci95"]
        line += (
            f"\nThe logs' value predicts these episodes' success with ROC AUC {f['value_auc']:.3f} (95% CI "
            f"{low:.3f}-{high:.3f}) at their first step, {f['value_auc_per_step']:.3f} over every step (0.5 = chance)"
        )
    return line


@app.command("advise")
def advise_command(
    dataset: str = typer.Argument(..., help="dataset folder of the logs to advise on"),
    run: str = typer.Argument(..., help="run folder of a trained policy (train or finetune)"),
    split: str | None = typer.Option(None, "--split", help="train | valid | test [default: every step]"),
    top: int = typer.Option(15, "--top", min=1, help="situations shown in the table"),
    alternatives: int = typer.Option(
        256, "--alternatives", help="where a step has no logged candidates: the most frequent actions it may choose"
    ),
    csv_path: str | None = typer.Option(None, "--csv", help="write every situation's advice to this CSV file"),
    json_output: bool = typer.Option(False, "--json", help="print every situation as one JSON list"),
    encoder: str | None = typer.Option(None, "--encoder", help="encoder folder [default: the run's own]"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
) -> None:
    """Where the policy disagrees with the logs, per tool and situation (first step, after an error, after a
    result), ranked by the value it sees left on the table, and what it would have done instead."""
    import json
    import math
    from dataclasses import asdict

    from rich.table import Table

    from offline_agent.advise import advise, write_csv

    advice = advise(dataset, run, split=split, device=device, encoder=encoder, alternatives=alternatives)
    if csv_path is not None:
        write_csv(advice, csv_path)
    if json_output:
        sys.stdout.write(json.dumps([asdict(a) for a in advice]) + "\n")
        return
    table = Table(title=f"Where {run} disagrees with the logs of {dataset}", title_justify="left")
    numbers = ("steps", "disagrees", "value gap", "predicted return")
    columns = ("tool", "situation", "steps", "disagrees", "value gap", "instead", "episode success", "predicted return")
    for column in columns:
        table.add_column(column, justify="right" if column in numbers else "left")
    for a in advice[:top]:
        success = "n/a" if math.isnan(a.episode_success) else f"{a.episode_success:.0%}"
        predicted = "n/a" if math.isnan(a.predicted_return) else f"{a.predicted_return:.2f}"
        instead = f"{a.instead} ({a.instead_share:.0%})" if a.instead else ""
        table.add_row(
            a.tool, a.situation, str(a.steps), f"{a.disagreement_rate:.0%}", f"{a.value_gap:.2f}", instead, success,
            predicted,
        )
    _stdout().print(table)
    shown = min(top, len(advice))
    typer.echo(f"{shown} of {len(advice)} situations" + (f"; all of them in {csv_path}" if csv_path else ""))


def _safety_override(specs: list[str], off: bool, env: str | None) -> list[str] | None:
    """evaluate's `safety` argument: None keeps the run's saved rules, [] turns them off."""
    from offline_agent.envs.safety import SPEC_HELP, split_specs

    if (specs or off) and env is None:
        raise UserError("--safety and --no-safety apply to rollouts: add --env ENV")
    if specs and off:
        raise UserError("--safety replaces the saved rules and --no-safety drops them: pass one of the two")
    if specs and not split_specs(specs):  # a blank spec would silently turn the saved rules off
        raise UserError(f"--safety {specs[0]!r} names no rule: expected {SPEC_HELP}, or --no-safety for none")
    return [] if off else specs or None


def _ray_summary(stats: dict) -> str:
    return (
        f"on Ray: {stats['actors']} actors, {stats['actors_replaced']} replaced "
        f"({stats['envs_replayed']} environments replayed, {stats['steps_replayed']} steps)"
    )


def _safety_summary(out: dict) -> str:
    if not out["safety"]:
        return "no safety filter"
    return (
        f"safety filter {'; '.join(out['safety'])}: {out['blocked_actions']} candidate actions blocked, "
        f"{out['safety_truncated']} episodes ended with every candidate forbidden"
    )


# --- end learn ----------------------------------------------------------------------------------------------


def main() -> None:
    app()


if __name__ == "__main__":
    main()
