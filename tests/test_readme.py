"""The README is part of the product: its set-up commands and schema tables must stay true."""

from offline_agent.schema import COLUMN_DOCS, EPISODES_SCHEMA, STEPS_SCHEMA, schema_markdown
from tests.conftest import REPO


def test_readme_opens_with_the_two_setup_commands():
    head = "\n".join((REPO / "README.md").read_text().splitlines()[:10])
    assert "make demo" in head and "make test" in head


def test_every_column_is_documented_and_the_readme_table_is_current():
    assert set(COLUMN_DOCS["steps"]) == set(STEPS_SCHEMA.names)
    assert set(COLUMN_DOCS["episodes"]) == set(EPISODES_SCHEMA.names)
    assert schema_markdown() in (REPO / "README.md").read_text()


def _block_after(marker: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(marker)
    return text[start : text.index("```", start)]


def test_the_readme_example_environment_follows_the_contract(tmp_path, monkeypatch):
    from offline_agent.envs import make_env
    from offline_agent.envs.policies import make_policy
    from offline_agent.simulate import rollout

    (tmp_path / "my_envs.py").write_text(_block_after("# my_envs.py"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("my_envs:CountTo")
    obs, _ = env.reset(seed=0)
    for _ in range(3):
        obs, *_ = env.step(0)
    _, reward, terminated, _, info = env.step(1)
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert 0 < len(rollout(env, make_policy("random", 0), 5, seed=0))


def test_the_readme_custom_adapter_runs(tmp_path, monkeypatch):
    import json

    from offline_agent.dataset import TrajectoryDataset
    from offline_agent.ingest import ingest

    (tmp_path / "my_module.py").write_text(_block_after("# my_module.py"))
    runs = [{"id": "r1", "goal": "g", "solved": True, "turns": [{"saw": "s", "did": {"name": "f", "arguments": {}}}]}]
    (tmp_path / "runs.jsonl").write_text(json.dumps(runs[0]) + "\nnot json\n")
    monkeypatch.chdir(tmp_path)
    summary = ingest([tmp_path / "runs.jsonl"], tmp_path / "ds", fmt="my_module:read")
    assert (summary.total("episodes"), summary.total("quarantined")) == (1, 1)
    assert TrajectoryDataset.open(tmp_path / "ds").steps_table()["action"].to_pylist() == [
        '{"name":"f","arguments":{}}'
    ]
