"""The fine-tuning job end to end: it learns, it writes a policy, a killed run resumes bit for bit, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import online_envs
import polars as pl
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from offline_agent.cli import app
from offline_agent.errors import UserError
from offline_agent.online.config import METRICS, PPOConfig
from offline_agent.online.finetune import STATE_FILE, finetune

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
runner = CliRunner()
WIDGET = "online_envs:make_widget"
# Small and fast: 2 envs x 32 steps per iteration; a high learning rate and a small fixed beta, so that a
# handful of iterations is enough for the tiny network to learn "repair".
FAST = ["--num-envs", "2", "--num-steps", "32", "--beta", "0.01", "--learning-rate", "3e-3", "--vector", "sync",
        "--validation-episodes", "0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    encoder = online_envs.tiny_encoder_folder(root / "encoder")
    return {"run": online_envs.tiny_checkpoint(root / "run", encoder), "encoder": encoder, "root": root}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_short_fine_tune_raises_the_success_rate_and_writes_a_loadable_policy(tiny, tmp_path):
    from offline_agent.evaluate import evaluate
    from offline_agent.learn.policy import Policy

    out = tmp_path / "ft"
    config = PPOConfig(iterations=8, num_envs=2, num_steps=32, vector="sync", learning_rate=3e-3, beta=0.01)
    result = finetune(tiny["run"], WIDGET, out, config)
    metrics = pl.read_parquet(out / "metrics.parquet")
    assert set(METRICS) <= set(metrics.columns) and metrics.height == 8
    assert metrics["iteration"].to_list() == list(range(1, 9))
    rates = metrics["charts/success_rate"].to_list()
    # Sampling from the (near-uniform) offline policy succeeds about half the time; after 8 iterations, ~all.
    assert sum(rates[:2]) / 2 < 0.7 and sum(rates[-2:]) / 2 > 0.8, rates
    assert result.env_steps == 8 * 64 and (out / "curves.png").stat().st_size > 10_000
    policy = Policy.load(out)
    assert policy.algo == "ppo" and policy.meta["finetuned_from"]["algo"] == "cql" and policy.meta["safety"] == []
    summary = json.loads((out / "finetune.json").read_text())  # which offline weights, even if RUN is retrained
    weights = (tiny["run"] / "policy.safetensors").read_bytes()
    assert summary["source_weights_sha256"] == hashlib.sha256(weights).hexdigest()
    before = evaluate(tiny["run"], WIDGET, episodes=50)
    after = evaluate(out, WIDGET, episodes=50)
    assert after.success_rate >= 0.9 > before.success_rate


def test_a_policy_over_the_observation_view_is_fine_tuned_and_saved_with_it(tiny, tmp_path):
    from offline_agent.learn.policy import Policy

    run = online_envs.tiny_checkpoint(tmp_path / "run", tiny["encoder"], observation_view=True)
    out = tmp_path / "ft"
    config = PPOConfig(iterations=2, num_envs=2, num_steps=16, vector="sync", beta=0.01)
    finetune(run, WIDGET, out, config, encoder=str(tiny["encoder"]))
    policy, reference = Policy.load(out), Policy.load(run)
    assert policy.meta["encoder"] == reference.meta["encoder"] and policy.encoder.observation_view
    assert policy.encoder.id == reference.encoder.id and policy.encoder.id.endswith("-obsview")
    assert pl.read_parquet(out / "metrics.parquet")["objective/kl"][0] == pytest.approx(0.0, abs=1e-6)


def _cli(out: Path, run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "offline_agent.cli", "finetune", str(run), "--env", WIDGET, "--out", str(out),
            *FAST, "--iterations", "12", "--checkpoint-every", "2", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize(
    "settings", [[], ["--self-imitation", "1"], ["--validation-episodes", "6", "--validation-keep", "guard"]],
    ids=["ppo", "self-imitation", "validation"],
)
def test_a_killed_run_resumes_to_the_same_parameters_as_an_uninterrupted_one(tiny, tmp_path, settings):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # The uninterrupted run steps its envs in worker processes, the interrupted one in-process: the result
    # must not depend on that either.
    done = subprocess.run(
        _cli(whole, tiny["run"], "--vector", "process", *settings), cwd=REPO, env=_env(), capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]

    process = subprocess.Popen(_cli(killed, tiny["run"], *settings), cwd=REPO, env=_env(), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (killed / STATE_FILE).exists():
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no checkpoint appeared within 120 s"
        time.sleep(0.01)
    assert process.poll() is None, "the run finished before it could be killed: make it longer"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    interrupted_at = pl.read_parquet(killed / "metrics.parquet")["iteration"].max()
    assert interrupted_at < 12

    resumed = subprocess.run(
        _cli(killed, tiny["run"], "--resume", *settings), cwd=REPO, env=_env(), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed after iteration" in resumed.stderr

    assert (whole / "policy.safetensors").read_bytes() == (killed / "policy.safetensors").read_bytes()
    a, b = load_file(str(whole / STATE_FILE)), load_file(str(killed / STATE_FILE))
    assert a.keys() == b.keys()
    if "--self-imitation" in settings:
        assert a["self_imitation/cursor"][0] > 0  # a buffer of successes was saved and restored
    if "--validation-episodes" in settings:  # the kept policy and its history too
        assert any(key.startswith("validation/") for key in a)
        assert json.loads((whole / "finetune.json").read_text())["validation"] == json.loads(
            (killed / "finetune.json").read_text()
        )["validation"]
    for key in a:
        assert torch.equal(a[key], b[key]), key  # value head, Adam moments and RNG states too
    deterministic = [c for c in METRICS if not c.startswith("time/")]
    assert pl.read_parquet(whole / "metrics.parquet").select(deterministic).equals(
        pl.read_parquet(killed / "metrics.parquet").select(deterministic)
    )


def test_resume_refuses_other_settings_and_a_missing_checkpoint(tiny, tmp_path):
    out = tmp_path / "ft"
    config = PPOConfig(iterations=2, num_envs=2, num_steps=16, vector="sync", beta=0.01)
    finetune(tiny["run"], WIDGET, out, config)
    with pytest.raises(UserError, match="already holds a run"):
        finetune(tiny["run"], WIDGET, out, config)
    with pytest.raises(UserError, match=r"other settings than the interrupted run \(num_steps=16"):
        finetune(tiny["run"], WIDGET, out, PPOConfig(iterations=3, num_envs=2, num_steps=8, beta=0.01), resume=True)
    with pytest.raises(UserError, match="--safety differs"):
        finetune(tiny["run"], WIDGET, out, config, safety="deny:drop_table", resume=True)
    with pytest.raises(UserError, match="holds no fine-tuning checkpoint"):
        finetune(tiny["run"], WIDGET, tmp_path / "empty", config, resume=True)
    # More iterations is a legitimate resume: it continues where the run stopped.
    longer = PPOConfig(iterations=3, num_envs=2, num_steps=16, vector="sync", beta=0.01)
    result = finetune(tiny["run"], WIDGET, out, longer, resume=True)
    assert result.resumed_from == 2 and result.iterations == 3
    assert pl.read_parquet(out / "metrics.parquet")["iteration"].to_list() == [1, 2, 3]


def test_the_safety_rules_are_saved_with_the_policy(tiny, tmp_path):
    from offline_agent.learn.policy import Policy

    config = PPOConfig(iterations=1, num_envs=1, num_steps=16, vector="sync")
    finetune(tiny["run"], WIDGET, tmp_path / "ft", config, safety=["deny:drop_table", "regex:sorry"])
    assert Policy.load(tmp_path / "ft").meta["safety"] == ["deny:drop_table", "regex:sorry"]


# --- bad input through the command line ------------------------------------------------------------------


def _invoke(*args: str):
    return runner.invoke(app, ["finetune", *args])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target-kl", "0"], "--target-kl must be > 0"),
        (["--target-kl", "-0.1"], "--target-kl must be > 0"),
        (["--target-kl", "0.05", "--beta", "0.1"], "exclude each other"),
        (["--safety", "forbid:everything"], "unknown safety rule"),
        (["--num-envs", "0"], "num-envs must be >= 1"),
        (["--torch-threads", "0"], "torch-threads must be >= 1"),
        (["--value-learning-rate", "0"], "value_learning_rate must be > 0"),
        (["--tau", "0"], "--tau must be > 0"),
        (["--subgoal-shaping", "-1"], "subgoal_shaping must be >= 0"),
        (["--self-imitation", "-1"], "self_imitation must be >= 0"),
        (["--validation-keep", "worst"], "validation_keep must be one of best, guard, got 'worst'"),
    ],
)
def test_bad_flags_are_one_line_errors(tiny, tmp_path, extra, message):
    result = _invoke(str(tiny["run"]), "--env", WIDGET, "--out", str(tmp_path / "ft"), *extra)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("online_envs:make_bad_observation", "expected an observation"),
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
        ("offline_agent/NoSuchEnv-v0", "unknown environment"),
    ],
)
def test_an_env_that_breaks_the_contract_is_a_one_line_error(tiny, tmp_path, env, message):
    for safety in ([], ["--safety", "deny:drop_table"]):  # with a filter, the env is built another way
        result = _invoke(str(tiny["run"]), "--env", env, "--out", str(tmp_path / "ft"), *FAST, *safety)
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output


def test_a_checkpoint_from_another_encoder_is_a_one_line_error(tiny, tmp_path):
    other = online_envs.tiny_encoder_folder(tmp_path / "other-encoder", dim=16)
    result = _invoke(str(tiny["run"]), "--env", WIDGET, "--out", str(tmp_path / "ft"), "--encoder", str(other))
    assert result.exit_code == 2, result.output
    assert "this policy was trained on embeddings of encoder" in result.output


def test_out_must_not_be_the_checkpoint_itself(tiny):
    result = _invoke(str(tiny["run"]), "--env", WIDGET, "--out", str(tiny["run"]))
    assert result.exit_code == 2 and "is the checkpoint being fine-tuned" in result.output


def test_the_command_line_passes_threads_learning_rates_and_the_policy_settings_on(tiny, tmp_path):
    result = _invoke(str(tiny["run"]), "--env", WIDGET, "--out", str(tmp_path / "ft"), *FAST, "--iterations", "1",
                     "--torch-threads", "2", "--value-learning-rate", "1e-3", "--subgoal-shaping", "0.5",
                     "--self-imitation", "0.25", "--self-imitation-epochs", "0.5",
                     "--self-imitation-buffer", "64", "--self-imitation-start", "16",
                     "--validation-episodes", "3", "--validation-seed", "7", "--validation-keep", "guard")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "ft" / "policy.json").read_text())["config"]
    assert config["validation_episodes"] == 3 and config["validation_seed"] == 7
    assert config["validation_keep"] == "guard"
    assert config["torch_threads"] == 2 and config["value_learning_rate"] == 1e-3 and config["learning_rate"] == 3e-3
    assert config["subgoal_shaping"] == 0.5 and config["self_imitation"] == 0.25
    assert config["self_imitation_epochs"] == 0.5 and config["self_imitation_buffer"] == 64
    assert config["self_imitation_start"] == 16
    assert config["policy_init"] == "residual" and config["kl_gradient"] is True  # the defaults
    result = _invoke(str(tiny["run"]), "--env", WIDGET, "--out", str(tmp_path / "copy"), "--iterations", "1",
                     "--num-envs", "2", "--num-steps", "16", "--policy-init", "copy", "--no-kl-gradient")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "copy" / "policy.json").read_text())["config"]
    assert config["policy_init"] == "copy" and config["kl_gradient"] is False and config["learning_rate"] == 1e-5
    assert config["subgoal_shaping"] == 1.0 and config["self_imitation"] == 1.0  # the default recipe's
    assert config["validation_episodes"] == 32 and config["validation_keep"] == "guard" and config["tau"] == 0.2


def test_tau_is_the_temperature_the_fine_tuned_policy_is_saved_and_played_with(tiny, tmp_path):
    from offline_agent.learn.policy import Policy

    result = _invoke(str(tiny["run"]), "--env", WIDGET, "--out", str(tmp_path / "ft"), *FAST, "--iterations", "1",
                     "--tau", "0.5")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "ft" / "policy.json").read_text())
    assert meta["config"]["tau"] == 0.5 and meta["tau"] == 0.5
    assert meta["finetuned_from"]["tau"] == 1.0  # the offline checkpoint's, kept for the record
    assert Policy.load(tmp_path / "ft").tau == 0.5
    result = _invoke(str(tiny["run"]), "--env", WIDGET, "--out", str(tmp_path / "plain"), *FAST, "--iterations", "1")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "plain" / "policy.json").read_text())
    assert meta["config"]["tau"] == 0.2 and meta["tau"] == 0.2  # without --tau, the default recipe's


def test_a_checkpoint_from_before_the_value_learning_rate_resumes_as_it_would_have(tiny, tmp_path):
    """Written by an earlier version: no value_learning_rate, policy_init or kl_gradient in its settings (it
    trained a copy of the offline network, with the KL in the rewards only), one optimizer group."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    def run(out, iterations, resume=False):
        config = PPOConfig(iterations=iterations, num_envs=2, num_steps=16, vector="sync", beta=0.01,
                           checkpoint_every=1, policy_init="copy", kl_gradient=False)
        return finetune(tiny["run"], WIDGET, out, config, resume=resume)

    run(tmp_path / "whole", 3)
    run(tmp_path / "old", 2)
    state_file = tmp_path / "old" / STATE_FILE
    with safe_open(str(state_file), framework="pt") as handle:
        state = json.loads(handle.metadata()["state"])
    tensors = load_file(str(state_file))
    for added in ("value_learning_rate", "policy_init", "kl_gradient"):
        del state["config"][added]
    groups = state["optimizer_param_groups"]
    state["optimizer_param_groups"] = [{**groups[0], "params": [p for g in groups for p in g["params"]]}]
    save_file(tensors, str(state_file), metadata={"state": json.dumps(state)})

    result = run(tmp_path / "old", 3, resume=True)
    assert result.resumed_from == 2
    a, b = load_file(str(tmp_path / "whole" / STATE_FILE)), load_file(str(state_file))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_run_cut_at_k_iterations_is_the_longer_runs_first_k(tiny, tmp_path):
    # benchmarks/online.py evaluates the policy after k iterations as the final policy of a k-iteration run.
    def run(out, iterations):
        config = PPOConfig(iterations=iterations, num_envs=2, num_steps=16, vector="sync", beta=0.01)
        finetune(tiny["run"], WIDGET, out, config)
        return pl.read_parquet(out / "metrics.parquet").select([c for c in METRICS if not c.startswith("time/")])

    assert run(tmp_path / "short", 2).equals(run(tmp_path / "long", 3).head(2))


