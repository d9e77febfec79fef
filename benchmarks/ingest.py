"""Ingestion speed and memory: our streaming ingester against a naive baseline and the orjson parse floor.

Generates an OpenAI-chat JSONL file of N steps (default 1,000,000), then, each in
its own process so peak RSS is its own: (floor) orjson.loads of every line and
nothing else; (naive) json.loads + a pandas DataFrame of steps + to_parquet;
(ours) `offline_agent.ingest.ingest`, with its fast OpenAI-chat path and, for comparison, with
`engine="python"` (the reference adapters only). Each contender runs `--repeats` times (default
3) and keeps its fastest run, the usual estimate of a timing on a noisy machine. Targets: ours
within 3x of the floor, at least 3x faster than naive, peak RSS under 1 GB.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, write_result  # noqa: E402

TOOLS = ["inspect_logs", "retry_stage", "rollback", "patch_schema", "restart", "query_inventory", "move", "deliver"]


def generate(path: Path, steps: int, seed: int = 0) -> int:
    """Write chat records of 5-15 tool calls each until `steps` steps; returns the number of records."""
    rng = random.Random(seed)
    written = records = 0
    with open(path, "w") as f:
        while written < steps:
            n = min(rng.randint(5, 15), steps - written)
            messages = [{"role": "system", "content": "Repair the nightly pipeline."},
                        {"role": "user", "content": f"Job {records} failed at stage {rng.randint(1, 9)}."}]
            for i in range(n):
                tool = rng.choice(TOOLS)
                args = json.dumps({"stage": rng.randint(1, 9), "attempt": i, "reason": "timeout" * rng.randint(1, 3)})
                messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{i}", "type": "function", "function": {"name": tool, "arguments": args}}]})
                messages.append({"role": "tool", "tool_call_id": f"call_{i}", "name": tool,
                                 "content": f"stage {i} status: {'ok' if rng.random() < 0.8 else 'Error: timeout'}"
                                 + " log line" * rng.randint(2, 12)})
            f.write(json.dumps({"episode_id": f"job-{records}", "messages": messages,
                                "reward": float(rng.random() < 0.4)}) + "\n")
            written += n
            records += 1
    return records


def run_floor(path: str) -> None:
    import orjson

    with open(path, "rb") as f:
        for line in f:
            orjson.loads(line)


def run_naive(path: str, out: str) -> None:
    import pandas as pd

    rows = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            step, observation = 0, ""
            for m in record["messages"]:
                if m["role"] == "assistant":
                    for c in m["tool_calls"]:
                        rows.append({"episode_id": record["episode_id"], "step": step, "observation": observation,
                                     "action": json.dumps({"name": c["function"]["name"],
                                                           "arguments": json.loads(c["function"]["arguments"])},
                                                          sort_keys=True)})
                        step += 1
                elif m["role"] in ("tool", "user"):
                    observation = m["content"]
    pd.DataFrame(rows).to_parquet(out)


def run_ours(path: str, out: str, engine: str = "auto") -> None:
    from offline_agent.ingest import ingest

    ingest([path], out, overwrite=True, engine=engine)


def _child(which: str, *args: str) -> None:
    """Run one contender after its imports are done, print seconds and this process's peak RSS (MB)."""
    fn = globals()[f"run_{which}"]
    if which == "ours":
        import offline_agent.ingest  # noqa: F401  (imports are start-up cost, not ingestion)
    elif which == "naive":
        import pandas  # noqa: F401
    start = time.perf_counter()
    fn(*args)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "worker_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))


def measure(which: str, *args: str, repeats: int = 1) -> tuple[float, float]:
    """Seconds (the best of `repeats` runs) and peak RSS (MB, the largest) of one contender, each run in a
    fresh process so the peak is its own.

    The peak counts worker processes too, as an upper bound: the process's own peak plus, for each
    worker, the largest worker's peak (workers are the process's children, reaped before it reports).
    """
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
            "from benchmarks.ingest import _child; _child(*sys.argv[1:])")
    from offline_agent.ingest.parallel import default_workers  # here: the contenders' processes import it not

    seconds, peak = [], []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", code, which, *args], check=True, capture_output=True, text=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        workers = default_workers() if which == "ours" and result["worker_peak_mb"] > 0 else 0
        seconds.append(result["seconds"])
        peak.append(result["peak_mb"] + workers * result["worker_peak_mb"])
    return min(seconds), max(peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender; the table keeps the fastest")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp) / "logs.jsonl"
        records = generate(logs, args.steps)
        size_mb = logs.stat().st_size / 1e6
        results = {}
        for key, which, extra in (("floor", "floor", []), ("ours", "ours", [str(Path(tmp) / "ds")]),
                                  ("reference", "ours", [str(Path(tmp) / "ref"), "python"]),
                                  ("naive", "naive", [str(Path(tmp) / "n.pq")])):
            results[key] = measure(which, str(logs), *extra, repeats=args.repeats)
    floor = results["floor"][0]
    rows = [
        [name, f"{sec:.1f}", f"{args.steps / sec:,.0f}", f"{sec / floor:.2f}x", f"{mb:,.0f}"]
        for name, (sec, mb) in (("orjson parse only (floor)", results["floor"]),
                                ("offline-agent ingest", results["ours"]),
                                ("offline-agent ingest --engine python (reference adapters)", results["reference"]),
                                ("naive json + pandas + to_parquet", results["naive"]))
    ]
    ours, naive = results["ours"][0], results["naive"][0]
    verdict = (f"ours/floor = {ours / floor:.2f}x (target <= 3x), naive/ours = {naive / ours:.2f}x (target >= 3x), "
               f"peak RSS {results['ours'][1]:,.0f} MB with its workers (target < 1,024 MB)")
    table = markdown_table(["contender", "seconds", "steps/s", "vs floor", "peak RSS MB"], rows)
    write_result("ingest", f"Ingestion: {args.steps:,} steps in {records:,} OpenAI-chat records ({size_mb:,.0f} MB)",
                 table + f"\n\n{verdict}. Seconds: the fastest of {args.repeats} runs of each contender, each in "
                 "a fresh process (the machine's run-to-run noise is about 5%). Peak RSS is the maximum resident "
                 "set size of the whole interpreter; for our ingest, plus that of the largest worker process once "
                 "per worker (an upper bound).",
                 f"python benchmarks/ingest.py --steps {args.steps} --repeats {args.repeats}")


if __name__ == "__main__":
    main()
