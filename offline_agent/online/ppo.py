"""PPO over candidate actions, kept near the offline policy by a KL penalty: the math and one training iteration.

The policy scores the candidates of an observation with the offline checkpoint's
network, so at iteration 0 it *is* the offline policy `softmax(Q / tau)`. By
default (`policy_init="residual"`) the logits are `Q(s, .) / tau + g(s, .)`,
with Q frozen and g a fresh candidate-scoring MLP whose last layer starts at
zero (`ResidualQNetwork`); `"copy"` trains a copy of Q itself. The reference
policy is the frozen offline network. Each step's reward is
`r - beta * KL(pi(.|s) || pi_ref(.|s))` with the KL exact over the (allowed)
candidates (`kl.py`), beta fixed or adapted to a target KL. One iteration
(`PPOTrainer.train_iteration`) reads top to bottom: roll out `num_steps` steps in
each of `num_envs` environments, GAE(gamma, lambda) advantages, `update_epochs`
epochs of clipped-objective minibatch updates, one metrics row.

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

From plain CQL (the offline default until Cal-QL), fine-tuning did not raise success. On PipelineRepair-v0
(offline greedy 20/30; 20 iterations x 4 envs x 64 steps, residual, lr 3e-3) the greedy policy ended at
21/30 with the defaults, 21/30 without `max_update_kl`, 18/30 with an entropy bonus of 0.01 and 22/30 with
no KL penalty at all, and sampled training success stayed at 0.7-0.9 without a trend. The offline policy
is nearly deterministic (entropy ~0.08 nats per step) and its greedy failures are single wrong calls in
particular states: where pi(a|s) ~ 0.99 the gradient of log pi(a|s), (1 - pi), nearly vanishes, and the
alternatives are rarely sampled. The KL penalty is not what holds it back. Three times the steps do not
change that: 60 iterations (15,360 env steps) ended at 21/30 greedy, with sampled success 0.8-0.85 per
20 iterations, both from the checkpoint as it is and from the same checkpoint at tau 0.3 instead of 0.1
(a softer start, entropy ~0.25, whose sampled success rose from 0.74 over the first 5 iterations).

What changed that was the offline start, not PPO. Those runs started from plain CQL, whose greedy
failures were calls that end the episode (`drop_table`, `skip_stage`) taken with probability ~1.0 and
the right call at <= 0.002: nothing to sample, nothing to learn from (`learn/README.md`, "Cal-QL").
From Cal-QL (now the offline default; the same logs and budget), the right call keeps probability
0.02-0.18 at most failing states, and the same PPO defaults, 4 envs x 64 steps, improve it. Greedy
success of the offline Cal-QL policy, then after 20 iterations (5,120 env steps) and after 60 (15,360
env steps):
- 50 episodes, seeds from 1000: 42/50 offline; 49/50 [0.90, 1.00] after 60 iterations (27/30 on the
  first 30 after 20);
- 100 fresh episodes, seeds from 5000: 86/100 [0.78, 0.92] offline, 91/100 after 20, 93/100 [0.86, 0.97]
  after 60.
Sampled training success stayed at 0.89 per 20 iterations (the sampled policy keeps its ~0.2 nats of
entropy); the KL to the offline policy averaged 0.05, its target.

CustomerSupport and Logistics do not improve that way (the online benchmark's grounded CQL runs of the
bundled logs, greedy success on 50 episodes from seed 1000). CustomerSupport's offline policy succeeds
26/50. Its failures: 6 tickets closed with problems open, 4 requests for the card's CVV, 3 deleted accounts,
2 fraud-held accounts unlocked, the rest customers who left after errors. Where it asks for the CVV, it does
so with probability 0.8-0.98. With the residual at lr 1e-2 (4 envs x 64 steps x 60 iterations, 15,360 env
steps), one Adam step already crossed `max_update_kl`. So most iterations took a single minibatch step, and
the KL to the offline policy jumped to 0.6-0.8 per step. CustomerSupport ended at 28/50 with the same 4 CVV
requests and 3 deletions. At the states where the offline policy put 0.98 on the CVV request, the fine-tuned
policy still put 0.95-0.98 on it. Logistics (12/50 offline) stood at 18/50 after 15 iterations and 14/50
after 60. At lr 1e-3 with 8 envs x 64 steps, every iteration takes its 16 minibatch steps. CustomerSupport
rose from 26/50 to 30, 33 and 35/50 after 10, 20 and 30 iterations (0.70 [0.56, 0.81]), though the sampled
training success stayed at 0.4-0.7 without a trend. With that setting the benchmark (24 iterations, 12,288
env steps) took CustomerSupport to 35/50; Logistics went from 12/50 to 17/50 and PipelineRepair stayed at
46/50.

A warmer start (`tau`; the online benchmark with `--tau 0.5`, otherwise the same settings, from CQL runs of the
same logs retrained on 2026-12-01, whose greedy success differs by a few episodes from the runs above). With the
policy and the reference both at tau 0.5 instead of CQL's 0.1, greedy play at iteration 0 is unchanged, the
first rollouts have 1.2-1.3 nats of entropy a step, and PPO samples the alternatives to a confident wrong call.
Greedy success on 50 episodes from seed 1000, offline then after 24 iterations (12,288 env steps):
- PipelineRepair 44/50 -> 48/50 (0.96 [0.87, 0.99]); sampled training success rose from 0.47 to ~0.8;
- CustomerSupport 27/50 -> 40/50 (0.80 [0.67, 0.89]; at tau 0.1 the benchmark had gone from 26 to 35);
  behind `deny:delete_account;regex:CVV` 29/50 -> 41/50, the filter removing 3,469 candidates on the way;
- Logistics 15/50 -> 0/50. Its sampled episodes (15 steps, 1.3 nats of entropy a step) almost never
  succeeded (0-5% per iteration, none after iteration 10), so the score carried no signal. The normalised
  advantages were then noise scaled to unit size, and the policy walked away from the reference. The per-step
  KL rose from 0.01 to 0.98 by iteration 19, twenty times the 0.05 target. The controller, which moves beta
  by at most 20% per 1,000 env steps, only raised beta from 0.06 to 0.20.
A controller five times as fast (`kl_horizon` 200 env steps, otherwise the same run but on 2 torch threads)
held the KL at 0.2 a step at most, but Logistics still fell, to 7/50 (0.14 [0.07, 0.26]): its sampled
success stayed at 0-8% (19% once). So `tau` stays an option (default: the checkpoint's). It helps where
sampling at that temperature still succeeds, and hurts where an episode needs 15 right calls in a row.

Sub-goal shaping (`subgoal_shaping` W, off by default): each step's reward also gets
`W * (gamma * Phi(s') - Phi(s))` with `Phi = sub_goals_done / sub_goals_total` from the environment's info
(0 after an episode's last step). It telescopes, so the best policy is unchanged, but a step that completes a
sub-goal (a Logistics delivery, a CustomerSupport problem explained) is credited at once, and the step that
ends an episode short of its goal gives that credit back. Measured with the runs above (same CQL checkpoints
and settings, W = 1, one seed, greedy success on 50 episodes from seed 1000):
- Logistics at tau 0.5: 0/50 without shaping, **18/50** with it (offline 15/50). Sampled success still stayed
  low (0-8%, 18% once), but deliveries now carried signal. The KL stayed at 0.01-0.14 a step instead of
  drifting to ~1;
- Logistics at the checkpoint's tau 0.1: 16/50 without, 21/50 with (a difference within one run's noise);
- CustomerSupport at tau 0.5: 40/50 without, 41/50 with;
- PipelineRepair at tau 0.5: 48/50 without, 50/50 with (offline 44/50);
- Logistics at tau 0.1, continued to 48 iterations (24,576 env steps): back to 16/50; its sampled success
  stayed at 0.2-0.4 throughout, so PPO at this budget does not move Logistics at either temperature;
- CustomerSupport at tau 0.5 with shaping, continued to 48 iterations: 34/50, below its 41/50 after 24;
- Logistics at tau 0.3 with shaping: **26/50** (0.52 [0.39, 0.65]), the best Logistics run so far; its sampled
  success rose from 0.07 to 0.2-0.5 an iteration and the KL stayed at 0.01-0.13 (not run without shaping).
Shaping stays off by default: it needs an environment that reports sub-goals, and only the tau 0.5 Logistics
run depended on it.

A stronger offline start (the online benchmark's `--logs 400 --cql-steps 2000`: 400 episodes of the same
noisy:0.5 behaviour, simulated anew, and CQL for 2,000 steps instead of 100 bundled episodes and 1,000). The
offline greedy policy is better. PPO adds 10-16 points on top of it, less than the 22-28 it added from the
bundled start, and the fine-tuned policy is still the best one so far. Greedy success on 50
episodes from seed 1000, offline, then after 24 iterations (12,288 env steps), one seed:
- PipelineRepair (tau 0.5, shaping 1): 50/50 -> 50/50;
- CustomerSupport (tau 0.5, shaping 1): 38/50 -> 43/50 (0.86 [0.74, 0.93]); 42/50 after 48 iterations;
- Logistics (tau 0.3, shaping 1): 31/50 -> 39/50 (0.78 [0.65, 0.87]); 38/50 after 48 iterations.
  In the 48-iteration run the KL controller took back what PPO had found. The per-step KL stayed above its
  0.05 target from iteration 7 to 37 (0.05-0.13), so beta climbed from 0.05 to 0.47. The penalty then
  pulled the policy back toward the reference: the KL fell to 0.02-0.03, and sampled success fell from
  0.55-0.65 to 0.3-0.5. With a target KL of 0.15 (the same run otherwise, 24 iterations) it ended at 36/50: a looser
  target let the KL run to 0.12-0.24 a step, and did not lift the greedy policy.

How far a 95% policy must move: along the expert's own trajectories (20 episodes), the bundled CQL
reference at tau 0.3 gives the expert's call 0.59 on average (Logistics; CustomerSupport 0.66,
PipelineRepair 0.63). A policy that put 0.95 on it would sit 0.59-0.64 nats a step from the reference,
against the 0.05 target. That is an upper bound: the reference's greedy call is not the expert's at 29%
of those PipelineRepair states, yet PipelineRepair reached 50/50 at a mean KL of 0.066.

Self-imitation (`self_imitation` W, off by default; `self_imitation.py`): after each PPO update, minibatch
steps of `-log pi(a|s) * max(R - V(s), 0)` over a buffer of the last 2,048 steps of successful episodes
(Oh et al. 2018). PPO uses each rollout once, and the KL penalty takes back the small steps it makes toward a
sampled success; imitation keeps those successes and trains on them again. Measured from the `--logs 400`
starts above (same checkpoints and settings, W = 1, one seed, greedy success on 50 episodes from seed 1000;
offline 31/50 and 38/50, PPO alone 39/50 and 43/50), Logistics then CustomerSupport, with a fixed number of
imitation steps an iteration:
- 4 steps: 41/50 and 41/50; mean KL 0.09 and 0.06 a step;
- 32 steps: 43/50 (0.86 [0.74, 0.93]) and 46/50 (0.92 [0.81, 0.97]). Sampled training success over the last 5
  iterations rose to 0.57 and 0.81 (0.25 and 0.46 over the first 5), at a mean KL of 0.31 and 0.40 a step
  against the 0.05 target, with beta raised from 0.1 to 0.77. But early on it dipped: after 1 and 2 iterations
  Logistics' greedy policy stood at 28/50 and 17/50 (from 31/50), CustomerSupport's at 29/50 after 1 (from
  38/50). 32 steps of 128 rows went 23 times over the 180 steps of Logistics' first successes;
- 128 steps: the policy memorised the early buffer (loss ~0.02) and left the reference (KL 1-1.7 a step);
  Logistics' sampled success fell to 0.04-0.09 within 8 iterations. Stopped there.
Hence `self_imitation_epochs`: the passes over the buffer are fixed (2 by default: 32 steps once the buffer is
full, 3 after Logistics' first iteration), not the steps.
Two passes an iteration (the default), same runs otherwise: **CustomerSupport 48/50 (0.96 [0.87, 0.99])**, the
first CustomerSupport policy at the 95% target, at a mean KL of 0.13 a step (beta 0.35 by the end; sampled
success 0.77 over the last 5 iterations; greedy 37/50, 42/50 and 46/50 after 1, 2 and 4 iterations, so no early
dip); Logistics 39/50 (0.78), level with PPO alone, at a mean KL of 0.06 (32/50, 26/50 and 37/50 after 1, 2 and
4 iterations: exactly 10 points under its start after 2).
Logistics ended higher with the fixed 32 steps (43/50), the run that dipped early; one seed each, and a
difference of 2-4 episodes out of 50 is within noise.

Settings tried on top of that (2026-12-02; the same Logistics start and evaluation, tau 0.3, shaping 1, W = 1,
2 passes, one seed each, 24 iterations unless said), greedy success on the 50 episodes:
- the 2,048-step run continued to 48 iterations (24,576 env steps): 39/50. Sampled success rose to 0.6-0.85,
  but beta rose to 1.2, the penalty (~0.4 a step) dwarfed the score (~0.03) and the value loss grew to 1-5;
- a buffer of 8,192 steps (`self_imitation_buffer`): 41/50; with target KL 0.2: 42/50, and 41/50 after
  48 iterations (beta fell to 0.001, KL 0.15 a step); with a fixed beta of 0.01: 39/50; with target KL 0.2 and
  lr 3e-3: 39/50; with target KL 0.2 and gamma 0.95 (a longer success is worth less, for PPO and for the
  imitation weight): 43/50, and 40/50 with seed 1.
So every variant ends at 39-43/50, sampled success at 0.3-0.7, entropy ~0.9 nats a step. The greedy failures
are relational calls: leaving the warehouse before querying and loading the items still missing (0.2-0.4 on
the query, 0.4-0.7 on the move), moving on from a customer's site without delivering, or driving to the wrong
customer. CustomerSupport's 48/50 did not repeat with other seeds: seeds 1 and 2 (the same settings otherwise)
both ended at 43/50 (0.86), sampled success ~0.7, KL 0.2-0.25 a step.
`self_imitation_start` (a warm-up: no imitation until the buffer holds that many steps) is there for the
early dip; it was not measured on these starts.

From the `--logs 800` starts (CQL 2,000 steps on 800 logged episodes; Logistics at tau 0.3, CustomerSupport at
0.5, shaping 1, W = 1, 2 passes, 24 iterations; 2026-12-02/03), greedy success on the same 50 episodes:
Logistics 35/50 -> 49/50 (seed 0) and 34/50 -> 47/50 (seed 1, another training's start); CustomerSupport
45/50 -> 47/50 (seed 0) and 40/50 -> 45/50 (seed 1). No early dip: the worst policy after 1 or 2 iterations
stood 2 episodes under its start (Logistics seed 1, 32/50); CustomerSupport seed 1 was at 49/50 after one
iteration and 44/50 after two. The starts differ because CQL on two threads was not yet deterministic.
From the start retrained deterministically (the benchmark's `logs800` tables): Logistics 37/50 -> 49/50,
but 30/50 and 26/50 after 1 and 2 iterations (an early dip of 22 points); CustomerSupport 43/50 -> 48/50,
40/50 and 43/50 after 1 and 2.

The KL gradient: `-beta * KL(pi(.|s) || pi_ref(.|s))` is in the rewards (what the
issue asks, and what GAE discounts), but the penalty at s does not depend on the
action taken at s, so the clipped objective carries no gradient that moves
pi(.|s) back toward pi_ref(.|s). `kl_gradient` (on by default) adds that direct
gradient, `beta * KL` of each minibatch state, to the loss; without it the
penalty only steers away from states where the KL is high.

Determinism: sampling and minibatch order use one seeded `torch.Generator`;
episodes run on across iterations, but every `checkpoint_every` iterations (and
only there) the environments are re-seeded from (seed, iteration) and reset (an
episode cut there is bootstrapped with V), so no environment state has to
survive a checkpoint and a resumed run resets exactly where the uninterrupted
one did. The new texts of a step (every environment's state, new candidates)
are embedded in one padded batch, and a text's vector depends by ~1e-7 on which
texts were new with it (padding changes the kernels' shapes), that is on what
the run's text -> vector memo held; so the memo (`Featurizer.memo`, bounded) is
saved with each checkpoint and restored on resume, and the resumed run meets the
very vectors and the same batches. (Encoding each text alone, as rollouts did
before, kept the vectors independent of the memo. In fp32 on CPU the batch gains
little, 0-15% at 8 environments, since one ~200-token text already fills the
matrix products; a bf16 encoder gains ~1.8x: benchmarks/results/rollout_speed.md.)
With those, a resumed run repeats an uninterrupted one bit for bit (see `finetune.py`).

Dimension letters: T rollout steps per environment, N environments, B rows (T * N or a minibatch),
C candidate slots, D embedding width, H hidden width.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from offline_agent.actions import canonical_action
from offline_agent.envs.loading import task_text
from offline_agent.errors import UserError
from offline_agent.learn.grounding import PAIR_DIM, grounding_batch
from offline_agent.learn.networks import ResidualQNetwork
from offline_agent.online.kl import (
    AdaptiveKLController,
    FixedKLController,
    entropy,
    exact_kl,
    masked_log_softmax,
)
from offline_agent.online.safety import ALL_FORBIDDEN, SafetyFilter, add_blocked
from offline_agent.online.self_imitation import Step, SuccessBuffer, self_imitation_loss
from offline_agent.online.validation import KEEP_RULES, VALIDATION_SEED
from offline_agent.online.vector import VectorMode, make_vector_env

#: Metric names of one iteration (a stable contract; `safety/blocked/<rule>` columns are added per rule).
METRICS = (
    "iteration",
    "env_steps",
    "objective/kl",
    "objective/beta",
    "objective/non_score_reward",
    "objective/score",
    "objective/shaping",
    "policy/approx_kl",
    "policy/clipfrac",
    "policy/entropy",
    "policy/update_steps",
    "loss/policy",
    "loss/value",
    "loss/kl",
    "loss/self_imitation",
    "self_imitation/buffer_steps",
    "charts/success_rate",
    "charts/episode_return",
    "charts/episode_length",
    "charts/episodes",
    "safety/blocked",
    "safety/truncated",
    "time/steps_per_second",
)
DEFAULT_TARGET_KL = 0.05
#: A copy of the offline Q network is steep (logits = Q / tau); a residual correction is in logit units.
DEFAULT_LEARNING_RATES = {"residual": 3e-3, "copy": 1e-5}


@dataclass
class PPOConfig:
    """Settings of a fine-tuning run; `__post_init__` rejects values that cannot work, naming the fix."""

    iterations: int = field(default=20, metadata={"help": "rollout + update iterations"})
    num_envs: int = field(default=4, metadata={"help": "environments stepped in parallel"})
    num_steps: int = field(default=128, metadata={"help": "steps per environment per rollout (T)"})
    policy_init: Literal["residual", "copy"] = field(
        default="residual",
        metadata={"help": "residual: train a zero-initialised correction of the frozen offline network; "
                  "copy: train a copy of it"},
    )
    learning_rate: float | None = field(
        default=None,
        metadata={"help": f"Adam learning rate of the policy (default: {DEFAULT_LEARNING_RATES})"},
    )
    value_learning_rate: float | None = field(
        default=None, metadata={"help": "Adam learning rate of the value head (default: learning_rate)"}
    )
    anneal_lr: bool = field(default=False, metadata={"help": "decay the learning rates linearly to 0"})
    gamma: float = field(default=0.99, metadata={"help": "discount factor, in [0, 1]"})
    gae_lambda: float = field(default=0.95, metadata={"help": "GAE lambda, in [0, 1]"})
    update_epochs: int = field(default=4, metadata={"help": "passes over each rollout"})
    num_minibatches: int = field(default=4, metadata={"help": "minibatches per pass"})
    clip_coef: float = field(default=0.2, metadata={"help": "PPO ratio clipping epsilon, > 0"})
    max_update_kl: float | None = field(
        default=0.02,
        metadata={"help": "stop an iteration's updates once KL(pi_old || pi_new) of a minibatch exceeds this"},
    )
    ent_coef: float = field(default=0.0, metadata={"help": "entropy bonus weight, >= 0"})
    kl_gradient: bool = field(
        default=True,
        metadata={"help": "add beta * KL(pi || pi_ref) of minibatch states to the loss (the penalty's own gradient)"},
    )
    vf_coef: float = field(default=0.5, metadata={"help": "value loss weight, >= 0"})
    max_grad_norm: float = field(default=0.5, metadata={"help": "global gradient-norm clip, > 0"})
    norm_adv: bool = field(default=True, metadata={"help": "normalise advantages per minibatch"})
    beta: float | None = field(default=None, metadata={"help": "fixed KL weight (--beta); excludes target_kl"})
    target_kl: float | None = field(
        default=None, metadata={"help": f"adaptive KL target per step (--target-kl); default {DEFAULT_TARGET_KL}"}
    )
    init_beta: float = field(default=0.1, metadata={"help": "starting beta of the adaptive controller, > 0"})
    kl_horizon: int = field(
        default=1_000, metadata={"help": "env steps over which the controller moves beta by 20% at most"}
    )
    tau: float | None = field(
        default=None,
        metadata={"help": "temperature of the fine-tuned and the reference policy, softmax(Q / tau), > 0 "
                  "(default: the checkpoint's)"},
    )
    subgoal_shaping: float = field(
        default=0.0,
        metadata={"help": "weight W of potential-based shaping on the environment's sub-goals, "
                  "W * (gamma * Phi(s') - Phi(s)) with Phi = sub_goals_done / sub_goals_total; 0 = off"},
    )
    self_imitation: float = field(
        default=0.0,
        metadata={"help": "weight of self-imitation (Oh et al. 2018): after each PPO update, "
                  "self_imitation_epochs passes of minibatch steps of -log pi(a|s) * max(R - V(s), 0) over the "
                  "steps of recent successful episodes (see self_imitation.py); 0 = off"},
    )
    self_imitation_epochs: float = field(
        default=2.0,
        metadata={"help": "passes over the success buffer per iteration, in minibatches of minibatch_size rows "
                  "(ceil(epochs * buffer steps / minibatch_size) steps: few while the buffer is small), > 0"},
    )
    self_imitation_buffer: int = field(
        default=2048, metadata={"help": "steps of successful episodes kept for self-imitation (the most recent)"}
    )
    self_imitation_start: int = field(
        default=0,
        metadata={"help": "steps of successful episodes the buffer must hold before self-imitation begins "
                  "(a warm-up: the first few successes, imitated again and again, can dip the policy); 0 = at once"},
    )
    value_init: Literal["critic", "zero"] = field(
        default="zero", metadata={"help": "critic: V = V_ref(s) + MLP residual; zero: a fresh MLP"}
    )
    value_hidden: int = field(
        default=128, metadata={"help": "hidden width of the value MLP (and of the residual policy's correction)"}
    )
    from_scratch: bool = field(
        default=False, metadata={"help": "re-initialise the policy head (the PPO-from-scratch baseline)"}
    )
    validation_episodes: int = field(
        default=0,
        metadata={"help": "play the offline policy, then each iteration's, greedily on this many held-out "
                  "validation episodes and keep one by `validation_keep` instead of the last; 0 = off"},
    )
    validation_keep: Literal["best", "guard"] = field(
        default="best",
        metadata={"help": "best: the most validation successes; guard: the latest policy with at least the offline "
                  "policy's, the offline one until then (validation.py)"},
    )
    validation_seed: int = field(
        default=VALIDATION_SEED, metadata={"help": "seed of the validation episodes (episode i: episode_seed(seed, i))"}
    )
    checkpoint_every: int = field(
        default=5,
        metadata={"help": "iterations between resumable checkpoints; the environments are re-seeded and reset there"},
    )
    seed: int = field(default=0, metadata={"help": "seed of sampling, minibatches and environments"})
    vector: VectorMode = field(default="auto", metadata={"help": "auto | sync | process environments"})
    torch_threads: int = field(default=1, metadata={"help": "torch intra-op threads (fixed: results depend on it)"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})

    def __post_init__(self) -> None:
        if self.beta is not None and self.target_kl is not None:
            raise UserError(
                f"--beta {self.beta} (fixed) and --target-kl {self.target_kl} (adaptive) exclude each other: give one"
            )
        if self.target_kl is not None and not self.target_kl > 0:
            raise UserError(f"--target-kl must be > 0, got {self.target_kl}; e.g. 0.05, or use --beta 0 for no KL")
        if self.beta is not None and not self.beta >= 0:
            raise UserError(f"--beta must be >= 0, got {self.beta}; e.g. 0.1 (0 turns the KL penalty off)")
        if self.beta is None and self.target_kl is None:
            self.target_kl = DEFAULT_TARGET_KL
        if self.tau is not None and not self.tau > 0:
            raise UserError(f"--tau must be > 0, got {self.tau}; e.g. 0.5 (leave it out to keep the checkpoint's)")
        positive = ("iterations", "num_envs", "num_steps", "update_epochs", "num_minibatches", "kl_horizon")
        positive += ("checkpoint_every", "self_imitation_buffer")
        for name in positive + ("value_hidden", "torch_threads"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_minibatches > self.num_envs * self.num_steps:
            raise UserError(
                f"num_minibatches {self.num_minibatches} exceeds the {self.num_envs * self.num_steps} steps of a "
                "rollout: use fewer minibatches or more --num-steps"
            )
        for name in ("gamma", "gae_lambda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.max_update_kl is not None and not self.max_update_kl > 0:
            raise UserError(f"max_update_kl must be > 0 (or None to never stop early), got {self.max_update_kl}")
        if self.policy_init not in DEFAULT_LEARNING_RATES:
            raise UserError(f"policy_init must be residual or copy, got {self.policy_init!r}")
        if self.from_scratch:  # a fresh network is trained whole: there is no offline network to correct
            self.policy_init = "copy"
        if self.learning_rate is None:
            self.learning_rate = DEFAULT_LEARNING_RATES[self.policy_init]
        if self.value_learning_rate is None:
            self.value_learning_rate = self.learning_rate
        for name in ("learning_rate", "value_learning_rate", "clip_coef", "max_grad_norm", "init_beta",
                     "self_imitation_epochs"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("ent_coef", "vf_coef", "subgoal_shaping", "self_imitation", "self_imitation_start",
                     "validation_episodes"):
            if not getattr(self, name) >= 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.validation_keep not in KEEP_RULES:
            raise UserError(f"validation_keep must be one of {', '.join(KEEP_RULES)}, got {self.validation_keep!r}")
        if self.value_init not in ("critic", "zero"):
            raise UserError(f"value_init must be critic or zero, got {self.value_init!r}")
        if self.vector not in ("auto", "sync", "process"):
            raise UserError(f"vector must be auto, sync or process, got {self.vector!r}")

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches


# --- the math --------------------------------------------------------------------------------------


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    next_value: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over a rollout of N environments.

    rewards, values: (T, N) float32; dones: (T, N) float32, 1 where step t ended its episode (the
    observation after it belongs to a new episode); next_value: (N,) V of the observation after step T-1.
    `delta_t = r_t + gamma * V_{t+1} * (1 - d_t) - V_t`, `A_t = delta_t + gamma * lam * (1 - d_t) * A_{t+1}`.
    Returns (advantages, returns = advantages + values), both (T, N).
    """
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        next_values = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_values * not_done - values[t]
        last = delta + gamma * lam * not_done * last
        advantages[t] = last
    return advantages, advantages + values


