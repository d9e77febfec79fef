"""Policies at decision time, and their checkpoints (safetensors + JSON, never pickle).

A checkpoint is two files in a run folder:

    policy.safetensors   the network's state dict
    policy.json          format, algo, the network's constructor arguments, the encoder (id, path, dim,
                         max_length, observation_view), the state settings (k, max_tokens, keep_opening,
                         observation_view: `StateSettings.to_meta`), tau, training summary

and, for a run trained with a value network (`offline_agent.learn.value`; `value_network` in the JSON holds
its constructor arguments), `value.safetensors`; for one with a tuned encoder, `encoder.safetensors`; and
`texts.safetensors`, the vectors (those it was trained on) of the logs' most frequent texts that every memo of
the loaded policy starts with (`offline_agent.text.known`; `known_texts` in the JSON counts them).

Both are written to temporary names and renamed, the JSON last, so a reader
sees a whole checkpoint or none. `Policy.load` rebuilds the network from the
JSON, loads the tensors, and refuses (UserError) an encoder other than the one
the policy was trained with: its values would be computed on vectors it has
never seen. The one exception is deliberate: the same model run in another
precision (`--encoder-precision`: fp32, bf16 or int8), whose vectors are within
1e-4 (bf16) and 1e-2 (int8) of cosine of the fp32 ones (`encoder_for`).

`Policy.act(observation)` plays in an environment whose observations are
`{"text", "candidates"}` dicts: it keeps the episode's turns, renders the state
with `offline_agent.text.states.render_state` exactly as the training states were
rendered, embeds state and candidates (through a bounded memo, `EmbeddingMemo`,
that encodes the new texts of a decision round in one call), and returns the
index of the best candidate. `Policy.score(state_text, candidates)` ranks the
actions an LLM proposes (strings or tool-call dicts).

`act` chooses among the candidates it is given: the safety rules a fine-tuned
policy was trained under (`Policy.safety`) are applied by the environment, as
in fine-tuning and `offline-agent evaluate`, with
`SafetyWrapper(env, policy.safety)` from `offline_agent.envs.safety`, which
also decides what happens when every candidate is forbidden (a choice the
policy alone cannot make).

Dimension letters: B decisions, C candidate slots, D embedding width.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from offline_agent.actions import ActionError, canonical_action
from offline_agent.errors import UserError
from offline_agent.learn.grounding import grounding_batch
from offline_agent.learn.networks import build_network
from offline_agent.text.states import StateSettings, render_state

if TYPE_CHECKING:
    from offline_agent.envs.safety import SafetyFilter
    from offline_agent.text.cache import EmbeddingMemo

FORMAT = "offline-agent-policy"
FORMAT_VERSION = 1
WEIGHTS_FILE = "policy.safetensors"
VALUE_FILE = "value.safetensors"
TEXTS_FILE = "texts.safetensors"
CONFIG_FILE = "policy.json"


# --- checkpoints -----------------------------------------------------------------------------------


def save_checkpoint(
    run_dir: str | Path,
    network: torch.nn.Module,
    meta: dict[str, Any],
    encoder_layers: dict[str, torch.Tensor] | None = None,
    value_network: torch.nn.Module | None = None,
    known_texts: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `policy.safetensors` and `policy.json` into `run_dir` atomically; returns the JSON's path.

    `meta` holds at least algo, encoder {id, path, dim, max_length}, tau and the state settings
    (`StateSettings.to_meta()`; a key left out reads as `StateSettings.from_meta` says).
    `encoder_layers` (a tuned encoder's top layers, `meta["encoder"]["tuned"]` says on which base) go to
    `encoder.safetensors`, written before the JSON like the network's weights, and so does `value_network`
    (the logs' value, `offline_agent.learn.value`) to `value.safetensors`, and `known_texts` (arrays of
    `offline_agent.text.known.text_arrays`) to `texts.safetensors`.
    """
    from offline_agent.learn.encoder_tuning import ENCODER_FILE

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    weights_tmp = run_dir / f".{WEIGHTS_FILE}.tmp-{tag}"
    config_tmp = run_dir / f".{CONFIG_FILE}.tmp-{tag}"
    _save_tensors(network.state_dict(), weights_tmp)
    if encoder_layers is not None:
        encoder_tmp = run_dir / f".{ENCODER_FILE}.tmp-{tag}"
        _save_tensors(encoder_layers, encoder_tmp)
        os.replace(encoder_tmp, run_dir / ENCODER_FILE)
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, **meta, "network": network.config()}
    if value_network is not None:
        value_tmp = run_dir / f".{VALUE_FILE}.tmp-{tag}"
        _save_tensors(value_network.state_dict(), value_tmp)
        os.replace(value_tmp, run_dir / VALUE_FILE)
        config["value_network"] = value_network.config()
    config.pop("known_texts", None)  # a fine-tuned run's meta is its source's: only the texts given count
    if known_texts is not None:
        texts_tmp = run_dir / f".{TEXTS_FILE}.tmp-{tag}"
        _save_tensors({name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in known_texts.items()}, texts_tmp)
        os.replace(texts_tmp, run_dir / TEXTS_FILE)
        config["known_texts"] = len(known_texts["offsets"]) - 1
    config_tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(weights_tmp, run_dir / WEIGHTS_FILE)
    os.replace(config_tmp, run_dir / CONFIG_FILE)  # last: the JSON marks a complete checkpoint
    return run_dir / CONFIG_FILE


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`tensors` as a safetensors file at `path` (CPU, contiguous: what safetensors writes)."""
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(path))


def _network_from(config: dict[str, Any], weights: Path) -> torch.nn.Module:
    """The network of a `config()` entry of policy.json with the weights of the safetensors file `weights`."""
    network = build_network(config)
    network.load_state_dict(load_file(str(weights)), strict=True)
    return network


def tuned_layers(folder: str | Path, meta: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The tuned encoder layers a checkpoint holds (None for a policy over the frozen encoder)."""
    from offline_agent.learn.encoder_tuning import ENCODER_FILE

    if not (meta.get("encoder") or {}).get("tuned"):
        return None
    path = checkpoint_dir(folder) / ENCODER_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: this policy was trained with a tuned encoder; copy the whole run folder")
    return load_file(str(path))


