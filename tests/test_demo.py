"""`make demo`, a newcomer's first command: the whole pipeline on the bundled sample logs, run as the Makefile
runs it (`python -m offline_agent.demo`), with the tiny budgets of `--quick`, in a temporary folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("demo") / "demo-output"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    result = subprocess.run([sys.executable, "-m", "offline_agent.demo", "--quick", "--out", str(out)], env=env,
                            cwd=out.parent, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout


def test_the_demo_runs_every_stage_and_says_where_the_report_is(demo):
    out, printed = demo
    assert printed.count("\n== ") == 13 and "$ offline-agent ingest" in printed
    assert len(re.findall(r"^\([0-9]+\.[0-9] s\)$", printed, re.M)) == 13  # each stage's time
    assert re.search(rf"Demo finished in [0-9.]+ min\. Report: {re.escape(str(out / 'report.html'))}\n$", printed)
    for name in ("behaviour", "bc", "cql", "finetune"):
        record = json.loads((out / "eval" / f"{name}.json").read_text())
        assert record["episodes"] == 5 and 0.0 <= record["success_rate"] <= 1.0


def test_the_demos_fqe_says_its_few_test_episodes_are_not_enough_and_the_report_shows_it(demo):
    out, _ = demo
    fqe = json.loads((out / "eval" / "cql.json").read_text())["fqe"]
    assert fqe["fqe_runs"] == 2 and fqe["episodes"] < 50
    assert any(f"only {fqe['episodes']} held-out episodes" in d for d in fqe["doubts"])
    page = (out / "report.html").read_text()
    assert "not run:" not in page  # dataset, training, online and evaluation all have their inputs
    assert "Off-policy estimates (FQE on held-out logs)" in page and f"only {fqe['episodes']} held-out" in page


def test_the_demo_never_deletes_a_folder_it_did_not_make(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    result = subprocess.run([sys.executable, "-m", "offline_agent.demo", "--quick", "--out", str(mine)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "exists and is not a demo folder: choose another --out" in result.stderr
    assert (mine / "notes.txt").read_text() == "keep me"
