"""Rollouts on Ray (`RayVectorEnv`) against a real local Ray: the same episodes as in-process environments,
and an actor that dies mid-run is replaced, its environments replayed to where they were."""

from __future__ import annotations

import sys

import learn_data
import numpy as np
import pytest
from typer.testing import CliRunner

from offline_agent.cli import app
from offline_agent.errors import UserError
from offline_agent.evaluate import evaluate
from offline_agent.learn.policy import Policy
from offline_agent.online.play import rollout_policy
from offline_agent.online.vector import SyncVectorEnv

pytestmark = pytest.mark.ray
PIPELINE = "offline_agent/PipelineRepair-v0"
SUPPORT = "offline_agent/CustomerSupport-v0"
NOTHING_LOST = {"actors_replaced": 0, "envs_replayed": 0, "steps_replayed": 0}


@pytest.fixture
def ray_envs(local_ray):
    from offline_agent.online.ray_envs import RayVectorEnv

    made = []

    def make(*args, **kwargs):
        made.append(RayVectorEnv(*args, **kwargs))
        return made[-1]

    yield make
    for envs in made:
        envs.close()


def _steps(envs, seeds, rounds: int, kill_at: int | None = None) -> list[tuple]:
    """What `rounds` autoreset steps of random (seeded) candidates give: texts, rewards, ends, successes.
    With `kill_at`, the first Ray actor is killed before that round."""
    rng = np.random.default_rng(0)
    observations, infos = envs.reset(seeds)
    seen = [(tuple(o["text"] for o in observations), tuple(i["task"] for i in infos))]
    for t in range(rounds):
        if t == kill_at:
            envs.ray.kill(envs.actors[0])
        actions = [int(rng.integers(len(o["candidates"]))) for o in observations]
        step = envs.step(actions)
        observations = step.observations
        seen.append(
            (
                tuple(o["text"] for o in observations), tuple(step.rewards), tuple(step.terminated),
                tuple(i.get("success") for i in step.infos), tuple(r and r["task"] for r in step.reset_infos),
            )
        )
    return seen


def test_ray_steps_are_the_local_steps(ray_envs):
    seeds = [3, 1, 4, 1, 5]
    local = SyncVectorEnv(SUPPORT, 5)
    try:
        expected = _steps(local, seeds, 40)
    finally:
        local.close()
    envs = ray_envs(SUPPORT, 5, actors=2)  # uneven: 3 + 2 environments
    assert [len(g) for g in envs.groups] == [3, 2]
    assert envs.max_candidates == local.max_candidates
    assert _steps(envs, seeds, 40) == expected
    assert sum(any(t[2]) for t in expected[1:]) > 0  # episodes ended (and autoreset) along the way
    assert envs.stats() == NOTHING_LOST | {"actors": 2}


def test_a_killed_actor_is_replaced_and_its_episodes_continue(ray_envs):
    seeds = [7, 8, 9, 10]
    local = SyncVectorEnv(SUPPORT, 4)
    try:
        expected = _steps(local, seeds, 30)
    finally:
        local.close()
    envs = ray_envs(SUPPORT, 4, actors=2)
    first = envs.actors[0]
    assert _steps(envs, seeds, 30, kill_at=17) == expected
    assert envs.actors[0] != first
    # The killed actor held environments 0 and 1, each reset once and stepped 17 times before the kill (more if
    # the kill landed a round late: ray.kill does not wait).
    stats = envs.stats()
    assert stats["actors_replaced"] == 1 and stats["envs_replayed"] == 2
    assert stats["steps_replayed"] >= 34 and stats["steps_replayed"] % 2 == 0


class KillsAnActor:
    """The real policy, which kills Ray actor 0 (its process) once, before its `at`-th decision."""

    def __init__(self, policy, envs, at: int):
        self.policy, self.envs, self.at, self.calls = policy, envs, at, 0

    def act_batch(self, histories, observations):
        self.calls += 1
        if self.calls == self.at:
            self.envs.ray.kill(self.envs.actors[0])
        return self.policy.act_batch(histories, observations)


def test_evaluation_on_ray_survives_a_dead_actor_with_the_same_outcomes(ray_envs, one_torch_thread):
    run = learn_data.pipeline_run()["run"]
    local = rollout_policy(PIPELINE, Policy.load(run), 10, seed=5, n_envs=4)
    envs = ray_envs(PIPELINE, 4, actors=2)
    policy = KillsAnActor(Policy.load(run), envs, at=6)
    assert rollout_policy(PIPELINE, policy, 10, seed=5, envs=envs) == local
    stats = envs.stats()
    assert stats["actors_replaced"] == 1 and stats["envs_replayed"] == 2 and stats["steps_replayed"] > 0


def test_evaluate_with_the_ray_backend_reports_the_local_numbers(local_ray, one_torch_thread):
    run = learn_data.pipeline_run()["run"]
    local = evaluate(run, PIPELINE, episodes=6, seed=2, n_envs=3).to_dict()
    on_ray = evaluate(run, PIPELINE, episodes=6, seed=2, n_envs=3, backend="ray", ray_actors=3).to_dict()
    assert on_ray.pop("ray") == NOTHING_LOST | {"actors": 3}
    assert local.pop("ray") is None
    assert on_ray == local


def test_cli_evaluate_on_ray_prints_the_actors(local_ray, one_torch_thread):
    run = learn_data.pipeline_run()["run"]
    result = CliRunner().invoke(
        app, ["evaluate", str(run), "--env", PIPELINE, "-n", "3", "--backend", "ray", "--ray-actors", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "on Ray: 2 actors, 0 replaced" in result.stdout


def test_an_environment_that_fails_in_an_actor_gives_its_one_line_error(ray_envs):
    with pytest.raises(UserError, match="unknown environment 'offline_agent/Nope-v0'"):
        ray_envs("offline_agent/Nope-v0", 2)
    with pytest.raises(UserError, match="no module named 'no_such_module'|no_such_module"):
        ray_envs("no_such_module:make", 2)


def test_the_ray_backend_without_ray_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` does where the extra is not installed
    run = learn_data.pipeline_run()["run"]
    needs = r"^--backend ray needs Ray, which is not installed: pip install 'offline-agent\[ray\]'$"
    with pytest.raises(UserError, match=needs):
        evaluate(run, PIPELINE, episodes=2, backend="ray")
    with pytest.raises(UserError, match="unknown --backend 'spark'"):
        evaluate(run, PIPELINE, episodes=2, backend="spark")


def test_fine_tuning_on_ray_is_the_local_run(local_ray, tmp_path, one_torch_thread):
    import online_envs
    import polars as pl
    from safetensors.torch import load_file

    from offline_agent.online.config import PPOConfig
    from offline_agent.online.finetune import finetune

    encoder = online_envs.tiny_encoder_folder(tmp_path / "encoder")
    run = online_envs.tiny_checkpoint(tmp_path / "run", encoder)
    config = PPOConfig(iterations=3, num_envs=3, num_steps=16, vector="sync", learning_rate=3e-3, beta=0.01)
    local = finetune(run, "online_envs:make_widget", tmp_path / "local", config)
    on_ray = finetune(run, "online_envs:make_widget", tmp_path / "ray", config, backend="ray", ray_actors=2)
    assert local.ray is None
    assert on_ray.ray == NOTHING_LOST | {"actors": 2}
    rates = [pl.read_parquet(r.run_dir / "metrics.parquet")["charts/success_rate"].to_list() for r in (local, on_ray)]
    assert rates[0] == rates[1]
    weights = [load_file(r.run_dir / "policy.safetensors") for r in (local, on_ray)]
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])