def checkpoint_dir(path: str | Path) -> Path:
    """The run folder of a checkpoint given as the folder or as its policy.json / policy.safetensors."""
    path = Path(path)
    folder = path.parent if path.name in (CONFIG_FILE, WEIGHTS_FILE) else path
    if not (folder / CONFIG_FILE).is_file():
        raise UserError(
            f"{path} holds no policy checkpoint ({CONFIG_FILE} not found): "
            "train one with `offline-agent train DATASET --out RUN`"
        )
    return folder


def load_checkpoint(path: str | Path, device: str = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """(network in eval mode, policy.json as a dict) of a checkpoint; safetensors only, nothing unpickled."""
    folder = checkpoint_dir(path)
    meta = read_policy_json(folder)
    return _network_from(meta["network"], folder / WEIGHTS_FILE).to(device).eval(), meta


def read_policy_json(folder: Path) -> dict[str, Any]:
    """policy.json of the run folder `folder`, checked to be a checkpoint of this format."""
    try:
        meta = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{folder / CONFIG_FILE} is not valid JSON ({exc}): the checkpoint is damaged") from None
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{folder / CONFIG_FILE} is not an {FORMAT} v{FORMAT_VERSION} checkpoint "
            f"(format {meta.get('format')!r} v{meta.get('format_version')!r}): retrain with this offline-agent"
        )
    return meta


