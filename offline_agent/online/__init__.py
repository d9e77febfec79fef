"""Online fine-tuning: PPO with a KL penalty to the offline policy, parallel simulated environments, a safety filter.

- `ppo.py`: `PPOConfig`, the math (GAE, clipped loss) and `PPOTrainer.train_iteration` (rollout, advantages,
  update, metrics);
- `kl.py`: the exact KL over candidates and the fixed / adaptive (Ziegler et al. 2019) beta controllers;
- `vector.py`: N environments in this process or in worker processes, with same-step autoreset;
- `safety.py`: rules that forbid actions, and the env wrapper that never offers a forbidden one;
- `finetune.py`: the job behind `offline-agent finetune` (metrics, plots, checkpoints, exact resume).
"""
