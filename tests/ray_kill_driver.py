"""`python -m tests.ray_kill_driver LOGS OUT RAY_FOLDER`, from the repository: ingest LOGS into OUT on a Ray
of this process's own while the first worker seen running a `process_chunk` task is SIGKILLed; prints one JSON
line (the killed worker, the steps written, whether the counts reconcile).

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


def main(logs: str, out: str, ray_folder: str) -> None:
    from offline_agent.ingest import ingest, parallel
    from offline_agent.ray_backend import WORKER_ENV
    from tests.helpers import start_test_ray

    parallel.CHUNK_BYTES = 1 << 20  # ranges of ~4,000 steps, each a few tenths of a second of a worker's time
    # "local": a Ray of its own, even where another one (the test session's) runs on this machine.
    ray = start_test_ray(ray_folder, address="local", runtime_env={"env_vars": WORKER_ENV})
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
