"""The fine-tuned model: a policy head that scores candidates, a value head over phi(s), and their optimizer.

The policy head starts as the offline checkpoint's network, so at iteration 0 the policy *is* the offline
policy `softmax(Q / tau)`: by default (`policy_init="residual"`) the logits are `Q(s, .) / tau + g(s, .)`,
with Q frozen and g a fresh candidate-scoring MLP whose last layer starts at zero (`ResidualQNetwork`);
`"copy"` trains a copy of Q itself; `from_scratch` new weights of the same architecture (the baseline).

Value head: an MLP over phi(s). With `value_init="critic"` it predicts a
residual on top of the offline critic's value `V_ref(s) = sum_a pi_ref(a|s)
Q_ref(s, a)` (the MLP's last layer starts at zero, so V starts as V_ref); with
`"zero"` (the default) it is a fresh MLP. What we measured (PipelineRepair-v0,
the benchmark's CQL run, MiniLM, 4 envs x 32 steps x 6 iterations, lr 1e-5,
seed 0): the CQL critic is a poor baseline. Its values are off in scale (CQL's
conservative term pushes them away from the Monte-Carlo returns), so the value
loss of the first rollout was 1.03 with the critic init against 0.10 with a
fresh MLP, and still 0.70 against 0.14 after 6 iterations; training success
rates were within noise of each other (7-9 episodes per iteration). Hence the
default. Cal-QL (the offline default since) keeps the critic on the scale of the
returns, and measured from a Cal-QL run of the same logs (4 envs x 64 steps x 20
iterations, lr 3e-3) the critic init starts better but does not stay so: value
loss 0.12 against 0.24 on the first rollout, then 0.13-0.16 against 0.01-0.03,
and the greedy policy ended at 24/30 against 27/30. The default stays "zero".

The value head has its own learning rate (`value_learning_rate`, by default the policy's). Measured on
PipelineRepair-v0 (the benchmark's CQL run, 40 iterations x 4 envs x 32 steps, policy lr 1e-5, seed 0): at
1e-3 the value loss of the first 30 iterations averaged 0.07 against 0.10 at 1e-5, and neither the
training success rates nor the greedy policy's (20/30 either way) moved; so the default stays.

Step size: a copy's logits are Q / tau (tau = 0.1 for CQL), so it is steep: one
Adam step at lr 1e-4 moved the policy 2 nats of KL from the reference on
Logistics-v0, at 1e-5 about 0.03. On PipelineRepair-v0 (the benchmark's CQL run,
4 envs x 64 steps) a copy at lr 1e-4 ran at 1-2 nats of KL per step within 10
iterations (with or without `kl_gradient`) and, without it, 3-7 by iteration 30
(beta barely moved: the controller is slow by design), its training success
fell from 0.8-0.9 to 0.2-0.4 and the greedy policy's from 20/30 to 5/30; with
`max_update_kl` (CleanRL's `target_kl`: an iteration's updates end once a
minibatch's KL(pi_old || pi_new) estimate exceeds it) it took one minibatch
step of 16 per iteration. Hence the residual
default: g is in logit units, so Adam moves it as it moves any fresh network.
At lr 3e-4 it did not move the policy in 6 iterations (KL < 0.001: the offline
policy is nearly deterministic, entropy ~0.08 nats, so the policy gradient is
small); at lr 3e-3, the default, the KL followed its 0.05 target (0.01-0.09
over 20 iterations) with most of the 16 minibatch steps taken.

Dimension letters: B rows, C candidate slots, D embedding width, P grounding features.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from offline_agent.learn.networks import ResidualQNetwork

if TYPE_CHECKING:
    from offline_agent.online.config import PPOConfig


class ActorCritic(nn.Module):
    """Policy logits from a scoring network (`q_values / tau`), and V(s) from an MLP over phi(s)."""

    def __init__(self, policy_head: nn.Module, tau: float, dim: int, hidden: int, value_init: str):
        super().__init__()
        self.policy_head = policy_head
        self.tau = tau
        self.value_mlp = nn.Sequential(
            nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )
        self.residual = value_init == "critic"
        if self.residual:  # V starts as V_ref exactly; the MLP learns the correction
            nn.init.zeros_(self.value_mlp[-1].weight)
            nn.init.zeros_(self.value_mlp[-1].bias)
        self.scale = math.sqrt(dim)  # unit embeddings have coordinates ~1/sqrt(D)

    def logits(
        self, state: torch.Tensor, cands: torch.Tensor, mask: torch.Tensor, pair: torch.Tensor | None = None
    ) -> torch.Tensor:
        """state (B, D), cands (B, C, D), mask (B, C), pair (B, C, P) or None -> (B, C), -inf where masked."""
        return self.policy_head.q_values(state, cands, mask, pair) / self.tau

    def value(self, state: torch.Tensor, ref_value: torch.Tensor) -> torch.Tensor:
        """state (B, D), ref_value (B,) = V_ref(s) -> (B,)."""
        v = self.value_mlp(state * self.scale).squeeze(-1)  # (B, 1) -> (B,)
        return v + ref_value if self.residual else v


def fresh_like(network: nn.Module, seed: int) -> nn.Module:
    """A network of the same architecture with new weights (the learner's own init), buffers kept
    (a vocabulary network's action embeddings are data, not weights)."""
    from offline_agent.learn.networks import build_network

    torch.manual_seed(seed)
    fresh = build_network(network.config())
    params = {name for name, _ in fresh.named_parameters()}
    state = {k: v for k, v in network.state_dict().items() if k not in params}
    fresh.load_state_dict({**fresh.state_dict(), **state})
    return fresh


def build_actor_critic(network: nn.Module, dim: int, tau: float, config: PPOConfig) -> ActorCritic:
    """The model fine-tuning starts from, around the offline `network` (which it never changes), seeded by
    `config.seed`: the policy head by `config.policy_init` / `from_scratch`, the value head by `value_init`."""
    c = config
    if c.from_scratch:
        head = fresh_like(network, c.seed).requires_grad_(True)
    elif c.policy_init == "residual":
        torch.manual_seed(c.seed)  # the correction's init
        head = ResidualQNetwork.around(network, c.value_hidden, scale=tau)
    else:
        head = copy.deepcopy(network).requires_grad_(True)
    torch.manual_seed(c.seed)  # the value MLP's init
    return ActorCritic(head.train(), tau, dim, c.value_hidden, c.value_init)


def build_optimizer(model: ActorCritic, config: PPOConfig) -> torch.optim.Adam:
    """Adam with two learning rates: a copied policy head is steep and must move slowly (see the module
    docstring), the value head starts from nothing and must catch up with the returns."""
    return torch.optim.Adam(
        [
            {"params": [p for p in model.policy_head.parameters() if p.requires_grad], "lr": config.learning_rate},
            {"params": model.value_mlp.parameters(), "lr": config.value_learning_rate},
        ],
        eps=1e-5,
    )
