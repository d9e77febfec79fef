"""The networks that score actions: plain `torch.nn.Module`s with one shared method, `q_values`.

`q_values(state_emb (B, D), cand_emb (B, C, D), mask (B, C), pair=None) -> (B, C)`
is the contract: every learner's network answers it (CQL's Q, BC's logits,
FQE's Q, the export of d3rlpy's DiscreteCQL), the `Policy` turns it into
`softmax(q / tau)`, and the online PPO stage initialises its policy head from a
checkpoint's network through it. Masked-out slots come back as -inf. `pair`
(B, C, P) holds features of each (state, candidate) pair (`grounding.py`); a
network reads it only if its `pair_dim` is P > 0, and then it is required.

- `QNetwork`: Q(s, a) = MLP([phi(s), psi(a), phi(s) * psi(a)]) with K heads (twin Q for CQL), optionally
  with small residual adapters that make the frozen state or action embeddings trainable, and optionally
  with the pair's grounding g(s, a) as a fourth input block.
- `FactorisedQNetwork` (the default of CQL): a state tower run once per state, an action tower run once per
  distinct action, and a small per-pair head on their reduced R-dimensional vectors; the pairwise
  `QNetwork` runs every (state, candidate) pair through its wide layers, which made CQL 6x slower than
  d3rlpy's state-only network on the same features.
- `VocabQNetwork`: an MLP from phi(s) to one value per vocabulary action (d3rlpy's architecture); a candidate
  is scored as its nearest vocabulary action by embedding (an exact match for a known action).
- `ResidualQNetwork`: a frozen copy of another network plus a trainable `QNetwork` correction that starts at
  zero; what online fine-tuning trains by default (`offline_agent.online.ppo`).

`build_network(config)` rebuilds either from the `network` entry of a checkpoint's policy.json.

Dimension letters: B batch, C candidate slots, D embedding width, H hidden width, K heads, V vocabulary,
P pair features, R reduced (tower output) width, U distinct actions, G pair-head width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def masked(q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q (B, C) with -inf where mask (B, C) is False."""
    return q.masked_fill(~mask, float("-inf"))


class Adapter(nn.Module):
    """x + W2 relu(W1 x), renormalised: a trainable correction of a frozen unit embedding.

    W2 starts at zero, so an adapter starts as the identity and training departs from the frozen features
    only as far as the loss asks.
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.down = nn.Linear(dim, hidden)
        self.up = nn.Linear(hidden, dim)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(x + self.up(torch.relu(self.down(x))), dim=-1)


def _set_inputs(net: nn.Module, dim: int, state_adapter: bool, action_adapter: bool, adapter_hidden: int) -> None:
    """The input side both candidate scorers share: optional adapters on the frozen embeddings, and the scale."""
    net.state_adapter = Adapter(dim, adapter_hidden) if state_adapter else None
    net.action_adapter = Adapter(dim, adapter_hidden) if action_adapter else None
    net.adapter_hidden = adapter_hidden
    # Unit embeddings have coordinates of size ~1/sqrt(D); scaling them to ~1 suits the default init.
    net.scale = math.sqrt(dim)


def _config(net: nn.Module, **own: Any) -> dict[str, Any]:
    """A candidate scorer's constructor arguments, as stored in policy.json: the shared ones and `own`."""
    return {
        "kind": net.kind,
        "dim": net.dim,
        "hidden": net.hidden,
        "n_heads": net.n_heads,
        **own,
        "state_adapter": net.state_adapter is not None,
        "action_adapter": net.action_adapter is not None,
        "adapter_hidden": net.adapter_hidden,
        "pair_dim": net.pair_dim,
    }


