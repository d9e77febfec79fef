"""Embedding throughput: our `TextEncoder.encode` against sentence-transformers' own `encode`, same model.

Both encode the same N texts (default 2,000) with batch size 64 in one process,
so they share torch's thread pool. The texts are the state and action texts the
`embed` verb would render from the real agent logs in ../shared/data/real
(τ-bench airline, InterCode bash) when present, else generated agent-like
observations and tool calls. Each method gets a warm-up batch, then the best of
`--repeats` timed runs (alternating between the two) counts. Also timed: the embedding cache cold (encode +
write a part file) and warm (every text a hit).

A second table times what `embed` and `train` do with a real dataset by default (per-turn state vectors):
embed every distinct block, action and candidate of all its episodes into an empty cache, in fp32, bf16 and
int8 (`--encoder-precision`), one after the other, with the smallest cosine of each precision's state and
action vectors to the fp32 ones. Prints the tables and writes them to benchmarks/results/embed.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REAL, REAL_SOURCES, markdown_table, write_result  # noqa: E402

TOOLS = ["inspect_logs", "retry_stage", "rollback", "patch_schema", "get_reservation", "search_flights", "bash"]


def real_texts(encoder, n: int, seed: int) -> list[str] | None:
    """Distinct state and action texts rendered from the real logs, as `offline-agent embed` renders them."""
    from offline_agent.ingest import ingest
    from offline_agent.text.states import StateSettings, dataset_texts

    sources = [REAL / "tau_bench_airline", REAL / "intercode" / "bash_gpt-4"]
    if not all(s.is_dir() for s in sources):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        ingest(sources, Path(tmp) / "ds")
        settings = StateSettings(k=3, per_turn=False).for_encoder(encoder)
        texts = dataset_texts(Path(tmp) / "ds", settings, encoder.count_tokens)
    pool = sorted(set(texts.states) | set(texts.actions))
    random.Random(seed).shuffle(pool)
    return pool[:n] if len(pool) >= n else None


def generated_texts(n: int, seed: int) -> list[str]:
    """Agent-like texts: tool calls, tool results with log lines and errors, short multi-turn states."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        tool = rng.choice(TOOLS)
        call = json.dumps({"name": tool, "arguments": {"stage": rng.randint(1, 9), "id": f"R{rng.randint(0, 9999)}"}})
        result = f"stage {rng.randint(1, 9)} status: " + rng.choice(["ok", "Error: timeout", "KeyError: 'id'"])
        result += " log line" * rng.randint(2, 60)
        if i % 3 == 0:
            texts.append(call)
        elif i % 3 == 1:
            texts.append(result)
        else:
            texts.append(f"Task: repair job {i}\n[obs] {result}\n[act] {call}\n[obs] {result[: rng.randint(10, 200)]}")
    return texts


PRECISIONS = ("fp32", "bf16", "int8")


