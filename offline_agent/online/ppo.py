"""PPO over candidate actions, kept near the offline policy by a KL penalty: one training iteration.

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

The parts, one role each: `config.py` (`PPOConfig`, `METRICS`), `losses.py` (GAE, the clipped loss, shaping),
`actor_critic.py` (the policy and value heads, their init and optimizer), `featurizer.py` (observations to
tensors), `rollout.py` (the rollout's storage and episode statistics), `kl.py` (the exact KL and the beta
controllers), `self_imitation.py`. This module is the trainer that runs them.

What fine-tuning did, with the defaults (the runs behind the temperature, sub-goal shaping and
self-imitation are with their code):

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
one did. With the featurizer's memo restored too (`featurizer.py`), a resumed run
repeats an uninterrupted one bit for bit (see `finetune.py`).

Dimension letters: T rollout steps per environment, N environments, B rows (T * N or a minibatch),
C candidate slots, D embedding width.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

from offline_agent.envs.loading import task_text
from offline_agent.envs.safety import SafetyFilter
from offline_agent.learn.grounding import PAIR_DIM
from offline_agent.online.actor_critic import build_actor_critic, build_optimizer
from offline_agent.online.config import PPOConfig
from offline_agent.online.featurizer import Featurizer
from offline_agent.online.kl import (
    AdaptiveKLController,
    FixedKLController,
    entropy,
    exact_kl,
    masked_log_softmax,
)
from offline_agent.online.losses import (
    clipped_policy_loss,
    expected_value,
    gae,
    normalize,
    shaping_reward,
    subgoal_potential,
)
from offline_agent.online.rollout import EpisodeStats, RolloutStorage
from offline_agent.online.self_imitation import SuccessBuffer, imitation_steps, self_imitation_loss
from offline_agent.online.vector import make_vector_env


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
        dim = int(reference.encoder.dim)
        self.model = build_actor_critic(reference.network, dim, self.tau, c).to(self.device)
        self.optimizer = build_optimizer(self.model, c)
        self.kl_controller: FixedKLController | AdaptiveKLController = (
            FixedKLController(c.beta)
            if c.beta is not None
            else AdaptiveKLController(c.init_beta, c.target_kl, c.kl_gain)
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
        self.storage = RolloutStorage(c.num_steps, c.num_envs, self.envs.max_candidates, dim, self.featurizer.grounded)
        pair_dim = PAIR_DIM if self.featurizer.grounded else None
        self.success_buffer = (
            SuccessBuffer(c.self_imitation_buffer, c.num_envs, self.envs.max_candidates, dim, pair_dim)
            if c.self_imitation > 0
            else None
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
        stats = self.collect_rollout(self.kl_controller.beta)
        rollout = self.storage
        # beta adapts to this rollout's KL before the update that uses it, one rollout sooner than after it
        # (`kl.py`); PPO's rewards are re-weighed by it. The success buffer keeps the rollout's own weighing.
        mean_kl = float(rollout.kls.mean())
        self.kl_controller.update(mean_kl)
        beta = self.kl_controller.beta
        rollout.rewards.copy_(rollout.scores + rollout.shaping - beta * rollout.kls)
        with torch.no_grad():
            state, cands, mask, pair = self.featurizer.tensors(self.observations)
            _, ref_value = self.reference_policy(state, cands, mask, pair)
            next_value = self.model.value(state, ref_value)
        advantages, returns = gae(rollout.rewards, rollout.values, rollout.dones, next_value, c.gamma, c.gae_lambda)
        update = self.update(advantages, returns, beta)
        update |= self.imitate(beta)
        self.iteration += 1
        self.env_steps += c.batch_size
        return {
            "iteration": self.iteration,
            "env_steps": self.env_steps,
            "objective/kl": mean_kl,
            "objective/beta": beta,
            "objective/non_score_reward": float((-beta * rollout.kls).mean()),
            "objective/score": float(rollout.scores.mean()),
            "objective/shaping": float(rollout.shaping.mean()),
            **update,
            **stats,
            "time/steps_per_second": c.batch_size / (time.perf_counter() - start),
        }

    def collect_rollout(self, beta: float) -> dict[str, float]:
        """Fill the storage with `num_steps` steps of each environment, their rewards weighing the KL by `beta`
        (as the success buffer records them); returns episode and safety statistics."""
        c, f, rollout = self.config, self.featurizer, self.storage
        stats = EpisodeStats(self.safety)
        if self.observations is None or self.iteration % c.checkpoint_every == 0:
            self.observations, reset_infos = self.envs.reset(self.env_seeds(self.iteration))
            for i, info in enumerate(reset_infos):
                f.start(i, task_text(info, None, self.observations[i]))
                stats.add_blocked(info)
                self.potential[i] = subgoal_potential(info)
            self.running_return[:], self.running_length[:] = 0.0, 0
            if self.success_buffer is not None:
                self.success_buffer.drop_open()
        observations, running_return, running_length = self.observations, self.running_return, self.running_length
        for t in range(c.num_steps):
            state, cands, mask, pair = f.tensors(observations)
            sampled = self.policy_step(state, cands, mask, pair)
            rollout.store(t, state, cands, mask, pair, sampled)
            actions = sampled["action"].tolist()
            step = self.envs.step(actions)
            done = step.terminated | step.truncated
            rollout.scores[t] = torch.as_tensor(step.rewards, dtype=torch.float32)
            next_potential = np.array([subgoal_potential(info) for info in step.infos])
            bonus = shaping_reward(self.potential, next_potential, done, c.gamma)
            rollout.shaping[t] = torch.as_tensor(c.subgoal_shaping * bonus, dtype=torch.float32)
            rollout.rewards[t] = rollout.scores[t] + rollout.shaping[t] - beta * rollout.kls[t]
            rollout.dones[t] = torch.as_tensor(done, dtype=torch.float32)
            running_return += step.rewards
            running_length += 1
            for i in range(c.num_envs):
                stats.add_blocked(step.infos[i])
                if self.success_buffer is not None:
                    # Copied out now: the next rollout overwrites the storage while the episode may be open.
                    self.success_buffer.record(i, rollout.step(t, i, pair))
                    if done[i]:
                        self.success_buffer.end_episode(i, bool(step.infos[i].get("success", False)), c.gamma)
                if not done[i]:
                    f.record(i, observations[i]["text"], f.last_actions[i][actions[i]])
                    continue
                stats.end_episode(step.infos[i], float(running_return[i]), int(running_length[i]))
                running_return[i], running_length[i] = 0.0, 0
                f.start(i, task_text(step.reset_infos[i], None, step.observations[i]))
                stats.add_blocked(step.reset_infos[i])
                next_potential[i] = subgoal_potential(step.reset_infos[i])
            observations = step.observations
            self.potential[:] = next_potential
        self.observations = observations
        return stats.metrics()

    def imitate(self, beta: float = 0.0) -> dict[str, float]:
        """`self_imitation_epochs` passes of self-imitation minibatch steps over the success buffer (none when
        it is off, empty or holds fewer than `self_imitation_start` steps); returns the mean loss (before its
        weight), the mean KL to the reference on the imitated states, and the buffer's size.

        Imitation moves the policy as much as PPO does, so it is under the same penalty: each step's loss
        adds `beta * KL(pi(.|s) || pi_ref(.|s))` of its states. Without it the successes were imitated with
        nothing pulling back, and 48-iteration runs ended at 0.53-0.57 nats a step against a 0.05 target.

        The passes, not a number of steps, are fixed: a fixed 32 steps an iteration went 23 times over the 180
        steps of Logistics' first successes, and the greedy policy fell from 0.62 to 0.34 in two iterations.
        """
        c, dev, buffer = self.config, self.device, self.success_buffer
        size = 0 if buffer is None else buffer.size
        if size == 0 or size < c.self_imitation_start:  # off, empty, or still warming up
            return {"loss/self_imitation": 0.0, "self_imitation/kl": 0.0, "self_imitation/buffer_steps": float(size)}
        steps = imitation_steps(size, c.self_imitation_epochs, c.minibatch_size)
        total = total_kl = 0.0
        for _ in range(steps):
            rows = buffer.sample(c.minibatch_size, self.generator)
            state, cands, mask = buffer.state[rows].to(dev), buffer.cands[rows].to(dev), buffer.mask[rows].to(dev)
            pair = None if buffer.pair is None else buffer.pair[rows].to(dev)
            logp = masked_log_softmax(self.model.logits(state, cands, mask, pair), mask)
            taken = logp.gather(1, buffer.action[rows].to(dev)[:, None]).squeeze(1)  # (b,)
            with torch.no_grad():
                values = self.model.value(state, buffer.ref_value[rows].to(dev))
                ref_logp, _ = self.reference_policy(state, cands, mask, pair)
            loss = self_imitation_loss(taken, buffer.returns[rows].to(dev), values)
            kl = exact_kl(logp, ref_logp, mask).mean()
            self.optimizer.zero_grad(set_to_none=True)
            (kl if self.outside_trust_region(kl) else c.self_imitation * loss + beta * kl).backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm)
            self.optimizer.step()
            total += loss.item()
            total_kl += kl.item()
        return {
            "loss/self_imitation": total / steps,
            "self_imitation/kl": total_kl / steps,
            "self_imitation/buffer_steps": float(size),
        }

    def outside_trust_region(self, kl_to_reference: torch.Tensor) -> bool:
        """Whether a minibatch's mean KL(pi || pi_ref) is past `trust_region` x the target KL.

        Such a minibatch's policy step (PPO's or self-imitation's) descends that KL alone, a step back toward
        the reference, instead of its objective. Stopping the iteration's updates there instead left the
        policy parked at the edge: the penalty's gradient had one step an iteration to pull it back, the
        controller wound beta up to 30-340 meanwhile, and when the KL finally fell, beta took 10-20
        iterations to come down, the policy pinned to the reference all along (Widget and Lure, tests'
        envs). Adam scales a step by its gradient's running size, so the pull does not need beta's weight.
        With a fixed beta there is no target, and no region."""
        target, factor = self.config.target_kl, self.config.trust_region
        return target is not None and factor is not None and float(kl_to_reference.detach()) > factor * target

    def update(self, advantages: torch.Tensor, returns: torch.Tensor, beta: float) -> dict[str, float]:
        """`update_epochs` passes of clipped-PPO minibatch steps over the flattened rollout.

        The rollout's rewards carry `-beta * KL(pi(.|s) || pi_ref(.|s))`, a function of the policy's own
        parameters. The score-function (PPO) gradient sees only how an action changes the states that come
        after it, not that the penalty at s shrinks when pi(.|s) moves toward pi_ref; with `kl_gradient`
        that direct gradient is added, as `beta * KL` of each minibatch state in the loss.
        """
        c, dev = self.config, self.device
        b = self.storage.flatten(dev)
        b_advantages = advantages.reshape(-1).to(dev)  # (T, N) -> (B,)
        b_returns = returns.reshape(-1).to(dev)
        names = ("loss/policy", "loss/value", "loss/kl", "policy/entropy", "policy/clipfrac", "policy/approx_kl")
        sums = dict.fromkeys(names, 0.0)
        n_updates, pulled, stop = 0, 0, False
        self.model.train()
        for _ in range(c.update_epochs):
            if stop:
                break
            order = torch.randperm(c.batch_size, generator=self.generator)
            for start in range(0, c.batch_size - c.minibatch_size + 1, c.minibatch_size):
                mb = order[start : start + c.minibatch_size].to(dev)
                mb_mask = b.mask[mb]
                mb_pair = None if b.pair is None else b.pair[mb]
                logits = self.model.logits(b.state[mb], b.cands[mb], mb_mask, mb_pair)
                logp = masked_log_softmax(logits, mb_mask)  # (b, C)
                new_logp = logp.gather(1, b.actions[mb][:, None]).squeeze(1)  # (b,)
                mb_advantages = normalize(b_advantages[mb]) if c.norm_adv else b_advantages[mb]
                pg = clipped_policy_loss(new_logp, b.logprobs[mb], mb_advantages, c.clip_coef)
                ent = entropy(logp, mb_mask).mean()
                v_loss = 0.5 * (self.model.value(b.state[mb], b.ref_values[mb]) - b_returns[mb]).pow(2).mean()
                ref_kl = exact_kl(logp, b.ref_logps[mb], mb_mask).mean()
                kl_loss = beta * ref_kl
                policy_loss = pg.loss - c.ent_coef * ent + (kl_loss if c.kl_gradient else 0.0)
                pull = self.outside_trust_region(ref_kl)
                loss = (ref_kl if pull else policy_loss) + c.vf_coef * v_loss
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
                n_updates, pulled = n_updates + 1, pulled + pull
        means = {key: value / n_updates for key, value in sums.items()}
        return {**means, "policy/update_steps": float(n_updates), "policy/pulled_back": pulled / n_updates}
