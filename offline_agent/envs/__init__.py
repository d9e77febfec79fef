"""Built-in text simulators with tool-call actions, registered with gymnasium when this package is imported.

Each is a small model of a job LLM agents do in production, with hidden state,
sparse reward (1.0 on success) and a privileged `expert_action()` for scripted
behaviour policies. `make_env` builds any environment from a spec string (a
registered id or `module.path:factory`) and checks that it follows the
contract described in `loading.py`. `safety.py` is the safety filter: rules that forbid
candidate actions, and the wrapper that never offers a forbidden one to whatever acts on an environment.
"""

from __future__ import annotations

import gymnasium as gym

from offline_agent.envs.loading import check_contract, make_env
from offline_agent.envs.policies import make_policy

__all__ = ["BUILTIN_ENVS", "check_contract", "make_env", "make_policy"]

BUILTIN_ENVS = {
    "offline_agent/PipelineRepair-v0": "offline_agent.envs.pipeline:PipelineRepairEnv",
    "offline_agent/Logistics-v0": "offline_agent.envs.logistics:LogisticsEnv",
    "offline_agent/CustomerSupport-v0": "offline_agent.envs.support:CustomerSupportEnv",
}

for _env_id, _entry_point in BUILTIN_ENVS.items():
    if _env_id not in gym.registry:
        gym.register(id=_env_id, entry_point=_entry_point)
