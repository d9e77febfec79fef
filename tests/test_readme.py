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