def test_a_fine_tuned_run_keeps_the_logs_value_network_and_known_texts(tiny, tmp_path):
    from offline_agent.learn.networks import FactorisedQNetwork
    from offline_agent.learn.policy import (
        Policy,
        load_checkpoint,
        load_known_texts,
        load_value_network,
        save_checkpoint,
    )
    from offline_agent.text.known import text_arrays

    network, meta = load_checkpoint(tiny["run"])
    meta = {k: v for k, v in meta.items() if k not in ("format", "format_version", "network")}
    torch.manual_seed(1)
    value = FactorisedQNetwork(network.dim, 16, n_heads=1)
    plain = Policy.load(tiny["run"]).encoder.single_view()
    texts = ["repair the widget", "inspect"]
    known = text_arrays(texts, plain.encode(texts), plain.dim)
    save_checkpoint(tmp_path / "offline", network, meta, value_network=value, known_texts=known)
    config = PPOConfig(iterations=1, num_envs=2, num_steps=16, vector="sync")
    finetune(tmp_path / "offline", WIDGET, tmp_path / "ft", config)
    kept = load_value_network(tmp_path / "ft")
    assert kept is not None and kept.config() == value.config()
    for name, tensor in value.state_dict().items():
        assert torch.equal(kept.state_dict()[name], tensor), name
    assert load_value_network(tiny["run"]) is None  # written without one: a fine-tune of it has none either
    _, ft_meta = load_checkpoint(tmp_path / "ft")
    kept_texts = load_known_texts(tmp_path / "ft", ft_meta)
    assert ft_meta["known_texts"] == 2 and kept_texts is not None
    for name, array in known.items():
        np.testing.assert_array_equal(kept_texts[name], array)
