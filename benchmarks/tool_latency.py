"""Simulators whose steps cost time, as a real agent's tools do, for `benchmarks/ray_scale.py`.

A built-in simulator steps in ~25 microseconds; a real tool call (an HTTP API, a sandboxed shell, a database
query) takes tens to hundreds of milliseconds. These factories wrap PipelineRepair-v0 so that each step
also waits (`sleep`: a call to a service elsewhere, which takes no CPU here) or computes (`busy`: work done
on this machine, like running a test suite in a local sandbox) for a fixed time. The episodes are the
simulator's own: only the time changes.

Spec strings, importable by Ray workers with the repository on their path:
`benchmarks.tool_latency:sleep_50ms`, `benchmarks.tool_latency:busy_20ms`.
"""

from __future__ import annotations

import time

import gymnasium as gym

ENV = "offline_agent/PipelineRepair-v0"


class ToolLatency(gym.Wrapper):
    """Each step takes `seconds` more: asleep (`busy=False`) or computing on one core (`busy=True`)."""

    def __init__(self, env: gym.Env, seconds: float, busy: bool):
        super().__init__(env)
        self.seconds = seconds
        self.busy = busy

    def step(self, action):  # noqa: ANN001, ANN201 (gymnasium's signature)
        if self.busy:
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(self.seconds)
        return self.env.step(action)


def _pipeline(seconds: float, busy: bool) -> gym.Env:
    import offline_agent.envs  # noqa: F401  (registers the built-in simulators)

    return ToolLatency(gym.make(ENV), seconds, busy)


def sleep_50ms() -> gym.Env:
    return _pipeline(0.050, busy=False)


def busy_20ms() -> gym.Env:
    return _pipeline(0.020, busy=True)
