"""Advice from logs alone: where a learned policy disagrees with what the agent did, and what it would do.

A team can act on its logs without deploying anything: for every logged step, the run's value head scores
the step's candidates (the logged ones and the logged action; where the log has none, every action the
dataset knows) and picks its best. Steps are grouped by the situation an engineer would look at, the tool the
agent called (for a text action, its first word: `say select`) and what came just before (the episode's
first step, a tool error, or a normal result), and
the groups are ranked by how much value the policy sees left on the table there: the sum over their steps of
`Q(s, policy's action) - Q(s, logged action)`. Each group says how often the policy disagreed, its most
frequent alternative, and the success rate of the episodes the steps belong to.

Where the log records no candidates (most real logs), the policy chooses among the `alternatives` actions
the logs take most often (default 256) besides the logged one. Scoring every step against the whole
vocabulary (8,500 distinct commands on InterCode SQL) took 4 minutes on 2 cores and proposed other tasks'
one-off queries; against the 256 most frequent it took 20 s, and the advice reads as a team can act on it
(at an SQL agent's first step, `SHOW TABLES` before a `SELECT`).

The values are the learned Q's, so the advice is as good as the policy (check it with `evaluate --dataset`:
its coverage says how far the policy strays from what the logs show).

Beside them, each situation's predicted return: the mean, over its steps, of what the run's value network
(`offline_agent.learn.value`, the logs' own agent's value, trained for prediction) expects the episode to
return from there. It says where the logged agent's episodes are already lost; `evaluate --dataset` says
how far to trust it (its ROC AUC for the held-out episodes' success).
"""

from __future__ import annotations

import csv
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

FIRST, AFTER_ERROR, AFTER_RESULT = "first step", "after an error", "after a result"
MESSAGE = "(message)"


@dataclass(frozen=True)
class Advice:
    """One situation: a tool the logs called, and what came just before."""

    tool: str  # the logged action's tool, or for a text action "say " and its first word (`action_kind`)
    situation: str  # first step | after an error | after a result
    steps: int
    disagreements: int  # steps where the policy's best action is not the logged one
    disagreement_rate: float
    value_gap: float  # sum over the steps of Q(s, policy's action) - Q(s, logged action), >= 0
    mean_gap: float
    instead: str  # the policy's most frequent other action there ("" where it always agreed)
    instead_share: float  # share of the disagreements that chose it
    episode_success: float  # success rate of the episodes these steps belong to (nan where unknown)
    predicted_return: float = float("nan")  # mean predicted return of the logged steps (nan: no value network)


def action_label(action: str, width: int = 60) -> str:
    """A canonical action as a person reads it: a tool call's name with its arguments, or the message."""
    try:
        parsed = json.loads(action)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and "name" in parsed:
        arguments = json.dumps(parsed.get("arguments", {}), separators=(",", ":"))
        text = f"{parsed['name']}({arguments[1:-1]})"
    else:
        text = f"say: {' '.join(action.split())}"
    return text if len(text) <= width else text[: width - 3] + "..."


def action_kind(tool_name: str | None, action: str) -> str:
    """What a step did, for grouping: the tool's name, or for a text action its first word (`say select` for an
    SQL command sent as text, `say ls` for a shell one), since logs of command-line agents have no tool names."""
    if tool_name:
        return tool_name
    words = action.split()
    first = words[0].strip(".,;:!?()'\"`").lower()[:20] if words else ""
    return f"say {first}" if first else MESSAGE


def most_frequent_actions(action_id: np.ndarray, n_actions: int, count: int) -> np.ndarray:
    """The `count` action ids the logs take most often, most frequent first (ties: the lower id first)."""
    frequency = np.bincount(action_id, minlength=n_actions)
    return np.lexsort((np.arange(n_actions), -frequency))[:count]


def advice_candidates(features: Any, rows: Any, alternatives: int) -> tuple[Any, Any]:
    """Candidate ids (n, C) and mask (n, C) of the steps `rows`: the logged candidates, or where the log has
    none the `alternatives` most frequent actions; the logged action always competes."""
    import torch

    logged = features.action_id[rows]  # (n,)
    ids = features.candidate_ids[rows]  # (n, C)
    frequent = torch.from_numpy(most_frequent_actions(features.action_id.numpy(), features.n_actions, alternatives))
    width = max(ids.shape[1], frequent.numel())
    ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=-1)
    frequent = torch.nn.functional.pad(frequent, (0, width - frequent.numel()), value=-1)
    ids = torch.where(~features.has_candidates[rows][:, None], frequent[None, :], ids)
    new = ~(ids == logged[:, None]).any(1, keepdim=True)  # (n, 1)
    ids = torch.cat([ids, logged[:, None]], 1)  # (n, C + 1)
    return ids, torch.cat([ids[:, :-1] >= 0, new], 1)


def situations(step: np.ndarray, previous_error: np.ndarray) -> list[str]:
    """Each step's situation from its index in the episode and whether the step before produced an error."""
    return [FIRST if s == 0 else AFTER_ERROR if e else AFTER_RESULT for s, e in zip(step, previous_error, strict=True)]