def load_known_texts(path: str | Path, meta: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The known texts' arrays a checkpoint holds (`offline_agent.text.known`), or None for one without."""
    if not meta.get("known_texts"):
        return None
    file = checkpoint_dir(path) / TEXTS_FILE
    if not file.is_file():
        raise UserError(f"{file} is missing: policy.json says the run keeps known texts; copy the whole run folder")
    return {name: t.numpy() for name, t in load_file(str(file)).items()}


def load_value_network(path: str | Path, device: str = "cpu") -> torch.nn.Module | None:
    """The value network of a run (`offline_agent.learn.value`) in eval mode, or None for a run trained without
    one (`--no-value-head`, or before it existed)."""
    folder = checkpoint_dir(path)
    meta = read_policy_json(folder)
    if "value_network" not in meta:
        return None
    if not (folder / VALUE_FILE).is_file():
        raise UserError(f"{folder / VALUE_FILE} is missing: this run was trained with a value network; copy the whole "
                        "run folder")
    with torch.random.fork_rng(devices=[]):  # its random init is overwritten: reading it leaves the RNG as it was
        network = _network_from(meta["value_network"], folder / VALUE_FILE)
    return network.to(device).eval()


def encoder_for(
    meta: dict[str, Any],
    encoder: Any = None,
    device: str = "cpu",
    folder: str | Path | None = None,
    precision: str | None = None,
) -> Any:
    """The encoder a checkpoint was trained with: `encoder` if given (an encoder, or a model folder loaded
    with the checkpoint's settings), else loaded from the recorded path (or the packaged default when that
    path is absent here), with the checkpoint's tuned top layers (read from `folder`) if it has them. A
    different encoder id is a UserError.

    `precision` is the number format of an encoder loaded here (`TextEncoder(precision=...)`); None: the one
    the policy was trained in (`trained_precision`). An encoder of the same model in another precision is
    accepted (their `fp32_id`s agree): at decision time its vectors stand in for the ones the policy was
    trained on (cosine >= 0.9999 between bf16 and fp32, about 0.99 between int8 and either: 0.9865 at worst over
    the texts of three real datasets, benchmarks/results/embed.md). Never a different model."""
    from offline_agent.text.encoder import TextEncoder

    wanted = meta.get("encoder")
    if not isinstance(wanted, dict) or "id" not in wanted:
        raise UserError("the checkpoint's policy.json names no encoder (encoder.id): retrain it with this version")
    if precision is None:
        precision = trained_precision(wanted["id"], device)
    tuned = wanted.get("tuned")
    given = encoder is not None and not isinstance(encoder, str | Path)
    if not given or (tuned and getattr(encoder, "fp32_id", encoder.id) == tuned.get("base_id")):
        # A tuned policy is given its base encoder (e.g. by `evaluate --encoder`): a copy gets the layers.
        if encoder is None:
            path = wanted.get("path")
            path = path if path and Path(path).is_dir() else None
        else:
            path = str(encoder) if isinstance(encoder, str | Path) else encoder.path
        encoder = TextEncoder(
            path=path,
            device=device,
            max_length=int(wanted.get("max_length") or 256),
            observation_view=bool(wanted.get("observation_view")),
            per_turn=bool(wanted.get("per_turn")),
            precision=getattr(encoder, "precision", "fp32") if given else precision,
        )
        if tuned:
            if folder is None:
                raise ValueError("a tuned encoder's layers are read from the checkpoint folder: pass `folder`")
            encoder.load_tuned_layers(tuned_layers(folder, meta), base_id=tuned.get("base_id"))
    stands_in = getattr(encoder, "fp32_id", None) == TextEncoder.fp32_id_of(wanted["id"])
    if encoder.id != wanted["id"] and not stands_in:
        raise UserError(
            f"this policy was trained on embeddings of encoder {wanted['id']} (from {wanted.get('path')}), "
            f"but the encoder available is {encoder.id}: pass --encoder PATH to the model it was trained with, "
            "or retrain the policy with this encoder"
        )
    return encoder


def trained_precision(encoder_id: str, device: str) -> str:
    """The precision of the vectors a policy was trained on (read off its encoder id), if `device` runs it;
    else fp32 (int8 runs on the CPU only), whose vectors stand in for them. Off-policy evaluation and advice
    then read the dataset's vectors from the same embedding cache that training filled."""
    from offline_agent.text.encoder import TextEncoder

    precision = TextEncoder.precision_of(encoder_id)
    return "fp32" if precision == "int8" and not device.startswith("cpu") else precision


# --- the policy ------------------------------------------------------------------------------------


@dataclass
class EpisodeHistory:
    """What a policy remembers of one episode: its task and the (observation, action) turns so far."""

    task: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)

    def actions(self) -> list[str]:
        """The actions taken so far, oldest first (what grounding checks repeats against)."""
        return [action for _, action in self.turns]


