"""Keep the best policy of a fine-tuning run, chosen by its greedy success on held-out validation episodes.

The greedy policy that PPO produces is not monotone in the iterations: from the 800-episode CQL start on
Logistics it went 0.74 -> 0.60 -> 0.52 in its first two iterations and then up to 0.98, and between
neighbouring late iterations it swings by up to 10 points. A team deploys one policy, so the run keeps
the one it can stand behind: after every iteration the current policy plays `episodes` greedy episodes
on fixed validation seeds (the same seeds every time), and the run keeps one of the validated policies
by one of two rules (`KEEP_RULES`):

- "best": the policy that succeeded most often (a tie to the later one). It never keeps a policy that
  did worse than the offline one, but it is the best of many noisy scores: on 64 episodes, policies 5-10
  points apart cannot be told apart, and the maximum of 25 such scores is more often a lucky policy than
  the best one (the 800-episode runs kept policies that evaluated 4-8 points under the last ones).
- "guard": the latest policy that succeeded at least as often as the offline policy; the offline policy
  until one does. Each policy is compared with one fixed score, not with the best of the others, so the
  early dip is guarded against without the winner's curse, and once fine-tuning has passed the offline
  policy the run keeps what it trained last.

Iteration 0, the offline policy itself, is validated first: under either rule the kept policy is never
one that did worse than the offline policy on these episodes.

Training itself goes on from the current parameters either way: the selection only decides what is saved
as the run's policy. Validation episodes are environment steps too: they are counted apart
(`validation/env_steps`), so that a comparison per env step can include them.

Seeds: episode i uses `episode_seed(seed, i)`, seed 2000 by default; evaluations start at seed 0
(`offline-agent evaluate`) or 1000 (the benchmarks) and training rollouts draw 32-bit seeds from a
SeedSequence, so the three do not share tasks.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from offline_agent.online.play import rollout_policy
from offline_agent.text.cache import EmbeddingMemo

#: Where validation episodes start by default (`episode_seed(VALIDATION_SEED, i)`).
VALIDATION_SEED = 2000

#: How a run chooses the policy it keeps (see the module docstring).
KEEP_RULES = ("best", "guard")


def improves(successes: int, bar: int) -> bool:
    """Does a policy with `successes` on the validation episodes replace the kept one, given the `bar` it
    must reach? At least as many: on a tie the later policy, which has trained on more of the environment,
    is kept."""
    return successes >= bar


def bar_to_keep(keep: str, kept_successes: int, offline_successes: int | None) -> int:
    """The validation successes the next policy needs to be kept: the kept policy's ("best") or the offline
    policy's ("guard"); -1 (any) for the first policy validated, the offline one."""
    if offline_successes is None:
        return -1
    return kept_successes if keep == "best" else offline_successes


class PolicySelector:
    """The kept policy head of a run (by the rule `keep`) and the history of its validations."""

    def __init__(
        self,
        reference: Any,
        env: str,
        episodes: int,
        seed: int = VALIDATION_SEED,
        safety: Sequence[str] = (),
        keep: str = "best",
    ):
        if keep not in KEEP_RULES:
            raise ValueError(f"keep must be one of {', '.join(KEEP_RULES)}, got {keep!r}")
        self.reference = reference  # its encoder and renderer settings play the validated heads
        self.env = env
        self.episodes = episodes
        self.seed = seed
        self.keep = keep
        self.safety = list(safety)
        self.kept_head: torch.nn.Module | None = None
        self.kept_iteration = -1
        self.kept_successes = -1
        self.env_steps = 0
        self.history: list[tuple[int, int]] = []  # (iteration, successes)
        # States recur across validations (same seeds, a policy that changes little): encode each once. Saved
        # with a run's resume state, like the rollouts' memo: a text's vector depends on its batch by ~1e-7.
        self.memo = reference.seed_memo(EmbeddingMemo(reference.encoder))

    def play(self, head: torch.nn.Module) -> tuple[int, int]:
        """(successes, env steps) of `head` played greedily on the validation episodes (`Policy` puts it in
        eval mode: pass a copy of a head in training)."""
        from offline_agent.learn.policy import Policy

        policy = Policy(head, self.reference.encoder, self.reference.meta, memo=self.memo)
        outcomes = rollout_policy(self.env, policy, self.episodes, self.seed, safety=self.safety)
        return sum(o.success for o in outcomes), sum(o.steps for o in outcomes)

    def consider(self, iteration: int, head: torch.nn.Module) -> dict[str, float]:
        """Validate `head` (the policy after `iteration` iterations), keep it if it `improves` on the kept
        one; returns the metrics of this validation."""
        snapshot = copy.deepcopy(head).requires_grad_(False)  # played, and kept if it improves
        successes, steps = self.play(snapshot)
        self.env_steps += steps
        offline_successes = self.history[0][1] if self.history else None
        bar = bar_to_keep(self.keep, self.kept_successes, offline_successes)
        self.history.append((iteration, successes))
        if improves(successes, bar):
            self.kept_head = snapshot
            self.kept_iteration, self.kept_successes = iteration, successes
        return {
            "validation/success_rate": successes / self.episodes,
            "validation/kept_iteration": float(self.kept_iteration),
            "validation/kept_success_rate": self.kept_successes / self.episodes,
            "validation/env_steps": float(self.env_steps),
        }

    def describe(self) -> dict[str, Any]:
        """What policy.json and finetune.json say about the selection."""
        return {
            "episodes": self.episodes,
            "seed": self.seed,
            "keep": self.keep,
            "kept_iteration": self.kept_iteration,
            "kept_success_rate": self.kept_successes / self.episodes,
            "env_steps": self.env_steps,
            "history": [{"iteration": i, "success_rate": s / self.episodes} for i, s in self.history],
        }

    # --- resume ------------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON state) of the selection, for the run's resume file."""
        assert self.kept_head is not None, "save after the first validation"
        tensors = {f"validation/{k}": v.detach().cpu().contiguous() for k, v in self.kept_head.state_dict().items()}
        state = {
            "kept_iteration": self.kept_iteration,
            "kept_successes": self.kept_successes,
            "env_steps": self.env_steps,
            "history": self.history,
        }
        return tensors, state

    def load(self, tensors: dict[str, torch.Tensor], state: dict[str, Any], like: torch.nn.Module) -> None:
        """Restore `state()`'s output; `like` is a head of the same architecture (the trainer's)."""
        prefix = "validation/"
        head = copy.deepcopy(like)
        head.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
        self.kept_head = head.eval().requires_grad_(False)
        self.kept_iteration = int(state["kept_iteration"])
        self.kept_successes = int(state["kept_successes"])
        self.env_steps = int(state["env_steps"])
        self.history = [(int(i), int(s)) for i, s in state["history"]]