def group_advice(
    tools: list[str],
    where: list[str],
    logged: np.ndarray,
    chosen: np.ndarray,
    gap: np.ndarray,
    success: np.ndarray,
    labels: list[str],
    predicted: np.ndarray | None = None,
) -> list[Advice]:
    """Advice per (tool, situation), largest value gap first (ties by steps, then name, so the order is stable).

    logged, chosen: (n,) action ids; gap: (n,) Q(chosen) - Q(logged); success: (n,) the step's episode's
    success (nan unknown); labels: the action id -> readable text table; predicted: (n,) the value network's
    predicted return of each logged step, or None.
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(zip(tools, where, strict=True)):
        groups.setdefault(key, []).append(i)
    out = []
    for (tool, situation), members in groups.items():
        idx = np.asarray(members)
        differs = idx[chosen[idx] != logged[idx]]
        alternatives = Counter(int(chosen[i]) for i in differs).most_common()
        # Most frequent first; a tie goes to the lower id, so the advice does not depend on the step order.
        best = min(alternatives, key=lambda item: (-item[1], item[0])) if alternatives else None
        known = success[idx][~np.isnan(success[idx])]
        out.append(
            Advice(
                tool=tool,
                situation=situation,
                steps=len(idx),
                disagreements=len(differs),
                disagreement_rate=len(differs) / len(idx),
                value_gap=float(gap[idx].sum()),
                mean_gap=float(gap[idx].mean()),
                instead="" if best is None else labels[best[0]],
                instead_share=0.0 if best is None else best[1] / len(differs),
                episode_success=float(known.mean()) if known.size else float("nan"),
                predicted_return=float("nan") if predicted is None else float(predicted[idx].mean()),
            )
        )
    return sorted(out, key=lambda a: (-a.value_gap, -a.steps, a.tool, a.situation))


def advise(
    dataset: str | Path,
    run: str | Path,
    split: str | None = None,
    device: str = "cpu",
    encoder: Any = None,
    alternatives: int = 256,
) -> list[Advice]:
    """Advice of the policy of `run` on the logged steps of `dataset` (one split, or all of them); where a step
    has no logged candidates, the policy chooses among the `alternatives` most frequent actions."""
    from offline_agent.dataset import TrajectoryDataset
    from offline_agent.errors import UserError
    from offline_agent.learn.features import SPLITS, build_features
    from offline_agent.learn.fqe import q_over
    from offline_agent.learn.policy import Policy, load_value_network
    from offline_agent.learn.value import predicted_returns

    if alternatives < 1:
        raise UserError(f"--alternatives must be at least 1, got {alternatives}")
    if split is not None and split not in SPLITS:
        raise UserError(f"--split must be one of {', '.join(SPLITS)} (or left out for every step), got {split!r}")
    ds = TrajectoryDataset.open(dataset)
    policy = Policy.load(run, encoder=encoder, device=device)
    features = build_features(ds, policy.encoder, policy.state_settings)
    rows = features.rows(split)
    if rows.numel() == 0:
        raise UserError(f"dataset {ds.path} has no steps in its {split} split: advise on another --split")
    ids, mask = advice_candidates(features, rows, alternatives)
    q = q_over(policy.network, features, rows, ids, mask)
    best = q.argmax(1, keepdim=True)  # (n, 1) slots
    chosen = ids.gather(1, best)[:, 0]
    logged = features.action_id[rows]
    logged_q = q.gather(1, (ids == logged[:, None]).float().argmax(1, keepdim=True))[:, 0]
    gap = (q.gather(1, best)[:, 0] - logged_q).clamp(min=0)  # (n,) >= 0: the logged action is a candidate

    columns = ds.steps_table(columns=["tool_name", "is_error"]).to_pydict()
    r = rows.numpy()
    step = features.step.numpy()[r]
    errors = np.asarray(columns["is_error"], dtype=bool)
    previous_error = np.zeros(len(errors), dtype=bool)
    previous_error[1:] = errors[:-1]  # read only where step > 0, i.e. inside the same episode
    tools = [action_kind(columns["tool_name"][i], features.vocab[a]) for i, a in zip(r, logged.tolist(), strict=True)]
    success = features.episode_success.numpy()[features.episode_index.numpy()[r]]
    labels = [action_label(text) for text in features.vocab]
    value_network = load_value_network(run, device)
    predicted = None if value_network is None else predicted_returns(value_network, features, rows).numpy()
    return group_advice(
        tools, situations(step, previous_error[r]), logged.numpy(), chosen.numpy(), gap.numpy(),
        success.astype(np.float64), labels, predicted,
    )


def write_csv(advice: list[Advice], path: str | Path) -> Path:
    """The advice as CSV, written to a temporary file and renamed: a crash leaves the old file or none."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(Advice)])
        writer.writeheader()
        writer.writerows(asdict(a) for a in advice)
    os.replace(tmp, path)
    return path
