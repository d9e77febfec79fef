"""`python tests/ray_kill_driver.py LOGS OUT RAY_TEMP`: ingest LOGS into OUT on a Ray of this process's own while
the first worker seen running a `process_chunk` task is SIGKILLed; prints one JSON line (the killed worker,
the steps written, whether the counts reconcile).

test_ingest_ray runs it as a separate process, not on the test session's Ray: killing a worker is chaos, and
were Ray's own processes not to survive it, a Ray driver exits on the spot (exit status 1, no traceback). Here
that ends this process, and the test fails saying so with Ray's logs, instead of ending the whole test run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time


def _parent_pid() -> int:
    return os.getppid()


def kill_first_chunk_task(raylet: int, stop: threading.Event, killed: list[str]) -> None:
    """SIGKILL the first worker of this Ray (a child of its raylet) seen running `process_chunk`: its title is
    then `ray::process_chunk`."""
    import psutil

    while not stop.is_set():
        for proc in psutil.Process(raylet).children():
            try:
                title = " ".join(proc.cmdline())
                if title.startswith("ray::process_chunk"):
                    proc.send_signal(signal.SIGKILL)
                    killed.append(f"{proc.pid} {title.strip()}")
                    return
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.002)


def main(logs: str, out: str, ray_temp: str) -> None:
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    from offline_agent.ingest import ingest, parallel
    from offline_agent.ray_backend import WORKER_ENV

    parallel.CHUNK_BYTES = 1 << 20  # ranges of ~4,000 steps, each a few tenths of a second of a worker's time
    # "local": a Ray of its own, even where another one (the test session's) runs on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=ray_temp,
             object_store_memory=200 << 20, runtime_env={"env_vars": WORKER_ENV}, configure_logging=False)
    try:
        raylet = ray.get(ray.remote(_parent_pid).remote())  # Ray's workers are its raylet's children
        stop, killed = threading.Event(), []
        killer = threading.Thread(target=kill_first_chunk_task, args=(raylet, stop, killed))
        killer.start()
        try:
            summary = ingest([logs], out, engine="python", backend="ray")
        finally:
            stop.set()
            killer.join()
    finally:
        ray.shutdown()
    print(json.dumps({"killed": killed, "steps": summary.total("steps"), "reconciles": summary.reconciles}))


if __name__ == "__main__":
    main(*sys.argv[1:])
