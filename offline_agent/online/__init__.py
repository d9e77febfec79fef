"""Online fine-tuning: PPO with a KL penalty to the offline policy in parallel simulated environments, and rollouts.

- `ppo.py`: `PPOTrainer.train_iteration` (rollout, advantages, update, metrics), and what fine-tuning did;
- `config.py`: `PPOConfig` (each setting, its help, its validation) and the metric names `METRICS`;
- `losses.py`: the math as pure functions (GAE, the clipped loss, a policy's value, sub-goal shaping);
- `actor_critic.py`: the policy head (residual on, or copy of, the offline network) and the value head;
- `featurizer.py`: observations of N environments as tensors, through a text -> vector memo;
- `rollout.py`: a rollout's preallocated storage and its episode and safety statistics;
- `self_imitation.py`: the buffer of successful episodes and its loss;
- `kl.py`: the exact KL over candidates and the fixed / adaptive beta controllers (the trust region: `ppo.py`);
- `vector.py`: N environments in this process or in worker processes, with same-step autoreset (behind the
  safety filter of `offline_agent.envs.safety`); `ray_envs.py`: the same on Ray actors;
- `play.py`: a policy's episodes played in N environments (`rollout_policy`), shared with `evaluate`;
- `finetune.py`: the job behind `offline-agent finetune` (metrics, plots, checkpoints, exact resume).
"""
