"""The run report: sections from real inputs, "not run" notes, escaping, embedded PNGs, atomic writes, the CLI
verb, and the page as a real headless browser (Debian's chromium) renders it.

Fixtures are real pieces: a dataset ingested from chat logs (one bad line, quarantined), metrics.parquet files
written with polars under the learner's and PPO's metric names, and eval JSON files.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from offline_agent import report
from offline_agent.cli import app
from offline_agent.errors import UserError
from offline_agent.ingest import ingest
from tests.helpers import chat_record, write_jsonl

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SECTIONS = ("dataset", "training", "online", "evaluation")
HOSTILE = '<script>alert("x")</script>&'


def write_offline_run(folder: Path, algo: str, dataset: Path | str | None, metrics: dict[str, list]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(metrics).write_parquet(folder / "metrics.parquet")
    config = {"algo": algo, "dataset": {"path": str(dataset), "name": "demo"} if dataset else None}
    (folder / "policy.json").write_text(json.dumps(config))
    return folder


def cql_metrics(n: int = 30) -> dict[str, list]:
    return {
        "step": list(range(0, 10 * n, 10)),
        "loss/total": [1.0 / (i + 1) for i in range(n)],
        "loss/td": [0.5 / (i + 1) for i in range(n)],
        "loss/cql": [0.3 - 0.005 * i for i in range(n)],
        "q/data_mean": [0.01 * i for i in range(n)],
        "q/ood_gap": [0.2 + 0.01 * i for i in range(n)],
    }


def online_metrics(n: int = 12) -> dict[str, list]:
    return {
        "iteration": list(range(n)),
        "env_steps": [256 * (i + 1) for i in range(n)],
        "charts/success_rate": [i / n for i in range(n)],
        "charts/episode_return": [i / n - 0.1 for i in range(n)],
        "objective/kl": [0.01 * (i % 3) for i in range(n)],
        "objective/beta": [0.1 * 1.02**i for i in range(n)],
        "policy/clipfrac": [0.1] * n,
    }


def eval_record(policy: str, success_rate: float, **extra) -> dict:
    return {
        "policy": policy,
        "env": "offline_agent/Logistics-v0",
        "success_rate": success_rate,
        "ci95": [success_rate - 0.1, success_rate + 0.1],
        "mean_return": success_rate,
        "episodes": 50,
        **extra,
    }


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A real dataset: 12 chat episodes (half solved), one with a tool whose name needs escaping, one bad line."""
    root = tmp_path_factory.mktemp("data")
    records: list = [chat_record(reward=float(i % 2), n_calls=1 + i % 3) for i in range(12)]
    odd = chat_record(reward=0.5, n_calls=1)
    odd["messages"][2]["tool_calls"][0]["function"]["name"] = "look<up>&"
    records += [odd, "{this line is not JSON"]
    ingest([write_jsonl(root / "logs.jsonl", records)], root / "dataset")
    return root / "dataset"


@pytest.fixture(scope="module")
def demo(tmp_path_factory, dataset) -> Path:
    """A demo folder: runs/cql, runs/bc, runs/finetune, eval/*.json, and its dataset named by the CQL run."""
    root = tmp_path_factory.mktemp("demo-output")
    write_offline_run(root / "runs" / "cql", "cql", dataset, cql_metrics())
    write_offline_run(
        root / "runs" / "bc",
        "bc",
        dataset,
        {"step": list(range(20)), "loss/bc": [1 / (i + 1) for i in range(20)], "policy/data_prob": [0.5] * 20},
    )
    finetune = root / "runs" / "finetune"
    finetune.mkdir(parents=True)
    pl.DataFrame(online_metrics()).write_parquet(finetune / "metrics.parquet")
    (finetune / "config.json").write_text(json.dumps({"algo": "ppo", "reference_policy": str(root / "runs/cql")}))
    (root / "eval").mkdir()
    (root / "eval" / "cql.json").write_text(json.dumps(eval_record("cql", 0.7, mean_steps=4.5)))
    (root / "eval" / "bc.json").write_text(json.dumps(eval_record("bc", 0.5)))
    (finetune / "eval.json").write_text(json.dumps(eval_record(HOSTILE, 0.8)))
    return root


@pytest.fixture(scope="module")
def demo_page(demo, tmp_path_factory) -> tuple[Path, str]:
    path = report.write_report(demo, out=tmp_path_factory.mktemp("out") / "report.html")
    return path, path.read_text()


def section_html(page: str, section_id: str) -> str:
    match = re.search(rf'<section id="{section_id}">(.*?)</section>', page, re.S)
    assert match, f"no section {section_id}"
    return match.group(1)


