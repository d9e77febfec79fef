"""A tiny environment for the offline-learner tests, named by the spec `learn_envs:make_color_lock`.

`ColorLock`: open a lock of 3 panels by pressing, at each panel, the button of the colour it shows. The
four `press` tool calls come in a new order every step, so a policy has to read the colour, not learn a
position. A wrong button is an error observation and the panel stays, so recovery can be measured; the
episode is truncated after `max_steps`. A uniformly random policy succeeds in about 17% of episodes, the
expert in all; `noisy:0.7` (the expert 30% of the time, else random) in about half.

With k = 0 turns of history the state texts are a few dozen, cheap to embed with the real MiniLM.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from gymnasium import spaces

from offline_agent.envs.base import observation_space

COLORS = ("red", "green", "blue", "yellow")
SPEC = "learn_envs:make_color_lock"


def press(color: str) -> dict[str, Any]:
    return {"name": "press", "arguments": {"color": color}}


class ColorLock(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, panels: int = 3, max_steps: int = 6):
        self.panels, self.max_steps = panels, max_steps
        self.observation_space = observation_space()
        self.action_space = spaces.Discrete(len(COLORS))
        self.task = "Open the lock: at each panel, press the button of the colour the panel shows."

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps, self.panel = 0, 0
        self.colors = [COLORS[int(i)] for i in self.np_random.integers(len(COLORS), size=self.panels)]
        self._offer()
        return self._obs(f"Panel 1 of {self.panels} shows {self.colors[0].upper()}."), {"task": self.task}

    def _offer(self) -> None:
        self.candidates = tuple(press(COLORS[int(i)]) for i in self.np_random.permutation(len(COLORS)))

    def _obs(self, text: str) -> dict[str, Any]:
        return {"text": text, "candidates": self.candidates}

    def expert_action(self) -> int:
        return self.candidates.index(press(self.colors[self.panel]))

    def step(self, action):
        self.steps += 1
        chosen = self.candidates[int(action)]["arguments"]["color"]
        info = {"success": False, "is_error": False}
        if chosen == self.colors[self.panel]:
            self.panel += 1
            if self.panel == self.panels:
                self.candidates = ()
                return self._obs("The lock opens."), 1.0, True, False, {**info, "success": True}
            text = f"Click. Panel {self.panel + 1} of {self.panels} shows {self.colors[self.panel].upper()}."
        else:
            info["is_error"] = True
            text = (
                f"ERROR wrong button, the lock buzzes. Panel {self.panel + 1} of {self.panels} still shows "
                f"{self.colors[self.panel].upper()}."
            )
        self._offer()
        return self._obs(text), 0.0, False, self.steps >= self.max_steps, info


def make_color_lock(**kwargs: Any) -> ColorLock:
    return ColorLock(**kwargs)
