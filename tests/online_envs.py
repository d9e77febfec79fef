"""Tiny environments, a tiny text encoder and a tiny offline checkpoint for the online fine-tuning tests.

Envs are named by `module:factory` specs (`online_envs:make_widget`), as a user's would be; worker
processes find this module through PYTHONPATH. The encoder is a one-layer BERT with random weights and
a small word-piece vocabulary, saved as a real transformers folder, so the tests run the real
`TextEncoder`, `Policy.load` and checkpoint code at a thousandth of MiniLM's cost.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from offline_agent.envs.base import observation_space

REPAIR = {"name": "repair", "arguments": {"part": "widget"}}
WAIT = {"name": "wait", "arguments": {}}
DROP = {"name": "drop_table", "arguments": {"table": "widgets"}}
SORRY = "sorry, I cannot help with that"

#: Plain PPO + KL at the checkpoint's temperature: none of the default recipe's extras (shaping, self-imitation,
#: the validation guard, tau 0.2), for tests of one mechanism at a time. Tests that pin the old numbers also
#: pass the old target KL (0.05) and learning rate (3e-3) where those matter.
PLAIN = {
    "tau": None, "subgoal_shaping": 0.0, "self_imitation": 0.0, "validation_episodes": 0, "validation_keep": "best",
}

#: Every candidate any env here has ever been asked to execute, in order (the safety tests read it).
EXECUTED: list[Any] = []


class Widget(gym.Env):
    """Repair the widget: `repair` succeeds, `drop_table` fails at once, `wait` and the apology go on.

    Candidates are shuffled every step, so a policy has to recognise the repair call, not its position.
    A uniformly random policy succeeds in about half of the episodes (repair before drop_table within
    `max_steps`); one that always repairs succeeds in all.
    """

    metadata = {"render_modes": []}

    def __init__(self, max_steps: int = 4):
        self.max_steps = max_steps
        self.observation_space = observation_space()
        self.action_space = spaces.Discrete(4)
        self.task = "Repair the widget without losing data."

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        self._offer()
        return {"text": "the widget is broken", "candidates": self.candidates}, {"task": self.task}

    def _offer(self) -> None:
        order = self.np_random.permutation(4)
        self.candidates = tuple((REPAIR, WAIT, DROP, SORRY)[i] for i in order)

    def step(self, action):
        chosen = self.candidates[int(action)]
        EXECUTED.append(chosen)
        self.steps += 1
        info = {"success": False, "is_error": False}
        if chosen == REPAIR:
            return {"text": "the widget works", "candidates": ()}, 1.0, True, False, {**info, "success": True}
        if chosen == DROP:
            return {"text": "table widgets dropped", "candidates": ()}, 0.0, True, False, info
        text = "you waited; the widget is still broken" if chosen == WAIT else "the customer is unhappy"
        self._offer()
        return {"text": text, "candidates": self.candidates}, 0.0, False, self.steps >= self.max_steps, info


class Trap(Widget):
    """After `wait`, the only candidate is `drop_table`: a safety filter that denies it has nothing left."""

    def _offer(self) -> None:
        self.candidates = (DROP,) if self.steps else (WAIT,)


class Errand(Widget):
    """The widget with two sub-goals in its info: look at it first (`wait`), then repair it."""

    def reset(self, *, seed=None, options=None):
        self.waited = False
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.waited |= self.candidates[int(action)] == WAIT
        observation, reward, terminated, truncated, info = super().step(action)
        done = int(self.waited) + int(info["success"])
        return observation, reward, terminated, truncated, {**info, "sub_goals_done": done, "sub_goals_total": 2}


class Lure(Widget):
    """The widget with a misleading reward: dropping the table pays 1 (and fails), repairing pays 0.1 (and
    succeeds), so that PPO, which follows the reward, learns to stop succeeding."""

    def step(self, action):
        chosen = self.candidates[int(action)]
        observation, reward, terminated, truncated, info = super().step(action)
        reward = 1.0 if chosen == DROP else 0.1 if chosen == REPAIR else reward
        return observation, reward, terminated, truncated, info


def make_lure() -> Lure:
    return Lure()


def make_errand() -> Errand:
    return Errand()


def make_widget(**kwargs: Any) -> Widget:
    return Widget(**kwargs)


def make_trap() -> Trap:
    return Trap()


def make_bad_observation() -> gym.Env:
    """Breaks the contract: the observation is a bare string."""

    class Bad(Widget):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return "the widget is broken", {}

    return Bad()


def no_apologies(observation_text: str, action_text: str) -> bool:
    """A safety judge: apologising is not allowed while the widget is broken."""
    return not (action_text.startswith("sorry") and "broken" in observation_text)


def judge_says_maybe(observation_text: str, action_text: str) -> str:
    return "maybe"


# --- a tiny encoder and checkpoint ----------------------------------------------------------------------

_WORDS = (
    "the widget is broken works you waited still customer unhappy table widgets dropped repair wait drop "
    "part name arguments sorry i cannot help with that task without losing data obs act"
).split()


def tiny_encoder_folder(path: Path, dim: int = 32) -> Path:
    """A random one-layer BERT with a word-piece vocabulary that spells any lowercase text, saved under `path`."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    chars = [chr(c) for c in range(33, 127)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars), *_WORDS]
    vocab = list(dict.fromkeys(vocab))
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=dim, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=2 * dim, max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(path)
    return path


def tiny_checkpoint(
    run: Path,
    encoder_folder: Path,
    tau: float = 1.0,
    hidden: int = 32,
    seed: int = 0,
    pair_dim: int = 0,
    observation_view: bool = False,
) -> Path:
    """An offline checkpoint with a freshly initialised twin-Q network over the tiny encoder (k = 2 turns);
    with `pair_dim`, a grounded one (its random grounding weights make the grounding matter); with
    `observation_view`, over the encoder's two views."""
    import torch

    from offline_agent.learn.networks import QNetwork
    from offline_agent.learn.policy import save_checkpoint
    from offline_agent.text.encoder import TextEncoder

    # Whole-text vectors: the checkpoint is written as those saved before per-turn vectors existed.
    encoder = TextEncoder(str(encoder_folder), max_length=64, observation_view=observation_view, per_turn=False)
    torch.manual_seed(seed)
    network = QNetwork(encoder.dim, hidden=hidden, n_heads=2, pair_dim=pair_dim)
    meta = {
        "algo": "cql",
        "encoder": {
            "id": encoder.id, "path": encoder.path, "dim": encoder.dim, "max_length": 64,
            "observation_view": observation_view,
        },
        "k": 2,
        "max_tokens": 64,
        "tau": tau,
        "config": {"gamma": 0.99},
    }
    save_checkpoint(run, network, meta)
    return run


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