def candidate_texts(candidates: Sequence[Any]) -> list[str]:
    """Canonical texts of candidates given as strings or tool-call dicts; a bad one is a UserError."""
    try:
        return [canonical_action(c) for c in candidates]
    except ActionError as exc:
        raise UserError(f"a candidate action cannot be read: {exc}") from None


class Policy:
    """A trained scoring network with the encoder and renderer it was trained with."""

    def __init__(
        self,
        network: torch.nn.Module,
        encoder: Any,
        meta: dict[str, Any],
        greedy: bool = True,
        seed: int = 0,
        device: str = "cpu",
        memo: EmbeddingMemo | dict[str, np.ndarray] | None = None,
        known_texts: dict[str, np.ndarray] | None = None,
    ):
        """`memo` may be shared by policies with the same encoder, e.g. when comparing several on the same
        episodes: their states often coincide. It is an `EmbeddingMemo` of `encoder`, or a dict (text ->
        vector) that a memo of this policy's own keeps its vectors in; by default the policy has its own.
        `known_texts` (the checkpoint's, `offline_agent.text.known`) seed it, and `seed_memo` seeds others."""
        from offline_agent.text.cache import EmbeddingMemo

        self.network = network.to(device).eval()
        self.encoder = encoder
        self.meta = meta
        self.tau = float(meta.get("tau", 1.0))
        self.state_settings = StateSettings.from_meta(meta)
        self.greedy = greedy
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        self.history = EpisodeHistory()
        if isinstance(memo, EmbeddingMemo) and memo.encoder is not encoder:
            raise ValueError(f"the memo passed holds vectors of {memo.encoder!r}, not of this policy's {encoder!r}")
        self.memo = memo if isinstance(memo, EmbeddingMemo) else EmbeddingMemo(encoder, store=memo)
        self.known_texts = known_texts
        self.seed_memo(self.memo)

    @classmethod
    def load(
        cls,
        path: str | Path,
        encoder: Any = None,
        device: str = "cpu",
        greedy: bool = True,
        seed: int = 0,
        precision: str | None = None,
        known_texts: bool = True,
    ) -> Policy:
        """The policy of a checkpoint (run folder or its policy.json); see `encoder_for` for the encoder and
        `precision`. Without `known_texts` its memos start empty instead of with the checkpoint's known texts."""
        network, meta = load_checkpoint(path, device)
        encoder = encoder_for(meta, encoder, device, folder=checkpoint_dir(path), precision=precision)
        known = load_known_texts(path, meta) if known_texts else None
        return cls(network, encoder, meta, greedy=greedy, seed=seed, device=device, known_texts=known)

    def seed_memo(self, memo: EmbeddingMemo) -> EmbeddingMemo:
        """`memo` with the checkpoint's known texts added (`EmbeddingMemo.seed`), if it has any."""
        if self.known_texts is not None:
            memo.seed(self.known_texts)
        return memo

    @property
    def algo(self) -> str:
        return str(self.meta.get("algo"))

    @property
    def safety(self) -> SafetyFilter:
        """The safety rules saved with the policy (a fine-tuned run's `--safety`; none for an offline run)."""
        from offline_agent.envs.safety import SafetyFilter

        specs = self.meta.get("safety") or []
        if not isinstance(specs, list) or not all(isinstance(spec, str) for spec in specs):
            raise UserError(
                f"policy.json's safety is {specs!r:.80}, not a list of rule specs: the checkpoint is damaged"
            )
        return SafetyFilter.from_spec(specs)

    # --- embeddings --------------------------------------------------------------------------------

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(N, D) float32 embeddings through the policy's memo: the texts it has not seen (states of every
        episode played in lockstep, new candidates) are encoded in one call, those it has are not encoded."""
        return self.memo.embed(texts)

    def render(self, history: EpisodeHistory, observation_text: str) -> str:
        """The state text of a decision, rendered with the state settings the policy was trained with."""
        count_tokens = getattr(self.encoder, "count_tokens", None)
        return render_state(history.task, history.turns, observation_text, self.state_settings, count_tokens)

    # --- scoring -----------------------------------------------------------------------------------

    @torch.no_grad()
    def score_batch(
        self,
        state_texts: Sequence[str],
        candidates: Sequence[Sequence[Any]],
        taken: Sequence[Sequence[str]] | None = None,
    ) -> list[np.ndarray]:
        """Q-values (or BC logits) of each state's candidates: one (C_i,) float32 array per state.

        `taken` (each episode's actions so far, canonical texts) is what a grounded network
        (`offline_agent.learn.grounding`) checks repeats against; without it, the state text's own turns."""
        cand_lists = [candidate_texts(c) for c in candidates]
        if any(not c for c in cand_lists):
            raise UserError("a decision needs at least one candidate action, got an empty list")
        flat = [t for c in cand_lists for t in c]
        vectors = torch.from_numpy(self.embed(list(state_texts) + flat))  # (B + sum C_i, D)
        state = vectors[: len(state_texts)]  # (B, D)
        width = max(len(c) for c in cand_lists)
        cand = torch.zeros(len(cand_lists), width, state.shape[1])  # (B, C, D)
        mask = torch.zeros(len(cand_lists), width, dtype=torch.bool)  # (B, C)
        offset = len(state_texts)
        for i, c in enumerate(cand_lists):
            cand[i, : len(c)] = vectors[offset : offset + len(c)]
            mask[i, : len(c)] = True
            offset += len(c)
        pair = None
        if getattr(self.network, "pair_dim", 0):
            pair = grounding_batch(state_texts, cand_lists, width, taken).to(self.device)  # (B, C, P)
        q = self.network.q_values(state.to(self.device), cand.to(self.device), mask.to(self.device), pair).cpu()
        return [q[i, : len(c)].numpy().astype(np.float32) for i, c in enumerate(cand_lists)]

    def score(self, state_text: str, candidates: Sequence[Any]) -> np.ndarray:
        """(C,) float32 values of `candidates` (strings or tool-call dicts) in the state `state_text`."""
        return self.score_batch([state_text], [candidates])[0]

    def probabilities(self, state_text: str, candidates: Sequence[Any]) -> np.ndarray:
        """(C,) pi(a|s) = softmax(Q / tau) over `candidates`."""
        q = torch.from_numpy(self.score(state_text, candidates))
        return torch.softmax(q / self.tau, 0).numpy()

    # --- acting ------------------------------------------------------------------------------------

    def reset(self, task: str | None = None) -> None:
        """Start a new episode (call before its first `act`)."""
        self.history = EpisodeHistory(task)

    def act(self, observation: dict[str, Any]) -> int:
        """Index of the chosen candidate of an environment observation `{"text", "candidates"}`."""
        return self.act_batch([self.history], [observation])[0]

    def act_batch(self, histories: Sequence[EpisodeHistory], observations: Sequence[dict[str, Any]]) -> list[int]:
        """One decision in each of several episodes at once (one encoder call); records each turn."""
        texts = [str(o.get("text", "")) for o in observations]
        states = [self.render(h, t) for h, t in zip(histories, texts, strict=True)]
        scores = self.score_batch(states, [o["candidates"] for o in observations], [h.actions() for h in histories])
        choices = []
        for history, text, obs, q in zip(histories, texts, observations, scores, strict=True):
            if self.greedy:
                index = int(np.argmax(q))
            else:
                probs = torch.softmax(torch.from_numpy(q) / self.tau, 0)
                index = int(torch.multinomial(probs, 1, generator=self.generator))
            history.turns.append((text, canonical_action(obs["candidates"][index])))
            choices.append(index)
        return choices

    def __repr__(self) -> str:
        return f"Policy(algo={self.algo!r}, encoder={self.encoder.id!r}, tau={self.tau}, k={self.state_settings.k})"