@dataclass(frozen=True)
class PolicyLoss:
    """The clipped surrogate loss of a minibatch and its diagnostics."""

    loss: torch.Tensor  # () differentiable
    clipfrac: float  # share of rows whose ratio left [1 - clip, 1 + clip]
    approx_kl: float  # k3 estimate of KL(pi_old || pi_new): mean((r - 1) - log r)


def clipped_policy_loss(
    new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip: float
) -> PolicyLoss:
    """PPO's clipped objective, as a loss: `mean(max(-A r, -A clip(r, 1 - clip, 1 + clip)))`, r = pi_new / pi_old.

    new_logp, old_logp, advantages: (B,) float32 (log-probabilities of the actions taken).
    """
    log_ratio = new_logp - old_logp
    ratio = log_ratio.exp()
    loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)).mean()
    with torch.no_grad():
        clipfrac = float(((ratio - 1.0).abs() > clip).float().mean())
        approx_kl = float(((ratio - 1.0) - log_ratio).mean())
    return PolicyLoss(loss, clipfrac, approx_kl)


def expected_value(logp: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """V(s) = sum_a pi(a|s) Q(s, a) over valid candidates: logp, q (B, C) (-inf where masked), mask (B, C) -> (B,)."""
    return (mask * logp.masked_fill(~mask, 0.0).exp() * q.masked_fill(~mask, 0.0)).sum(-1)


def subgoal_potential(info: dict[str, Any] | None) -> float:
    """Phi of the state after a step: the share of its episode's sub-goals done (`sub_goals_done /
    sub_goals_total` of the step's info), 0 where the environment does not report them."""
    done, total = (info or {}).get("sub_goals_done"), (info or {}).get("sub_goals_total")
    return float(done) / float(total) if done is not None and total else 0.0


def shaping_reward(potential: np.ndarray, next_potential: np.ndarray, done: np.ndarray, gamma: float) -> np.ndarray:
    """Potential-based shaping (Ng, Harada & Russell 1999) of N steps: `gamma * Phi(s') * (1 - done) - Phi(s)`.

    potential, next_potential: (N,) Phi before and after each step; done: (N,) bool (terminated or truncated:
    GAE does not bootstrap past either). Phi of the state after an episode's last step is 0, so an episode's
    shaping terms sum (discounted) to -Phi(s_0): the best policy is unchanged, but a step that completes a
    sub-goal is credited at once, and the step that ends an episode short of its goal gives back what was
    credited.
    """
    return gamma * np.where(done, 0.0, next_potential) - potential


def imitation_steps(buffer_steps: int, epochs: float, minibatch_size: int) -> int:
    """Minibatch steps that pass `epochs` times over a buffer of `buffer_steps` rows: ceil(epochs * K / b)."""
    return math.ceil(epochs * buffer_steps / minibatch_size)


def normalize(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / (std + 1e-8); a single row is left centred only."""
    if x.numel() < 2:
        return x - x.mean()
    return (x - x.mean()) / (x.std() + 1e-8)


# --- the model -------------------------------------------------------------------------------------


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


# --- from observations to tensors --------------------------------------------------------------------


class Featurizer:
    """Observations of N environments as tensors, rendered exactly as the offline policy renders states.

    Keeps each environment's episode history (task, turns) and a bounded text -> vector memo
    (`offline_agent.embed.EmbeddingMemo`): candidate texts and early states repeat a lot, and the encoder is
    the slowest thing in a rollout. The memo is part of a run's resume state (see the module docstring).
    """

    def __init__(self, reference: Any, num_envs: int, max_candidates: int):
        from offline_agent.embed import EmbeddingMemo
        from offline_agent.learn.policy import EpisodeHistory

        self.reference = reference
        self.histories = [EpisodeHistory() for _ in range(num_envs)]
        self.max_candidates = max_candidates
        self.dim = int(reference.encoder.dim)
        self.grounded = bool(getattr(reference.network, "pair_dim", 0))  # the policy reads each pair's grounding
        self.memo = EmbeddingMemo(reference.encoder)

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


# --- the trainer -------------------------------------------------------------------------------------


class PPOTrainer:
    """Fine-tunes a copy of `reference.network` in `env_spec`; `train_iteration()` runs one iteration.

    `reference` is a loaded `offline_agent.learn.policy.Policy` (network, encoder, renderer, tau).
    Everything a resume needs is in `model`, `optimizer`, `kl_controller`, `generator`, `iteration`
    and `env_steps` (see `finetune.py`).
    """

    def __init__(
        self, reference: Any, env_spec: str, config: PPOConfig, safety: SafetyFilter | None = None, envs: Any = None
    ):
        self.config = c = config
        self.env_spec = env_spec
        self.safety = safety or SafetyFilter()
        self.device = torch.device(c.device)
        self.reference = reference
        self.reference_net = reference.network.to(self.device).eval().requires_grad_(False)
        # One temperature for both: with the checkpoint's Q, the policy at iteration 0 is the reference.
        self.tau = float(reference.tau if c.tau is None else c.tau)
        if c.from_scratch:
            head = fresh_like(reference.network, c.seed).requires_grad_(True)
        elif c.policy_init == "residual":
            torch.manual_seed(c.seed)  # the correction's init
            head = ResidualQNetwork.around(reference.network, c.value_hidden, scale=self.tau)
        else:
            head = copy.deepcopy(reference.network).requires_grad_(True)
        torch.manual_seed(c.seed)  # the value MLP's init
        self.model = ActorCritic(
            head.train(), self.tau, int(reference.encoder.dim), c.value_hidden, c.value_init
        ).to(self.device)
        # Two learning rates: a copied policy head is steep and must move slowly (see the module docstring),
        # the value head starts from nothing and must catch up with the returns.
        self.optimizer = torch.optim.Adam(
            [
                {"params": [p for p in self.model.policy_head.parameters() if p.requires_grad], "lr": c.learning_rate},
                {"params": self.model.value_mlp.parameters(), "lr": c.value_learning_rate},
            ],
            eps=1e-5,
        )
        self.kl_controller: FixedKLController | AdaptiveKLController = (
            FixedKLController(c.beta)
            if c.beta is not None
            else AdaptiveKLController(c.init_beta, c.target_kl, c.kl_horizon)
        )
        self.generator = torch.Generator().manual_seed(c.seed)
        self.iteration = 0
        self.env_steps = 0
        self.observations: list[dict[str, Any]] | None = None  # what to act on next; None = reset first
        self.running_return = np.zeros(c.num_envs)
        self.running_length = np.zeros(c.num_envs, dtype=np.int64)
        # Phi of each environment's current state (subgoal_shaping). Like the running returns it lives only
        # between checkpoints: every environment is reset at a checkpoint, so a resume needs none of it.
        self.potential = np.zeros(c.num_envs)
        # `envs`: environments built by the caller behind this safety filter (Ray actors, `RayVectorEnv`).
        self.envs = envs if envs is not None else make_vector_env(env_spec, c.num_envs, self.safety.specs, c.vector)
        self.featurizer = Featurizer(reference, c.num_envs, self.envs.max_candidates)
        T, N, C, D = c.num_steps, c.num_envs, self.envs.max_candidates, int(reference.encoder.dim)
        # Rollout storage, preallocated with its shape.
        self.obs_state = torch.zeros(T, N, D)
        self.obs_cands = torch.zeros(T, N, C, D)
        self.obs_pair = torch.zeros(T, N, C, PAIR_DIM) if self.featurizer.grounded else None
        self.masks = torch.zeros(T, N, C, dtype=torch.bool)
        self.actions = torch.zeros(T, N, dtype=torch.long)
        self.logprobs = torch.zeros(T, N)
        self.values = torch.zeros(T, N)
        self.ref_values = torch.zeros(T, N)
        self.ref_logps = torch.zeros(T, N, C)  # log pi_ref over the candidates, -inf in padding slots
        self.rewards = torch.zeros(T, N)  # r + shaping - beta * KL
        self.scores = torch.zeros(T, N)  # r, the environment's reward
        self.shaping = torch.zeros(T, N)  # W * (gamma * Phi(s') - Phi(s)), 0 without subgoal_shaping
        self.kls = torch.zeros(T, N)
        self.dones = torch.zeros(T, N)
        pair_dim = PAIR_DIM if self.featurizer.grounded else None
        self.success_buffer = (
            SuccessBuffer(c.self_imitation_buffer, N, C, D, pair_dim) if c.self_imitation > 0 else None
        )

    def close(self) -> None:
        self.envs.close()

    def env_seeds(self, iteration: int) -> list[int]:
        """Reset seeds of the environments at the start of `iteration`, a function of (seed, iteration) only."""
        seeds = np.random.SeedSequence([self.config.seed, iteration]).generate_state(self.config.num_envs)
        return [int(s) for s in seeds]

    @torch.no_grad()
    def reference_policy(
        self, state: torch.Tensor, cands: torch.Tensor, mask: torch.Tensor, pair: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi_ref (N, C) over the candidates and the offline critic's V_ref(s) (N,) of N observations."""
        ref_q = self.reference_net.q_values(state, cands, mask, pair)  # (N, C)
        ref_logp = masked_log_softmax(ref_q / self.tau, mask)
        return ref_logp, expected_value(ref_logp, ref_q, mask)

    @torch.no_grad()
    def policy_step(
        self, state: torch.Tensor, cands: torch.Tensor, mask: torch.Tensor, pair: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """Sample actions and everything the rollout stores about them, for N observations."""
        dev = self.device
        state, cands, mask = state.to(dev), cands.to(dev), mask.to(dev)
        pair = None if pair is None else pair.to(dev)
        logp = masked_log_softmax(self.model.logits(state, cands, mask, pair), mask)  # (N, C)
        ref_logp, ref_value = self.reference_policy(state, cands, mask, pair)
        action = torch.multinomial(logp.exp().cpu(), 1, generator=self.generator).squeeze(1)  # (N,)
        return {
            "action": action,
            "logprob": logp.gather(1, action.to(dev)[:, None]).squeeze(1).cpu(),
            "value": self.model.value(state, ref_value).cpu(),
            "ref_value": ref_value.cpu(),
            "ref_logp": ref_logp.cpu(),
            "kl": exact_kl(logp, ref_logp, mask).cpu(),
        }

    def train_iteration(self) -> dict[str, float]:
        """One iteration: rollout, advantages, update; returns its metrics row."""
        c, start = self.config, time.perf_counter()
        if c.anneal_lr:
            for group, lr in zip(self.optimizer.param_groups, (c.learning_rate, c.value_learning_rate), strict=True):
                group["lr"] = lr * (1.0 - self.iteration / c.iterations)
        beta = self.kl_controller.beta
        stats = self.collect_rollout(beta)
        with torch.no_grad():
            state, cands, mask, pair = self.featurizer.tensors(self.observations)
            _, ref_value = self.reference_policy(state, cands, mask, pair)
            next_value = self.model.value(state, ref_value)
        advantages, returns = gae(self.rewards, self.values, self.dones, next_value, c.gamma, c.gae_lambda)
        update = self.update(advantages, returns, beta)
        update |= self.imitate()
        mean_kl = float(self.kls.mean())
        self.kl_controller.update(mean_kl, c.batch_size)
        self.iteration += 1
        self.env_steps += c.batch_size
        return {
            "iteration": self.iteration,
            "env_steps": self.env_steps,
            "objective/kl": mean_kl,
            "objective/beta": beta,
            "objective/non_score_reward": float((-beta * self.kls).mean()),
            "objective/score": float(self.scores.mean()),
            "objective/shaping": float(self.shaping.mean()),
            **update,
            **stats,
            "time/steps_per_second": c.batch_size / (time.perf_counter() - start),
        }

    def collect_rollout(self, beta: float) -> dict[str, float]:
        """Fill the storage with `num_steps` steps of each environment; returns episode and safety statistics."""
        c, f = self.config, self.featurizer
        blocked: dict[str, int] = dict.fromkeys(self.safety_metric_names(), 0)
        if self.observations is None or self.iteration % c.checkpoint_every == 0:
            self.observations, reset_infos = self.envs.reset(self.env_seeds(self.iteration))
            for i, info in enumerate(reset_infos):
                f.start(i, task_text(info, None, self.observations[i]))
                add_blocked(blocked, (info or {}).get("safety_blocked"))
                self.potential[i] = subgoal_potential(info)
            self.running_return[:], self.running_length[:] = 0.0, 0
            if self.success_buffer is not None:
                self.success_buffer.drop_open()
        observations, running_return, running_length = self.observations, self.running_return, self.running_length
        successes, episode_returns, episode_lengths, safety_truncated = [], [], [], 0
        for t in range(c.num_steps):
            state, cands, mask, pair = f.tensors(observations)
            out = self.policy_step(state, cands, mask, pair)
            self.obs_state[t], self.obs_cands[t], self.masks[t] = state, cands, mask
            if self.obs_pair is not None:
                self.obs_pair[t] = pair
            self.actions[t], self.logprobs[t], self.values[t] = out["action"], out["logprob"], out["value"]
            self.ref_values[t], self.ref_logps[t], self.kls[t] = out["ref_value"], out["ref_logp"], out["kl"]
            actions = out["action"].tolist()
            step = self.envs.step(actions)
            done = step.terminated | step.truncated
            self.scores[t] = torch.as_tensor(step.rewards, dtype=torch.float32)
            next_potential = np.array([subgoal_potential(info) for info in step.infos])
            bonus = shaping_reward(self.potential, next_potential, done, c.gamma)
            self.shaping[t] = torch.as_tensor(c.subgoal_shaping * bonus, dtype=torch.float32)
            self.rewards[t] = self.scores[t] + self.shaping[t] - beta * self.kls[t]
            self.dones[t] = torch.as_tensor(done, dtype=torch.float32)
            running_return += step.rewards
            running_length += 1
            for i in range(c.num_envs):
                add_blocked(blocked, (step.infos[i] or {}).get("safety_blocked"))
                if self.success_buffer is not None:
                    self.remember(t, i, pair)
                    if done[i]:
                        self.success_buffer.end_episode(i, bool(step.infos[i].get("success", False)), c.gamma)
                if not done[i]:
                    f.record(i, observations[i]["text"], f.last_actions[i][actions[i]])
                    continue
                successes.append(bool(step.infos[i].get("success", False)))
                episode_returns.append(float(running_return[i]))
                episode_lengths.append(int(running_length[i]))
                safety_truncated += step.infos[i].get("safety") == ALL_FORBIDDEN
                running_return[i], running_length[i] = 0.0, 0
                f.start(i, task_text(step.reset_infos[i], None, step.observations[i]))
                add_blocked(blocked, (step.reset_infos[i] or {}).get("safety_blocked"))
                next_potential[i] = subgoal_potential(step.reset_infos[i])
            observations = step.observations
            self.potential[:] = next_potential
        self.observations = observations
        nan = float("nan")
        return {
            "charts/success_rate": float(np.mean(successes)) if successes else nan,
            "charts/episode_return": float(np.mean(episode_returns)) if episode_returns else nan,
            "charts/episode_length": float(np.mean(episode_lengths)) if episode_lengths else nan,
            "charts/episodes": float(len(successes)),
            "safety/blocked": float(sum(blocked.values())) if blocked else 0.0,
            "safety/truncated": float(safety_truncated),
            **{f"safety/blocked/{name}": float(n) for name, n in blocked.items()},
        }

    def remember(self, t: int, env: int, pair: torch.Tensor | None) -> None:
        """Step t of environment `env`, copied out of the rollout storage (which the next rollout overwrites
        while the episode may still be open) into its open episode (self-imitation)."""
        assert self.success_buffer is not None
        step = Step(
            self.obs_state[t, env].clone(), self.obs_cands[t, env].clone(), self.masks[t, env].clone(),
            None if pair is None else pair[env].clone(), self.ref_values[t, env].clone(),
            int(self.actions[t, env]), float(self.rewards[t, env]),
        )
        self.success_buffer.record(env, step)

    def imitate(self) -> dict[str, float]:
        """`self_imitation_epochs` passes of self-imitation minibatch steps over the success buffer (none when
        it is off, empty or holds fewer than `self_imitation_start` steps); returns the mean loss (before its
        weight) and the buffer's size.

        The passes, not a number of steps, are fixed: a fixed 32 steps an iteration went 23 times over the 180
        steps of Logistics' first successes, and the greedy policy fell from 0.62 to 0.34 in two iterations.
        """
        c, dev, buffer = self.config, self.device, self.success_buffer
        size = 0 if buffer is None else buffer.size
        if size == 0 or size < c.self_imitation_start:  # off, empty, or still warming up
            return {"loss/self_imitation": 0.0, "self_imitation/buffer_steps": float(size)}
        steps = imitation_steps(size, c.self_imitation_epochs, c.minibatch_size)
        total = 0.0
        for _ in range(steps):
            rows = buffer.sample(c.minibatch_size, self.generator)
            state, mask = buffer.state[rows].to(dev), buffer.mask[rows].to(dev)
            pair = None if buffer.pair is None else buffer.pair[rows].to(dev)
            logp = masked_log_softmax(self.model.logits(state, buffer.cands[rows].to(dev), mask, pair), mask)
            taken = logp.gather(1, buffer.action[rows].to(dev)[:, None]).squeeze(1)  # (b,)
            with torch.no_grad():
                values = self.model.value(state, buffer.ref_value[rows].to(dev))
            loss = self_imitation_loss(taken, buffer.returns[rows].to(dev), values)
            self.optimizer.zero_grad(set_to_none=True)
            (c.self_imitation * loss).backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm)
            self.optimizer.step()
            total += loss.item()
        mean_loss = total / steps
        return {"loss/self_imitation": mean_loss, "self_imitation/buffer_steps": float(size)}

    def safety_metric_names(self) -> list[str]:
        names = []
        for rule in self.safety.rules:
            tools = getattr(rule, "tools", None)
            names += [f"deny:{t}" for t in sorted(tools)] if tools is not None else [rule.spec]
        return names

    def update(self, advantages: torch.Tensor, returns: torch.Tensor, beta: float) -> dict[str, float]:
        """`update_epochs` passes of clipped-PPO minibatch steps over the flattened rollout.

        The rollout's rewards carry `-beta * KL(pi(.|s) || pi_ref(.|s))`, a function of the policy's own
        parameters. The score-function (PPO) gradient sees only how an action changes the states that come
        after it, not that the penalty at s shrinks when pi(.|s) moves toward pi_ref; with `kl_gradient`
        that direct gradient is added, as `beta * KL` of each minibatch state in the loss.
        """
        c, dev = self.config, self.device
        C, D = self.obs_cands.shape[2], self.obs_cands.shape[3]
        b_state = self.obs_state.reshape(-1, D).to(dev)  # (T, N, D) -> (B, D)
        b_cands = self.obs_cands.reshape(-1, C, D).to(dev)  # (T, N, C, D) -> (B, C, D)
        b_mask = self.masks.reshape(-1, C).to(dev)  # (T, N, C) -> (B, C)
        b_pair = None if self.obs_pair is None else self.obs_pair.reshape(-1, C, PAIR_DIM).to(dev)  # (B, C, P)
        b_actions = self.actions.reshape(-1).to(dev)  # (T, N) -> (B,)
        b_logprobs = self.logprobs.reshape(-1).to(dev)
        b_ref_values = self.ref_values.reshape(-1).to(dev)
        b_ref_logps = self.ref_logps.reshape(-1, C).to(dev)  # (T, N, C) -> (B, C)
        b_advantages = advantages.reshape(-1).to(dev)
        b_returns = returns.reshape(-1).to(dev)
        names = ("loss/policy", "loss/value", "loss/kl", "policy/entropy", "policy/clipfrac", "policy/approx_kl")
        sums = dict.fromkeys(names, 0.0)
        n_updates, stop = 0, False
        self.model.train()
        for _ in range(c.update_epochs):
            if stop:
                break
            order = torch.randperm(c.batch_size, generator=self.generator)
            for start in range(0, c.batch_size - c.minibatch_size + 1, c.minibatch_size):
                mb = order[start : start + c.minibatch_size].to(dev)
                mb_mask = b_mask[mb]
                mb_pair = None if b_pair is None else b_pair[mb]
                logits = self.model.logits(b_state[mb], b_cands[mb], mb_mask, mb_pair)
                logp = masked_log_softmax(logits, mb_mask)  # (b, C)
                new_logp = logp.gather(1, b_actions[mb][:, None]).squeeze(1)  # (b,)
                mb_advantages = normalize(b_advantages[mb]) if c.norm_adv else b_advantages[mb]
                pg = clipped_policy_loss(new_logp, b_logprobs[mb], mb_advantages, c.clip_coef)
                ent = entropy(logp, mb_mask).mean()
                v_loss = 0.5 * (self.model.value(b_state[mb], b_ref_values[mb]) - b_returns[mb]).pow(2).mean()
                kl_loss = beta * exact_kl(logp, b_ref_logps[mb], mb_mask).mean()
                loss = pg.loss - c.ent_coef * ent + c.vf_coef * v_loss + (kl_loss if c.kl_gradient else 0.0)
                # Stop before a step that would carry the policy further from the rollout's (most needed by a
                # copied head, whose logits move 1/tau times as much as its weights).
                if n_updates and c.max_update_kl is not None and pg.approx_kl > c.max_update_kl:
                    stop = True
                    break
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm)
                self.optimizer.step()
                values = (pg.loss.item(), v_loss.item(), kl_loss.item(), ent.item(), pg.clipfrac, pg.approx_kl)
                for key, value in zip(names, values, strict=True):
                    sums[key] += value
                n_updates += 1
        return {**{key: value / n_updates for key, value in sums.items()}, "policy/update_steps": float(n_updates)}