def precision_rows(device: str, batch_size: int) -> list[list[str]] | None:
    """One row per real dataset: its texts, and each precision's seconds (cold cache) and min cosine to fp32."""
    from offline_agent.ingest import ingest
    from offline_agent.text.cache import EmbeddingCache
    from offline_agent.text.encoder import TextEncoder
    from offline_agent.text.states import StateSettings, dataset_texts, turn_blocks

    if not all(source.exists() for source, _ in REAL_SOURCES.values()):
        return None
    encoders = {p: TextEncoder(device=device, batch_size=batch_size, precision=p) for p in PRECISIONS}
    encoders["int8"].encode(["builds the int8 model before the clock starts"])
    rows = []
    for name, (source, reward) in REAL_SOURCES.items():
        with tempfile.TemporaryDirectory() as tmp:
            ingest([source], Path(tmp) / "ds", reward=reward)
            texts = dataset_texts(Path(tmp) / "ds", StateSettings().for_encoder(encoders["fp32"]),
                                  encoders["fp32"].count_tokens)
            every = [*texts.states, *texts.actions, *texts.candidates]
            n_blocks = len({block for text in every for block in turn_blocks(text)})
            seconds, vectors = {}, {}
            for precision, encoder in encoders.items():
                cache = EmbeddingCache(Path(tmp) / precision, encoder)
                seconds[precision], vectors[precision] = timed(lambda c=cache, t=every: c.embed(t))
        cosine = {p: float((vectors[p] * vectors["fp32"]).sum(1).min()) for p in PRECISIONS}
        rows.append([name, f"{len(texts.states):,} states, {n_blocks:,} distinct texts",
                     *(f"{seconds[p]:.0f} ({seconds['fp32'] / seconds[p]:.1f}x)" for p in PRECISIONS),
                     *(f"{cosine[p]:.4f}" for p in PRECISIONS[1:])])
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="texts to encode")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per method; the best counts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--no-precisions", action="store_true", help="skip the real datasets' precision table")
    args = parser.parse_args()

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from offline_agent.text.cache import EmbeddingCache
    from offline_agent.text.encoder import TextEncoder, default_encoder_path

    # Whole texts in one pass each: the vectors sentence-transformers gives (per-turn vectors pool other texts).
    ours = TextEncoder(device=args.device, batch_size=args.batch_size, per_turn=False)
    theirs = SentenceTransformer(default_encoder_path(), device=args.device)
    theirs.max_seq_length = ours.max_length
    texts = real_texts(ours, args.n, args.seed)
    source = "real logs (τ-bench airline + InterCode bash states and actions)"
    if texts is None:
        texts, source = generated_texts(args.n, args.seed), "generated agent-like texts"
    tokens = [min(ours.count_tokens(t), ours.max_length) for t in texts]

    def encode_theirs():
        return theirs.encode(texts, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True)

    ours.encode(texts[: args.batch_size])  # warm-up: first-call allocations, lazy kernels
    theirs.encode(texts[: args.batch_size], batch_size=args.batch_size)
    load_before = os.getloadavg()[0]
    # Alternate the two methods, so that a change in the machine's load hits both alike.
    t_ours = t_theirs = float("inf")
    for _ in range(args.repeats):
        t, v_ours = timed(lambda: ours.encode(texts))
        t_ours = min(t_ours, t)
        t, v_theirs = timed(encode_theirs)
        t_theirs = min(t_theirs, t)
    max_diff = float(np.abs(v_ours - v_theirs).max())
    with tempfile.TemporaryDirectory() as tmp:
        cache = EmbeddingCache(tmp, ours)
        t_cold, _ = timed(lambda: cache.embed(texts))
        t_warm, _ = timed(lambda: cache.embed(texts))
        assert cache.misses == 0
    load_after = os.getloadavg()[0]
    by_precision = None if args.no_precisions else precision_rows(args.device, args.batch_size)

    n = len(texts)
    rows = [
        ["sentence-transformers `encode`", f"{n / t_theirs:,.0f}", "1.00"],
        ["`TextEncoder.encode`", f"{n / t_ours:,.0f}", f"{t_theirs / t_ours:.2f}"],
        ["`EmbeddingCache.embed`, cold (encode + write)", f"{n / t_cold:,.0f}", f"{t_theirs / t_cold:.2f}"],
        ["`EmbeddingCache.embed`, warm (all cached)", f"{n / t_warm:,.0f}", f"{t_theirs / t_warm:.2f}"],
    ]
    table = markdown_table(["method", "texts/s", "x sentence-transformers"], rows)
    notes = (
        f"{n} {source}; {np.mean(tokens):.0f} tokens on average (max {max(tokens)}), batch size {args.batch_size}, "
        f"device {args.device}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"max |ours - sentence-transformers| = {max_diff:.1e}; best of {args.repeats} alternating runs; "
        f"1-min load average {load_before:.1f} before, {load_after:.1f} after (other processes share the cores)."
    )
    body = f"{table}\n\n{notes}"
    if by_precision is not None:
        body += "\n\n" + markdown_table(
            ["real logs", "texts (per-turn blocks, actions, candidates)",
             *(f"{p} seconds (x fp32)" for p in PRECISIONS), *(f"{p} min cosine to fp32" for p in PRECISIONS[1:])],
            by_precision,
        ) + (
            "\n\nWhat `embed` and `train` encode on a whole real dataset by default (per-turn state vectors, k = 3, "
            "256 tokens): every distinct block, action and candidate, into an empty embedding cache (encode + "
            f"write), in each `--encoder-precision`, batch size {args.batch_size}, {torch.get_num_threads()} torch "
            "threads; int8's model built before the clock starts (a few seconds, once per process). Min cosine: "
            "the smallest over every state and action vector of the dataset, to the fp32 one."
        )
    command = "python benchmarks/embed.py" + (f" --device {args.device}" if args.device != "cpu" else "")
    if args.no_write:
        print(body)
    else:
        write_result("embed", "Embedding throughput", body, command)


if __name__ == "__main__":
    main()