class QHead(nn.Module):
    """One Q function: relu(W_s s + W_a a + W_sa (s * a) [+ W_g g] + b) -> H -> 1.

    The first layer is a Linear over the concatenation [s, a, s * a (, g)] written as blocks, so that the
    state block runs once per state (B, H) instead of once per candidate (B, C, H): the same function,
    a third less compute. g (B, C, P) is the pair's grounding, when the head has `pair_dim` P > 0.
    """

    def __init__(self, dim: int, hidden: int, pair_dim: int = 0):
        super().__init__()
        self.w_state = nn.Linear(dim, hidden)
        self.w_action = nn.Linear(dim, hidden, bias=False)
        self.w_product = nn.Linear(dim, hidden, bias=False)
        self.w_pair = nn.Linear(pair_dim, hidden, bias=False) if pair_dim else None
        self.mlp = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(
        self,
        s: torch.Tensor,
        a: torch.Tensor,
        a_hidden: torch.Tensor | None = None,
        pair: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """s (B, D), a (B, C, D), pair (B, C, P) -> (B, C). `a_hidden` (B, C, H), if given, is `w_action(a)`."""
        a_hidden = self.w_action(a) if a_hidden is None else a_hidden
        h = self.w_state(s)[:, None, :] + a_hidden + self.w_product(s[:, None, :] * a)  # (B, C, H)
        if self.w_pair is not None:
            if pair is None:
                raise ValueError("this network scores (state, candidate) pairs with their grounding: pass `pair`")
            # Grounding features are only ever appended: a head trained on the first P reads the first P.
            h = h + self.w_pair(pair[..., : self.w_pair.in_features])
        return self.mlp(h).squeeze(-1)  # (B, C, 1) -> (B, C)


class QNetwork(nn.Module):
    """Q(s, a) over frozen text embeddings: K heads of `QHead`, min over heads as the value."""

    kind = "candidate_q"

    def __init__(
        self,
        dim: int,
        hidden: int = 256,
        n_heads: int = 2,
        state_adapter: bool = False,
        action_adapter: bool = False,
        adapter_hidden: int = 128,
        pair_dim: int = 0,
    ):
        super().__init__()
        self.dim, self.hidden, self.n_heads, self.pair_dim = dim, hidden, n_heads, pair_dim
        _set_inputs(self, dim, state_adapter, action_adapter, adapter_hidden)
        self.heads = nn.ModuleList(QHead(dim, hidden, pair_dim) for _ in range(n_heads))

    def config(self) -> dict[str, Any]:
        """The constructor arguments, as stored in policy.json."""
        return _config(self)

    def all_heads(
        self, state_emb: torch.Tensor, cand_emb: torch.Tensor, pair: torch.Tensor | None = None
    ) -> torch.Tensor:
        """state_emb (B, D), cand_emb (B, C, D), pair (B, C, P) -> (K, B, C) Q-values of every head (no mask)."""
        s, a = state_emb, cand_emb
        if self.state_adapter is not None:
            s = self.state_adapter(s)
        if self.action_adapter is not None:
            a = self.action_adapter(a)
        s, a = s * self.scale, a * self.scale
        return torch.stack([head(s, a, pair=pair) for head in self.heads])

    def all_heads_by_id(
        self, state_emb: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, pair: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`all_heads(state_emb, table[ids])` for candidates given as rows of an action table (V, D), ids
        (B, C) int64 -> (K, B, C). Training draws its candidates from the dataset's action vocabulary and
        a batch repeats them, so the action block of the first layer runs once per distinct action of the
        batch (U, H) instead of once per (state, candidate) pair (B, C, H): the same function, a third
        less compute per pair."""
        s = state_emb
        distinct, where = torch.unique(ids, return_inverse=True)  # (U,), (B, C) indices into it
        actions = table[distinct]  # (U, D)
        if self.state_adapter is not None:
            s = self.state_adapter(s)
        if self.action_adapter is not None:
            actions = self.action_adapter(actions)
        s, actions = s * self.scale, actions * self.scale
        a = actions[where]  # (U, D) -> (B, C, D)
        return torch.stack([head(s, a, head.w_action(actions)[where], pair) for head in self.heads])

    def q_values(
        self, state_emb: torch.Tensor, cand_emb: torch.Tensor, mask: torch.Tensor, pair: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, C) min over heads, -inf where mask (B, C) is False."""
        return masked(self.all_heads(state_emb, cand_emb, pair).min(0).values, mask)


def _uniform(shape: tuple[int, ...], fan_in: int) -> nn.Parameter:
    """A parameter drawn like `nn.Linear`'s default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Parameter(torch.empty(shape).uniform_(-bound, bound))


class Tower(nn.Module):
    """K independent two-layer MLPs D -> H -> R + G, run as one wide matmul and one batched one: x (N, D) ->
    (K, N, R + G).

    The K heads' first layers are one Linear(D, K * H), so a tower costs one matmul however many heads it
    has, and the heads stay independent functions (twin Q needs two estimates, not one twice). The output
    holds the reduced vector (first R) and, after it, the tower's own linear term in the pair head's first
    layer (last G): a linear map of a linear map is one linear map, so it costs no extra layer.
    """

    def __init__(self, dim: int, hidden: int, width: int, n_heads: int):
        super().__init__()
        self.n_heads, self.hidden = n_heads, hidden
        self.first = nn.Linear(dim, n_heads * hidden)
        self.second = _uniform((n_heads, hidden, width), hidden)  # (K, H, R + G)
        self.second_bias = _uniform((n_heads, 1, width), hidden)  # (K, 1, R + G)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x)).view(x.shape[0], self.n_heads, self.hidden).transpose(0, 1)  # (K, N, H)
        return torch.baddbmm(self.second_bias, h, self.second)  # (K, N, H) @ (K, H, R + G) -> (K, N, R + G)


class PairHead(nn.Module):
    """Per head k, a two-layer MLP of width G over the reduced vectors, with its first layer in blocks:

        h1 = relu(W_uv (u * v) + t(s) + t(a) [+ W_g g]),   h2 = relu(W_2 h1 + b_2),   q = w . h2 + c

    The towers give, per state, u (R) and t(s) (G), and per action v (R) and t(a) (G) (`Tower`): the
    first layer's blocks of u and v are computed once per state and per action, and only the product
    u * v (R) and the grounding g (P) are per pair. Per pair and head that is R x G + G x G (+ P x G)
    multiply-adds. (A dot-product score <u, v> on top, the two-tower recipe, halved Logistics' success:
    which action fits a state there is a matter of the grounding, and a bilinear term drowns it.)
    """

    def __init__(self, rank: int, width: int, n_heads: int, pair_dim: int = 0):
        super().__init__()
        self.rank = rank
        self.w_product = _uniform((n_heads, rank, width), rank)  # (K, R, G)
        self.w_pair = _uniform((pair_dim, n_heads * width), pair_dim) if pair_dim else None  # (P, K*G)
        self.second = _uniform((n_heads, width, width), width)  # (K, G, G)
        self.second_bias = _uniform((n_heads, 1, width), width)  # (K, 1, G)
        self.out = _uniform((n_heads, width, 1), width)  # (K, G, 1)
        self.out_bias = _uniform((n_heads, 1, 1), width)  # (K, 1, 1)

    def forward(
        self, states: torch.Tensor, actions: torch.Tensor, where: torch.Tensor, pair: torch.Tensor | None = None
    ) -> torch.Tensor:
        """states (K, B, R + G), actions (K, U, R + G), where (B, C) int64 into U, pair (B, C, P) -> (K, B, C)."""
        k, b, _ = states.shape
        c, r = where.shape[1], self.rank
        u, t_state = states.split([r, states.shape[2] - r], -1)  # (K, B, R), (K, B, G)
        pairs = actions.index_select(1, where.reshape(-1)).view(k, b, c, -1)  # (K, U, .) -> (K, B, C, R + G)
        v, t_action = pairs.split([r, pairs.shape[3] - r], -1)  # (K, B, C, R), (K, B, C, G)
        product = (u[:, :, None, :] * v).view(k, b * c, r)  # (K, B*C, R)
        h = torch.bmm(product, self.w_product).view(k, b, c, -1) + t_state[:, :, None, :] + t_action  # (K, B, C, G)
        if self.w_pair is not None:
            if pair is None:
                raise ValueError("this network scores (state, candidate) pairs with their grounding: pass `pair`")
            # Grounding features are only ever appended: a head trained on the first P reads the first P.
            g = pair[..., : self.w_pair.shape[0]] @ self.w_pair  # (B, C, P) @ (P, K*G) -> (B, C, K*G)
            h = h + g.view(b, c, k, -1).permute(2, 0, 1, 3)  # -> (K, B, C, G)
        h = torch.relu(torch.baddbmm(self.second_bias, torch.relu(h).view(k, b * c, -1), self.second))  # (K, B*C, G)
        return torch.baddbmm(self.out_bias, h, self.out).view(k, b, c)  # (K, B*C, 1) -> (K, B, C)


class FactorisedQNetwork(nn.Module):
    """Q(s, a) from a state tower, an action tower and a small per-pair head: K heads, min over heads.

    The state tower runs once per state and the action tower once per distinct action (a batch's
    candidates repeat a small vocabulary), both to width R (+ their first-layer terms); `PairHead`
    combines them with the pair's grounding at R x G + G x G multiply-adds per pair and head, where the
    pairwise `QNetwork` spends D x H + H x H (about 50x more at the defaults). Same contract as
    `QNetwork` (`all_heads`, `all_heads_by_id`, `q_values`), so CQL, the `Policy` and online fine-tuning
    take either.
    """

    kind = "factorised_q"

    def __init__(
        self,
        dim: int,
        hidden: int = 128,
        n_heads: int = 2,
        rank: int = 64,
        pair_hidden: int = 32,
        state_adapter: bool = False,
        action_adapter: bool = False,
        adapter_hidden: int = 128,
        pair_dim: int = 0,
    ):
        super().__init__()
        self.dim, self.hidden, self.n_heads, self.pair_dim = dim, hidden, n_heads, pair_dim
        self.rank, self.pair_hidden = rank, pair_hidden
        _set_inputs(self, dim, state_adapter, action_adapter, adapter_hidden)
        self.state_tower = Tower(dim, hidden, rank + pair_hidden, n_heads)
        self.action_tower = Tower(dim, hidden, rank + pair_hidden, n_heads)
        self.pair_head = PairHead(rank, pair_hidden, n_heads, pair_dim)

    def config(self) -> dict[str, Any]:
        """The constructor arguments, as stored in policy.json."""
        return _config(self, rank=self.rank, pair_hidden=self.pair_hidden)

    def state_vectors(self, state_emb: torch.Tensor) -> torch.Tensor:
        """state_emb (B, D) -> (K, B, R + G)."""
        s = state_emb if self.state_adapter is None else self.state_adapter(state_emb)
        return self.state_tower(s * self.scale)

    def action_vectors(self, action_emb: torch.Tensor) -> torch.Tensor:
        """action_emb (U, D) -> (K, U, R + G)."""
        a = action_emb if self.action_adapter is None else self.action_adapter(action_emb)
        return self.action_tower(a * self.scale)

    def all_heads(
        self, state_emb: torch.Tensor, cand_emb: torch.Tensor, pair: torch.Tensor | None = None
    ) -> torch.Tensor:
        """state_emb (B, D), cand_emb (B, C, D), pair (B, C, P) -> (K, B, C) Q-values of every head (no mask)."""
        b, c, d = cand_emb.shape
        where = torch.arange(b * c, device=cand_emb.device).view(b, c)
        actions = self.action_vectors(cand_emb.reshape(b * c, d))  # (B*C, D) -> (K, B*C, R + G)
        return self.pair_head(self.state_vectors(state_emb), actions, where, pair)

    def all_heads_by_id(
        self,
        state_emb: torch.Tensor,
        table: torch.Tensor,
        ids: torch.Tensor,
        pair: torch.Tensor | None = None,
        table_vectors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`all_heads(state_emb, table[ids])` for candidates given as rows (B, C) int64 of an action table
        (V, D) -> (K, B, C). The action tower runs once per distinct action of `ids`, or not at all when
        `table_vectors` (K, V, R + G), this network's `action_vectors(table)`, are given."""
        if table_vectors is not None:
            return self.pair_head(self.state_vectors(state_emb), table_vectors, ids, pair)
        if table.shape[0] <= ids.numel():  # a small vocabulary: every row beats finding the distinct ones
            return self.pair_head(self.state_vectors(state_emb), self.action_vectors(table), ids, pair)
        distinct, where = torch.unique(ids, return_inverse=True)  # (U,), (B, C) indices into it
        actions = self.action_vectors(table[distinct])  # (U, D) -> (K, U, R + G)
        return self.pair_head(self.state_vectors(state_emb), actions, where, pair)

    def q_values(
        self, state_emb: torch.Tensor, cand_emb: torch.Tensor, mask: torch.Tensor, pair: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, C) min over heads, -inf where mask (B, C) is False."""
        return masked(self.all_heads(state_emb, cand_emb, pair).min(0).values, mask)


class VocabQNetwork(nn.Module):
    """Q(s, .) for every vocabulary action at once: d3rlpy's DiscreteCQL network (MLP D -> H -> H -> V).

    At decision time the candidates are not vocabulary ids but texts, so `q_values` maps each candidate
    embedding to its nearest vocabulary action (cosine); a known action maps to itself, an action never
    seen in the logs borrows the value of the most similar one it knows.
    """

    kind = "vocab_q"
    pair_dim = 0  # d3rlpy's network sees states only

    def __init__(self, dim: int, n_actions: int, hidden: int = 256):
        super().__init__()
        self.dim, self.n_actions, self.hidden = dim, n_actions, hidden
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.fc = nn.Linear(hidden, n_actions)
        self.register_buffer("vocab_emb", torch.zeros(n_actions, dim))  # (V, D)

    def config(self) -> dict[str, Any]:
        return {"kind": self.kind, "dim": self.dim, "n_actions": self.n_actions, "hidden": self.hidden}

    def all_actions(self, state_emb: torch.Tensor) -> torch.Tensor:
        """state_emb (B, D) -> (B, V)."""
        return self.fc(self.encoder(state_emb))

    def nearest_action(self, cand_emb: torch.Tensor) -> torch.Tensor:
        """cand_emb (B, C, D) -> (B, C) int64 vocabulary id of the most similar action."""
        return (cand_emb @ self.vocab_emb.T).argmax(-1)  # (B, C, D) @ (D, V) -> (B, C, V) -> (B, C)

    def q_values(
        self, state_emb: torch.Tensor, cand_emb: torch.Tensor, mask: torch.Tensor, pair: torch.Tensor | None = None
    ) -> torch.Tensor:
        q = self.all_actions(state_emb).gather(1, self.nearest_action(cand_emb))  # (B, V) -> (B, C)
        return masked(q, mask)


class ResidualQNetwork(nn.Module):
    """q(s, a) = base(s, a) + scale * correction(s, a): a frozen network and a trainable one that starts at 0.

    Fine-tuning moves the correction only, so at the start this network *is* `base`, and the base's weights
    (saved with it) are the reference it departs from. With `scale = tau` the correction is in the policy's
    logit units (`softmax(q / tau)`), so an optimiser step moves the logits as much as it would move a fresh
    network's output, not 1/tau times as much as a copy of a Q network would.
    """

    kind = "residual_q"

    def __init__(self, base: dict[str, Any], hidden: int = 128, scale: float = 1.0):
        super().__init__()
        self.base = build_network(base).requires_grad_(False)
        self.dim = int(self.base.dim)  # a base may itself be residual (a fine-tuned policy fine-tuned again)
        self.pair_dim = int(self.base.pair_dim)  # the correction sees what the base sees
        self.correction = QNetwork(self.dim, hidden, n_heads=1, pair_dim=self.pair_dim)
        last = self.correction.heads[0].mlp[-1]
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.hidden, self.scale = hidden, float(scale)

    @classmethod
    def around(cls, network: nn.Module, hidden: int, scale: float) -> ResidualQNetwork:
        """A residual network whose base holds a copy of `network`'s weights (`network` itself is untouched)."""
        residual = cls(network.config(), hidden, scale)
        residual.base.load_state_dict(network.state_dict())
        return residual

    def config(self) -> dict[str, Any]:
        return {"kind": self.kind, "base": self.base.config(), "hidden": self.hidden, "scale": self.scale}

    def q_values(
        self, state_emb: torch.Tensor, cand_emb: torch.Tensor, mask: torch.Tensor, pair: torch.Tensor | None = None
    ) -> torch.Tensor:
        base = self.base.q_values(state_emb, cand_emb, mask, pair)
        return base + self.scale * self.correction.q_values(state_emb, cand_emb, mask, pair)  # -inf stays -inf


def build_network(config: dict[str, Any]) -> nn.Module:
    """A network from its `config()` (the `network` entry of policy.json), with fresh weights."""
    config = dict(config)
    kind = config.pop("kind")
    if kind == QNetwork.kind:
        return QNetwork(**config)
    if kind == FactorisedQNetwork.kind:
        return FactorisedQNetwork(**config)
    if kind == VocabQNetwork.kind:
        return VocabQNetwork(**config)
    if kind == ResidualQNetwork.kind:
        return ResidualQNetwork(**config)
    raise ValueError(f"unknown network kind {kind!r}")
