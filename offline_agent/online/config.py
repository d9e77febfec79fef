"""The settings of a fine-tuning run: `PPOConfig`, its validation, and the metric names of an iteration.

Each field carries its help text; `__post_init__` rejects values that cannot work, naming the value and the
fix, and fills the defaults that depend on other fields (the learning rates on `policy_init`, the adaptive KL
target unless a fixed beta is given). Why the defaults are what they are is written beside the code that
uses them: the policy and value heads in `actor_critic.py`, sub-goal shaping in `losses.py`, self-imitation
in `self_imitation.py`, the KL gradient and the runs behind the rest in `ppo.py`. The temperature's runs are
here, since `tau` is only a setting:

A warmer start (`tau`; the online benchmark with `--tau 0.5`, otherwise the same settings, from CQL runs of the
same logs retrained on 2026-12-01, whose greedy success differs by a few episodes from the runs in `ppo.py`). With the
policy and the reference both at tau 0.5 instead of CQL's 0.1, greedy play at iteration 0 is unchanged, the
first rollouts have 1.2-1.3 nats of entropy a step, and PPO samples the alternatives to a confident wrong call.
Greedy success on 50 episodes from seed 1000, offline then after 24 iterations (12,288 env steps):
- PipelineRepair 44/50 -> 48/50 (0.96 [0.87, 0.99]); sampled training success rose from 0.47 to ~0.8;
- CustomerSupport 27/50 -> 40/50 (0.80 [0.67, 0.89]; at tau 0.1 the benchmark had gone from 26 to 35);
  behind `deny:delete_account;regex:CVV` 29/50 -> 41/50, the filter removing 3,469 candidates on the way;
- Logistics 15/50 -> 0/50. Its sampled episodes (15 steps, 1.3 nats of entropy a step) almost never
  succeeded (0-5% per iteration, none after iteration 10), so the score carried no signal. The normalised
  advantages were then noise scaled to unit size, and the policy walked away from the reference. The per-step
  KL rose from 0.01 to 0.98 by iteration 19, twenty times the 0.05 target. The controller of the time, which
  moved beta by at most 20% per 1,000 env steps, only raised beta from 0.06 to 0.20 (today's: `kl.py`).
A controller five times as fast (a 200-step horizon, otherwise the same run but on 2 torch threads)
held the KL at 0.2 a step at most, but Logistics still fell, to 7/50 (0.14 [0.07, 0.26]): its sampled
success stayed at 0-8% (19% once). So a warm tau helps where sampling at that temperature still succeeds, and
hurts where an episode needs 15 right calls in a row. The default, 0.3, is the temperature of the recipe that
held on all three simulators with today's KL control and self-imitation (`DEFAULT_TARGET_KL` below).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from offline_agent.errors import UserError
from offline_agent.online.validation import KEEP_RULES, VALIDATION_SEED
from offline_agent.online.vector import VectorMode

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
    "policy/pulled_back",
    "loss/policy",
    "loss/value",
    "loss/kl",
    "loss/self_imitation",
    "self_imitation/kl",
    "self_imitation/buffer_steps",
    "charts/success_rate",
    "charts/episode_return",
    "charts/episode_length",
    "charts/episodes",
    "safety/blocked",
    "safety/truncated",
    "time/steps_per_second",
)
#: The default recipe (`benchmarks/results/online_recipe.md`, the one setting that held on all three simulators: over
#: three seeds and 200 episodes each, at least 0.95 greedy success pooled on every simulator, the KL within 2x its
#: target): 48 iterations of 8 envs x 64 steps, target KL 0.1, tau 0.2, sub-goal shaping 1, self-imitation 1, the
#: policy kept by a guard of 32 validation episodes. Each part's own runs: shaping and self-imitation in losses.py
#: and self_imitation.py, the guard in validation.py, the KL control in kl.py. Tau 0.2 rather than 0.3
#: (`benchmarks/results/online_tau03.md`): at 0.3 Logistics' sampled episodes succeed 10-57% of the time while
#: its greedy policy validates at ~0.9, so PPO rarely samples the greedy policy's own loops; at 0.2, 40-80%, and
#: Logistics passes 95% (0.948 -> 0.965 pooled, on the whole-text state vectors of the time) with the other two
#: unchanged within their intervals.
DEFAULT_TARGET_KL = 0.1
DEFAULT_TAU = 0.2
#: A copy of the offline Q network is steep (logits = Q / tau); a residual correction is in logit units.
DEFAULT_LEARNING_RATES = {"residual": 1e-3, "copy": 1e-5}


@dataclass
class PPOConfig:
    """Settings of a fine-tuning run; `__post_init__` rejects values that cannot work, naming the fix."""

    iterations: int = field(default=48, metadata={"help": "rollout + update iterations"})
    num_envs: int = field(default=8, metadata={"help": "environments stepped in parallel"})
    num_steps: int = field(default=64, metadata={"help": "steps per environment per rollout (T)"})
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
    kl_gain: float = field(
        default=1.0,
        metadata={"help": "how fast the adaptive controller follows the KL: beta *= (KL / target) ** gain after "
                  "each rollout, by 4x up or 1.25x down at most (kl.py), > 0"},
    )
    trust_region: float | None = field(
        default=1.5,
        metadata={"help": "stop an iteration's policy updates (PPO and self-imitation) once a minibatch's KL to the "
                  "offline policy exceeds this many times the target KL (after one step); None = no limit"},
    )
    tau: float | None = field(
        default=DEFAULT_TAU,
        metadata={"help": "temperature of the fine-tuned and the reference policy, softmax(Q / tau), > 0; "
                  "None = the checkpoint's"},
    )
    subgoal_shaping: float = field(
        default=1.0,
        metadata={"help": "weight W of potential-based shaping on the environment's sub-goals, "
                  "W * (gamma * Phi(s') - Phi(s)) with Phi = sub_goals_done / sub_goals_total; 0 = off"},
    )
    self_imitation: float = field(
        default=1.0,
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
        default=32,
        metadata={"help": "play the offline policy, then each iteration's, greedily on this many held-out "
                  "validation episodes and keep one by `validation_keep` instead of the last; 0 = off"},
    )
    validation_keep: Literal["best", "guard"] = field(
        default="guard",
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
        positive = ("iterations", "num_envs", "num_steps", "update_epochs", "num_minibatches")
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
        if self.trust_region is not None and not self.trust_region >= 1:
            raise UserError(f"trust_region must be >= 1 (times the target KL), got {self.trust_region}; e.g. 2")
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
        for name in ("learning_rate", "value_learning_rate", "clip_coef", "max_grad_norm", "init_beta", "kl_gain",
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
