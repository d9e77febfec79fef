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


CODE_LOCK_SPEC = "learn_envs:make_code_lock"


def enter(code: str) -> dict[str, Any]:
    return {"name": "enter_code", "arguments": {"code": code}}


class CodeLock(gym.Env):
    """Type the code each keypad shows: the right call is the one whose argument occurs in the observation.

    Every keypad shows a fresh random 4-digit code and offers four `enter_code` calls, the right one and
    three made-up codes, in a random order; so a policy must check the call's value against the text,
    which a sentence embedding of each carries poorly and grounding (`offline_agent.learn.grounding`)
    states exactly. A wrong code is an error observation and the keypad stays.
    """

    metadata = {"render_modes": []}

    def __init__(self, keypads: int = 2, max_steps: int = 4):
        self.keypads, self.max_steps = keypads, max_steps
        self.observation_space = observation_space()
        self.action_space = spaces.Discrete(4)
        self.task = "Open the doors: at each keypad, enter the code it shows."

    def _code(self) -> str:
        return f"{int(self.np_random.integers(1000, 10000))}"

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps, self.keypad = 0, 0
        self.codes = [self._code() for _ in range(self.keypads)]
        self._offer()
        return self._obs(f"Keypad 1 of {self.keypads} shows code {self.codes[0]}."), {"task": self.task}

    def _offer(self) -> None:
        right = self.codes[self.keypad]
        wrong: list[str] = []
        while len(wrong) < 3:
            code = self._code()
            if code != right and code not in wrong:
                wrong.append(code)
        calls = [enter(right), *(enter(c) for c in wrong)]
        self.candidates = tuple(calls[int(i)] for i in self.np_random.permutation(4))

    def _obs(self, text: str) -> dict[str, Any]:
        return {"text": text, "candidates": self.candidates}

    def expert_action(self) -> int:
        return self.candidates.index(enter(self.codes[self.keypad]))

    def step(self, action):
        self.steps += 1
        code = self.candidates[int(action)]["arguments"]["code"]
        info = {"success": False, "is_error": False}
        if code == self.codes[self.keypad]:
            self.keypad += 1
            if self.keypad == self.keypads:
                self.candidates = ()
                return self._obs("The last door opens."), 1.0, True, False, {**info, "success": True}
            text = f"A door opens. Keypad {self.keypad + 1} of {self.keypads} shows code {self.codes[self.keypad]}."
        else:
            info["is_error"] = True
            text = f"ERROR wrong code {code}. Keypad {self.keypad + 1} still shows code {self.codes[self.keypad]}."
        self._offer()
        return self._obs(text), 0.0, False, self.steps >= self.max_steps, info


def make_code_lock(**kwargs: Any) -> CodeLock:
    return CodeLock(**kwargs)