def image_sources(page: str) -> list[str]:
    return re.findall(r'<img src="([^"]*)"', page)


# --- the page from a full demo folder ----------------------------------------------------------------------


def test_every_section_is_filled_from_a_demo_folder(demo_page):
    _, page = demo_page
    for section_id in SECTIONS:
        assert "not run" not in section_html(page, section_id), section_id
    data = section_html(page, "dataset")
    assert re.search(r"<dt>episodes</dt><dd>13</dd>", data)
    assert re.search(r"<dt>quarantined records</dt><dd>1</dd>", data)
    assert re.search(r"<dt>success rate</dt><dd>0\.4", data)  # 6 of 13 solved
    assert "<td>retry</td>" in data and "histogram of returns" in data
    training = section_html(page, "training")
    assert "runs/cql (cql)" in training and "loss/td, loss/cql, q/ood_gap, q/data_mean" in training
    assert "runs/bc (bc)" in training and "loss/bc" in training  # a BC run plots what it has
    online = section_html(page, "online")
    assert "runs/finetune (ppo)" in online and "x: iteration" in online
    assert "charts/success_rate, charts/episode_return, objective/kl, objective/beta" in online
    evaluation = section_html(page, "evaluation")
    assert evaluation.count("<tr>") == 4  # header + 3 policies
    assert "0.600 - 0.800" in evaluation and "4.500" in evaluation and "eval/cql.json" in evaluation


def test_images_are_embedded_pngs_and_nothing_is_fetched(demo_page):
    _, page = demo_page
    sources = image_sources(page)
    assert len(sources) == 4  # return histogram, cql and bc curves, fine-tune curves
    for src in sources:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC)
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert "<link" not in page and "url(" not in page and "@import" not in page


def test_text_from_the_inputs_is_escaped(demo_page):
    _, page = demo_page
    assert page.count("<script>") == 1  # only the page's own image check
    assert html.escape(HOSTILE) in section_html(page, "evaluation")
    assert "<td>look&lt;up&gt;&amp;</td>" in section_html(page, "dataset")


# --- missing inputs ------------------------------------------------------------------------------------------


def test_a_single_offline_run_notes_what_was_not_run(tmp_path):
    run = write_offline_run(tmp_path / "run", "cql", tmp_path / "moved-away", cql_metrics())
    page = report.write_report(run).read_text()
    assert (run / "report.html").is_file()
    assert "not run" not in section_html(page, "training")
    dataset = section_html(page, "dataset")
    assert "not run" in dataset and "moved-away" in dataset and "--dataset" in dataset
    assert "not run: no fine-tune run" in section_html(page, "online")
    assert "not run: no eval*.json files" in section_html(page, "evaluation")


def test_dataset_option_fills_the_dataset_section(tmp_path, dataset):
    run = write_offline_run(tmp_path / "run", "bc", None, {"step": [0, 1, 2], "loss/bc": [0.9, 0.5, 0.4]})
    page = report.write_report(run, dataset=dataset).read_text()
    assert "not run" not in section_html(page, "dataset")
    assert "not run" in section_html(page, "evaluation")


def test_a_folder_of_evaluations_only(tmp_path):
    (tmp_path / "eval-random.json").write_text(
        json.dumps({"success_rate": 0.1, "ci95": {"low": 0.0, "high": 0.2}, "mean_return": -0.5, "episodes": 20})
    )
    (tmp_path / "eval-broken.json").write_text("{not json")
    page = report.write_report(tmp_path).read_text()
    evaluation = section_html(page, "evaluation")
    assert "<td>random</td>" in evaluation and "0.000 - 0.200" in evaluation
    assert "skipped eval-broken.json" in evaluation
    for section_id in ("dataset", "training", "online"):
        assert "not run" in section_html(page, section_id)
    assert image_sources(page) == []


def test_a_damaged_metrics_file_is_a_note(tmp_path):
    run = write_offline_run(tmp_path / "run", "cql", None, cql_metrics())
    (run / "metrics.parquet").write_bytes(b"not parquet")
    training = section_html(report.write_report(run).read_text(), "training")
    assert "run: metrics.parquet could not be read" in training


