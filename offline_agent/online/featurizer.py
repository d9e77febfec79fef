"""From the observations of N environments to tensors, rendered exactly as the offline policy renders states.

Each environment's episode history (task, turns) renders its state text; the state and the candidate texts
are embedded through a bounded text -> vector memo, since candidate texts and early states repeat a lot and
the encoder is the slowest thing in a rollout.

The memo is part of a run's resume state. The new texts of a step (every environment's state, new
candidates) are embedded in one padded batch, and a text's vector depends by ~1e-7 on which texts were new
with it (padding changes the kernels' shapes), that is on what the run's text -> vector memo held; so the
memo (`Featurizer.memo`, bounded) is saved with each checkpoint and restored on resume, and the resumed run
meets the very vectors and the same batches. (Encoding each text alone, as rollouts did before, kept the
vectors independent of the memo. In fp32 on CPU the batch gains little, 0-15% at 8 environments, since one
~200-token text already fills the matrix products; a bf16 encoder gains ~1.8x:
benchmarks/results/rollout_speed.md.)

Dimension letters: N environments, C candidate slots, D embedding width, P grounding features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from offline_agent.actions import canonical_action
from offline_agent.errors import UserError
from offline_agent.learn.grounding import grounding_batch


class Featurizer:
    """Observations of N environments as tensors, rendered exactly as the offline policy renders states.

    Keeps each environment's episode history (task, turns) and the text -> vector memo
    (`offline_agent.text.cache.EmbeddingMemo`), part of a run's resume state (see the module docstring).
    """

    def __init__(self, reference: Any, num_envs: int, max_candidates: int):
        from offline_agent.learn.policy import EpisodeHistory
        from offline_agent.text.cache import EmbeddingMemo

        self.reference = reference
        self.histories = [EpisodeHistory() for _ in range(num_envs)]
        self.max_candidates = max_candidates
        self.dim = int(reference.encoder.dim)
        self.grounded = bool(getattr(reference.network, "pair_dim", 0))  # the policy reads each pair's grounding
        self.memo = reference.seed_memo(EmbeddingMemo(reference.encoder))  # the checkpoint's known texts

    @property
    def encoded(self) -> int:
        """Texts encoded by this process (a resumed run's memo arrives filled)."""
        return self.memo.misses

    def start(self, env: int, task: str | None) -> None:
        from offline_agent.learn.policy import EpisodeHistory

        self.histories[env] = EpisodeHistory(task)

    def record(self, env: int, observation_text: str, action_text: str) -> None:
        self.histories[env].turns.append((observation_text, action_text))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), D) float32; the texts new to the memo are encoded in one call (one padded batch)."""
        return self.memo.embed(texts)

    def tensors(self, observations: Sequence[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
        """state (N, D), cands (N, C, D), mask (N, C) and pair (N, C, P) (None unless the policy is grounded)
        of N observations; candidate texts in `self.last_actions`."""
        states = [self.reference.render(h, o["text"]) for h, o in zip(self.histories, observations, strict=True)]
        self.last_actions = [[canonical_action(c) for c in o["candidates"]] for o in observations]
        lengths = [len(c) for c in self.last_actions]
        if max(lengths) > self.max_candidates:
            raise UserError(
                f"an observation offered {max(lengths)} candidates, more than the action space's "
                f"{self.max_candidates}: the environment breaks its contract"
            )
        vectors = torch.from_numpy(self.embed(states + [t for c in self.last_actions for t in c]))
        state = vectors[: len(states)]  # (N, D)
        cands = torch.zeros(len(states), self.max_candidates, self.dim)  # (N, C, D)
        mask = torch.zeros(len(states), self.max_candidates, dtype=torch.bool)  # (N, C)
        offset = len(states)
        for i, n in enumerate(lengths):
            cands[i, :n] = vectors[offset : offset + n]
            mask[i, :n] = True
            offset += n
        pair = None
        if self.grounded:
            taken = [h.actions() for h in self.histories]
            pair = grounding_batch(states, self.last_actions, self.max_candidates, taken)  # (N, C, P)
        return state, cands, mask, pair
