"""The README and docs/ are part of the product: set-up commands, schema tables, examples, the CLI reference
and links must stay true."""

import re

from offline_agent.cli_docs import REFERENCE, reference_markdown
from offline_agent.schema import COLUMN_DOCS, EPISODES_SCHEMA, STEPS_SCHEMA, schema_markdown
from tests.conftest import REPO

DOCS = REPO / "docs"


def test_readme_opens_with_the_two_setup_commands():
    head = "\n".join((REPO / "README.md").read_text().splitlines()[:10])
    assert "make demo" in head and "make test" in head


def test_the_readme_stays_a_manual_for_a_newcomer():
    # What it does, the two commands, the tour, formats, commands and results; reference material is in docs/.
    assert len((REPO / "README.md").read_text().splitlines()) <= 400


def test_every_column_is_documented_and_the_schema_tables_are_current():
    assert set(COLUMN_DOCS["steps"]) == set(STEPS_SCHEMA.names)
    assert set(COLUMN_DOCS["episodes"]) == set(EPISODES_SCHEMA.names)
    assert schema_markdown() in (DOCS / "dataset.md").read_text()


def test_the_cli_reference_is_the_parser():
    assert REFERENCE.read_text() == reference_markdown(), "docs/cli.md is stale: run `make docs`"


def test_every_verb_and_option_is_in_the_cli_reference():
    import click
    import typer.main

    from offline_agent.cli import app

    group = typer.main.get_command(app)
    context = click.Context(group)
    text = REFERENCE.read_text()
    for name in group.list_commands(context):
        assert f"## {name}\n" in text
        for param in group.get_command(context, name).params:
            assert all(f"`{opt}`" in text for opt in getattr(param, "opts", [])) or param.param_type_name == "argument"


def test_relative_links_of_the_readme_and_docs_lead_to_files():
    for page in [REPO / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to missing {target}"


def _block_after(page: str, marker: str) -> str:
    text = (DOCS / page).read_text()
    start = text.index(marker)
    return text[start : text.index("```", start)]


def test_the_documented_example_environment_follows_the_contract(tmp_path, monkeypatch):
    from offline_agent.envs import make_env
    from offline_agent.envs.policies import make_policy
    from offline_agent.simulate import rollout

    (tmp_path / "my_envs.py").write_text(_block_after("environments.md", "# my_envs.py"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("my_envs:CountTo")
    obs, _ = env.reset(seed=0)
    for _ in range(3):
        obs, *_ = env.step(0)
    _, reward, terminated, _, info = env.step(1)
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert 0 < len(rollout(env, make_policy("random", 0), 5, seed=0))


def test_the_documented_custom_adapter_runs(tmp_path, monkeypatch):
    import json

    from offline_agent.dataset import TrajectoryDataset
    from offline_agent.ingest import ingest

    (tmp_path / "my_module.py").write_text(_block_after("ingestion.md", "# my_module.py"))
    runs = [{"id": "r1", "goal": "g", "solved": True, "turns": [{"saw": "s", "did": {"name": "f", "arguments": {}}}]}]
    (tmp_path / "runs.jsonl").write_text(json.dumps(runs[0]) + "\nnot json\n")
    monkeypatch.chdir(tmp_path)
    summary = ingest([tmp_path / "runs.jsonl"], tmp_path / "ds", fmt="my_module:read")
    assert (summary.total("episodes"), summary.total("quarantined")) == (1, 1)
    assert TrajectoryDataset.open(tmp_path / "ds").steps_table()["action"].to_pylist() == [
        '{"name":"f","arguments":{}}'
    ]