def test_bad_runs_are_user_errors(tmp_path, dataset):
    with pytest.raises(UserError, match="does not exist"):
        report.write_report(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds nothing to report"):
        report.write_report(tmp_path / "empty", dataset=dataset)
    run = write_offline_run(tmp_path / "run", "cql", None, cql_metrics())
    with pytest.raises(UserError, match="is not a dataset"):
        report.write_report(run, dataset=tmp_path / "empty")


# --- writing ----------------------------------------------------------------------------------------------


def test_the_page_is_replaced_atomically(tmp_path, monkeypatch):
    page = tmp_path / "report.html"
    page.write_text("old page")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        report.write_text_atomic(page, "new page")
    assert page.read_text() == "old page"
    assert os.listdir(tmp_path) == ["report.html"]  # no temporary file left behind
    monkeypatch.undo()
    report.write_text_atomic(page, "new page")
    assert page.read_text() == "new page" and os.listdir(tmp_path) == ["report.html"]


def test_cli_report(demo, tmp_path):
    out = tmp_path / "sub" / "page.html"
    result = CliRunner().invoke(app, ["report", str(demo), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and str(out) in result.output
    result = CliRunner().invoke(app, ["report", str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output


# --- a real browser -------------------------------------------------------------------------------------------


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("chromium is not installed (Debian: apt-get install chromium); .ci/run installs it when it can")


def run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
    ]
    result = subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"chromium failed ({result.returncode}): {result.stderr[-2000:]}"
    return result


def test_the_page_renders_in_headless_chromium(demo_page, tmp_path):
    binary = chromium_binary()
    path, page = demo_page
    url = path.resolve().as_uri()
    dom = run_chromium(
        binary,
        tmp_path / "profile-dom",
        "--run-all-compositor-stages-before-draw",
        "--virtual-time-budget=5000",
        "--dump-dom",
        url,
    ).stdout
    n_images = len(image_sources(page))
    assert f'data-images-ok="{n_images}/{n_images}"' in dom, re.search(r"<body[^>]*>", dom)
    for section_id in SECTIONS:
        assert f'<section id="{section_id}">' in dom

    shot = tmp_path / "shot.png"
    run_chromium(
        binary, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1280,4000", "--hide-scrollbars", url
    )
    assert shot.read_bytes().startswith(PNG_MAGIC)
    from matplotlib.image import imread

    pixels = imread(shot)  # (H, W, channels) floats in [0, 1]
    assert pixels.shape[:2] == (4000, 1280)
    assert pixels[..., :3].std() > 0.05  # a blank (all-white) page has none
    assert len({tuple(p) for p in pixels[:1200:7, ::7, :3].reshape(-1, 3).round(2)}) > 20  # text and plots


def test_fqe_estimates_get_their_own_table_with_evaluates_reasons_not_to_act_on_them(tmp_path):
    from offline_agent.evaluate import OffPolicyReport

    def fqe(coverage, episodes):
        return OffPolicyReport(policy="cql (runs/cql)", dataset="data/logs", split="test", episodes=episodes,
                               fqe_value=0.625, behaviour_value=0.592, gamma=0.99, fqe_ci95=(0.522, 0.715),
                               fqe_runs=3, coverage=coverage, fqe_bounds=(0.301, 0.944), value_auc=0.712,
                               value_auc_ci95=(0.581, 0.833)).to_dict()

    (tmp_path / "eval").mkdir()
    # `evaluate --env --dataset --json` (both), `evaluate --dataset --json` (FQE only), and a file from before
    # evaluate wrote its doubts.
    both = {"policy": "cql (runs/cql)", "success_rate": 0.4, "ci95": [0.3, 0.5], "episodes": 100,
            "fqe": fqe(0.34, 16)}
    (tmp_path / "eval" / "cql.json").write_text(json.dumps(both))
    (tmp_path / "eval" / "cql-800.json").write_text(json.dumps({"fqe": fqe(0.85, 73)}))
    old = fqe(0.85, 73)
    del old["doubts"]
    (tmp_path / "eval" / "old.json").write_text(json.dumps({"fqe": old}))
    evaluation = section_html(report.write_report(tmp_path).read_text(), "evaluation")
    simulated, off_policy = evaluation.split("Off-policy estimates (FQE on held-out logs)")
    assert simulated.count("<tr>") == 2 and "0.300 - 0.500" in simulated  # header + the one simulated row
    assert off_policy.count("<tr>") == 4 and off_policy.count("0.522 - 0.715") == 3
    rows = {re.search(r"<td>(eval/[^<]+)</td>", row)[1]: row for row in off_policy.split("<tr>")[2:]}
    doubted = rows["eval/cql.json"]
    assert "<td>no: coverage 0.34 &lt; 0.5: FQE extrapolates" in doubted and "only 16 held-out episodes" in doubted
    assert "<td>yes</td>" in rows["eval/cql-800.json"]
    assert "<td>-</td>" in rows["eval/old.json"]  # unknown, not "yes"
    assert off_policy.count("0.581 - 0.833") == 3 and "value network&#x27;s AUC" in off_policy
    assert off_policy.count("0.301 - 0.944") == 3
    assert "skipped" not in evaluation
