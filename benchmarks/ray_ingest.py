"""Ingestion on Ray against the local engine, on this machine: `ingest(backend="ray")` with a local Ray.

The same OpenAI-chat JSONL file as benchmarks/ingest.py (default 1,000,000 steps) is ingested, each run in a
fresh process: (local) `ingest(...)`, its worker processes started by the call; (ray) a local Ray with one
CPU per core is started through `ray_session`, as `ingest(backend="ray")` starts it, and its start-up (the
`ray.init`, then until a worker process is up on every CPU) and shut-down are timed apart; on it, one ingest
(its workers' first: they import the adapters) and a second one (a long-lived Ray or cluster); (ray_cold) one
`ingest(backend="ray")` with no Ray running, which starts and stops its own, start-up included. Each runs
`--repeats` times (default 3) and keeps its fastest run. Target: Ray within 1.3x of local.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.ingest import generate  # noqa: E402

TARGET = 1.3
NAP = 0.1  # seconds a start-up probe task holds its worker, so that each CPU gets its own


def run_local(path: str, out: str) -> dict[str, float]:
    from offline_agent.ingest import ingest

    start = time.perf_counter()
    ingest([path], out, overwrite=True)
    return {"ingest": time.perf_counter() - start}


def run_ray(path: str, out: str) -> dict[str, float]:
    from offline_agent.ingest import ingest
    from offline_agent.ray_backend import ray_session

    seconds = {}
    start = time.perf_counter()
    with ray_session(None) as ray:
        seconds["start"] = time.perf_counter() - start
        start = time.perf_counter()
        cpus = int(ray.cluster_resources()["CPU"])
        ray.get([ray.remote(_nap).remote() for _ in range(cpus)])  # tasks at once: one worker per CPU is up
        seconds["workers_up"] = time.perf_counter() - start - NAP
        for key in ("ingest", "ingest_warm"):
            start = time.perf_counter()
            ingest([path], out, overwrite=True, backend="ray")
            seconds[key] = time.perf_counter() - start
        start = time.perf_counter()
    seconds["shutdown"] = time.perf_counter() - start
    return seconds


def _nap() -> None:
    time.sleep(NAP)


def run_ray_cold(path: str, out: str) -> dict[str, float]:
    """One `ingest(backend="ray")` with no Ray running: it starts a local Ray and stops it again."""
    from offline_agent.ingest import ingest

    start = time.perf_counter()
    ingest([path], out, overwrite=True, backend="ray")
    return {"ingest": time.perf_counter() - start}


def _child(which: str, *args: str) -> None:
    """Run one contender after its imports are done (start-up cost, not ingestion); print its seconds."""
    import offline_agent.ingest  # noqa: F401

    if which.startswith("ray"):
        import ray  # noqa: F401
    print(json.dumps(globals()[f"run_{which}"](*args)))


def run_child(which: str, *args: str) -> dict[str, float]:
    """One run of one contender in a fresh process."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
            "from benchmarks.ray_ingest import _child; _child(*sys.argv[1:])")
    # No usage report, and no token written to ~/.ray: the settings the tests' local Ray runs with.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run([sys.executable, "-c", code, which, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{which} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(logs: Path, folder: Path, repeats: int) -> dict[str, dict[str, float]]:
    """Each contender's timings, each the fastest of `repeats` runs. The contenders take turns, so that a
    busy spell of the machine weighs on all of them alike."""
    runs: dict[str, list[dict[str, float]]] = {"local": [], "ray": [], "ray_cold": []}
    for _ in range(repeats):
        for which, seconds in runs.items():
            seconds.append(run_child(which, str(logs), str(folder / which)))
    return {which: {key: min(run[key] for run in seconds) for key in seconds[0]} for which, seconds in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender; the table keeps the fastest")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp) / "logs.jsonl"
        records = generate(logs, args.steps)
        size_mb = logs.stat().st_size / 1e6
        load_before = os.getloadavg()[0]
        best = measure(logs, Path(tmp), args.repeats)
        load_after = os.getloadavg()[0]
    local, ray, cold = best["local"], best["ray"], best["ray_cold"]["ingest"]
    base = local["ingest"]
    rows = [
        ["local engine (worker processes)", f"{base:.2f}", f"{args.steps / base:,.0f}", "1.00x"],
        ["ray: first ingest on a Ray just started (workers up, adapters not yet imported)", f"{ray['ingest']:.2f}",
         f"{args.steps / ray['ingest']:,.0f}", f"{ray['ingest'] / base:.2f}x"],
        ["ray: second ingest, same Ray (a long-lived Ray or cluster)", f"{ray['ingest_warm']:.2f}",
         f"{args.steps / ray['ingest_warm']:,.0f}", f"{ray['ingest_warm'] / base:.2f}x"],
        ["ray start-up: `ray.init` of a local Ray (not in the rows above)", f"{ray['start']:.2f}", "", ""],
        ["ray start-up: then until every CPU's worker process is up (not in the rows above)",
         f"{ray['workers_up']:.2f}", "", ""],
        ["ray shut-down (not in the rows above)", f"{ray['shutdown']:.2f}", "", ""],
        ["ray end to end: one `ingest(backend=\"ray\")` that starts and stops its local Ray", f"{cold:.2f}",
         f"{args.steps / cold:,.0f}", f"{cold / base:.2f}x"],
    ]
    ratio = ray["ingest"] / base
    verdict = (f"ray/local = {ratio:.2f}x for the ingest on a started Ray (target <= {TARGET}x: "
               f"{'met' if ratio <= TARGET else 'missed'}), {ray['ingest_warm'] / base:.2f}x once its workers have "
               f"ingested before; starting a local Ray and its workers adds {ray['start'] + ray['workers_up']:.1f} s "
               f"and stopping it {ray['shutdown']:.1f} s, paid by every `ingest --backend ray` without --ray-address "
               f"({cold / base:.1f}x local end to end)")
    table = markdown_table(["run", "seconds", "steps/s", "vs local"], rows)
    write_result(
        "ray_ingest",
        f"Ingestion on a local Ray: {args.steps:,} steps in {records:,} OpenAI-chat records ({size_mb:,.0f} MB)",
        table + f"\n\n{verdict}. Seconds: the fastest of {args.repeats} runs, each in a fresh process, the contenders "
        "taking turns; the local Ray has one CPU per core, as `ingest --backend ray` starts it. Load average "
        f"(1 min) {load_before:.1f} before and {load_after:.1f} after (the runs' own processes count in it; above "
        f"the {os.cpu_count()} cores, other work shared the machine).",
        f"python benchmarks/ray_ingest.py --steps {args.steps} --repeats {args.repeats}",
    )


if __name__ == "__main__":
    main()
