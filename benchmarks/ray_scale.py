"""Scaling out on Ray: rollout env steps/s by number of Ray actors against the local backend.

The rollouts are fine-tuning's (`PPOTrainer.collect_rollout`: the learner renders, encodes and scores every
environment's state, then steps all environments), with the CQL policy of the online benchmark's offline
stage, 8 environments, 2 torch threads, fp32, a cold text-embedding memo (a new trainer per setting), on three
kinds of environment:

- PipelineRepair-v0 as it is: a step costs ~25 us, so the learner's encoder is all of a rollout's time;
- `benchmarks.tool_latency:sleep_50ms`: the same episodes, each step waiting 50 ms as a call to a tool
  elsewhere would (an API, a remote sandbox);
- `benchmarks.tool_latency:busy_20ms`: each step computing for 20 ms on this machine (a local sandbox).

Local: the sync vector env, every environment stepped one after the other in the learner's process (one
process). Ray: `RayVectorEnv` on a local Ray started here with this machine's CPUs, 1, 2, 4 and 8 actors.
Ray's start-up is timed on its own and not in the rates. Writes benchmarks/results/ray_scale.md.
A few minutes on 2 cores; the timings assume nothing else runs: `python benchmarks/ray_scale.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.rollout_speed import cql_run, rollout_rate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENVS = {
    "PipelineRepair-v0 (~25 us a step)": "offline_agent/PipelineRepair-v0",
    "+ 50 ms tool wait a step": "benchmarks.tool_latency:sleep_50ms",
    "+ 20 ms of CPU a step": "benchmarks.tool_latency:busy_20ms",
}
ACTORS = (1, 2, 4, 8)


def start_ray() -> tuple[float, str]:
    """Start a local Ray with this machine's CPUs (the repository on the workers' path, for the latency envs):
    (seconds it took, its session folder)."""
    import ray

    from offline_agent.ray_backend import WORKER_ENV

    folder = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 characters
    start = time.perf_counter()
    ray.init(include_dashboard=False, _temp_dir=folder, configure_logging=False,
             runtime_env={"env_vars": {**WORKER_ENV, "PYTHONPATH": str(REPO)}})
    return time.perf_counter() - start, folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", default=str(REPO / "benchmarks" / "out" / "rollout_speed"),
                        help="where the offline stage (ingested logs, CQL run) is kept (shared with rollout_speed)")
    parser.add_argument("--cql-steps", type=int, default=1000, help="CQL gradient steps of the offline stage")
    parser.add_argument("--steps", type=int, default=256, help="env steps timed per setting")
    parser.add_argument("--envs", type=int, default=8, help="environments per rollout")
    parser.add_argument("--threads", type=int, default=2, help="the learner's torch threads")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()

    import shutil

    import ray

    run = cql_run(Path(args.cache), args.cql_steps, args.threads)
    started, folder = start_ray()
    cpus = int(ray.cluster_resources().get("CPU", 0))
    print(f"local Ray with {cpus} CPUs started in {started:.1f} s", flush=True)
    rows = []
    try:
        for name, env in ENVS.items():
            local, _ = rollout_rate(run, env, args.envs, args.steps, args.threads)
            rates = [rollout_rate(run, env, args.envs, args.steps, args.threads, ray_actors=a)[0] for a in ACTORS]
            best = max(rates)
            rows.append([name, f"{local:.1f}", *(f"{r:.1f}" for r in rates), f"{best / local:.2f}x"])
            print(f"{name}: local {local:.1f}, Ray {', '.join(f'{r:.1f}' for r in rates)} env steps/s", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    header = ["environment", "local, 1 process", *(f"Ray, {a} actor{'s' * (a > 1)}" for a in ACTORS),
              "best Ray / local"]
    table = markdown_table(header, rows) + "\n\n" + note(args, cpus, started)
    command = "python benchmarks/ray_scale.py " + " ".join(sys.argv[1:])
    if args.no_write:
        print(table)
    else:
        write_result("ray_scale", "Rollouts on Ray: env steps/s by number of actors", table, command.strip())


def note(args: argparse.Namespace, cpus: int, started: float) -> str:
    return (
        f"Env steps/s of fine-tuning rollouts ({args.steps} env steps per setting, {args.envs} environments, the "
        f"online benchmark's CQL policy on PipelineRepair, {args.threads} torch threads, fp32, a cold memo). "
        f"Local: the sync vector env in the learner's process. Ray: `RayVectorEnv` on a local Ray of {cpus} CPUs "
        f"(started in {started:.1f} s, not counted), the environments spread over the actors; the learner still "
        "encodes every state, so on the bare simulator Ray can only add its round trips."
    )


if __name__ == "__main__":
    main()
