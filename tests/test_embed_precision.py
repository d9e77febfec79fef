"""Datasets embedded in bf16 or int8 (`train`/`embed --encoder-precision`), and policies trained on them.

Real components: the packaged MiniLM (int8 through ONNX Runtime), a real dataset with its embedding cache on
disk, CQL training and FQE through the CLI. A policy trained on int8 vectors records their encoder id; an
encoder of the same model in any precision plays it, and off-policy evaluation reads the vectors training
cached instead of embedding the dataset again in fp32.
"""

from __future__ import annotations

import json
import shutil

import learn_data
import numpy as np
import pytest
from typer.testing import CliRunner

from offline_agent.cli import app
from offline_agent.errors import UserError
from offline_agent.learn.policy import Policy, encoder_for, trained_precision
from offline_agent.text.cache import CACHE_DIRNAME, EmbeddingCache
from offline_agent.text.encoder import TextEncoder

runner = CliRunner()

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HASH, TUNED = "0123456789ab", "ba9876543210"  # a model's digest, and its tuned layers'


@pytest.mark.parametrize(
    ("encoder_id", "precision", "fp32_id"),
    [
        (f"MiniLM-{HASH}", "fp32", f"MiniLM-{HASH}"),
        (f"MiniLM-{HASH}-int8", "int8", f"MiniLM-{HASH}"),
        (f"MiniLM-{HASH}-bf16-perturn", "bf16", f"MiniLM-{HASH}-perturn"),
        (f"MiniLM-{HASH}-tuned-{TUNED}-int8-perturn-obsview", "int8", f"MiniLM-{HASH}-tuned-{TUNED}-perturn-obsview"),
        # A model folder whose name says int8 is not an int8 id: the precision follows the 12-hex digest.
        (f"minilm-int8-{HASH}-perturn", "fp32", f"minilm-int8-{HASH}-perturn"),
        (f"minilm-int8-{HASH}-bf16", "bf16", f"minilm-int8-{HASH}"),
    ],
)
def test_an_ids_precision_and_fp32_id_are_read_off_the_segment_after_the_digest(encoder_id, precision, fp32_id):
    assert TextEncoder.precision_of(encoder_id) == precision
    assert TextEncoder.fp32_id_of(encoder_id) == fp32_id


def test_the_precision_a_policy_was_trained_in_is_its_default_where_the_device_runs_it():
    assert trained_precision(f"MiniLM-{HASH}-int8-perturn", "cpu") == "int8"
    assert trained_precision(f"MiniLM-{HASH}-bf16-perturn", "cuda") == "bf16"
    assert trained_precision(f"MiniLM-{HASH}-int8-perturn", "cuda:0") == "fp32"  # int8 runs on the CPU only
    assert trained_precision(f"MiniLM-{HASH}-perturn", "cpu") == "fp32"


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory):
    """A copy of the color-lock dataset without its embedding cache, embedded in int8 by `embed`, then a CQL run
    trained with `train --encoder-precision int8`, and the two commands' outputs."""
    folder = tmp_path_factory.mktemp("int8")
    dataset = learn_data.fresh_copy(folder / "color_lock")
    shutil.rmtree(dataset / CACHE_DIRNAME)  # any text embedded later in fp32 would show as a new cache folder
    embedded = runner.invoke(app, ["embed", str(dataset), "--encoder-precision", "int8"])
    run = folder / "run"
    trained = runner.invoke(app, ["train", str(dataset), "--out", str(run), "--steps", "10",
                                  "--encoder-precision", "int8"])
    assert embedded.exit_code == 0 and trained.exit_code == 0, embedded.output + trained.output
    return {"dataset": dataset, "run": run, "embed": embedded.output, "train": trained.output}


def test_train_embeds_and_records_the_precision_it_was_asked_for(int8_run):
    meta = json.loads((int8_run["run"] / "policy.json").read_text())
    fp32 = learn_data.encoder()
    assert meta["encoder"]["id"] == fp32.single_id + "-int8-perturn"
    # `embed` filled an int8 cache, and `train` found every text there.
    infos = (int8_run["dataset"] / CACHE_DIRNAME).glob("*/encoder.json")
    assert [json.loads(info.read_text())["precision"] for info in infos] == ["int8"]
    assert " 0 new texts encoded" not in int8_run["embed"] and "0 encoded)" in int8_run["train"], int8_run
    # The known texts a rollout's memo starts with are the int8 vectors training read.
    policy = Policy.load(int8_run["run"])
    texts, vectors = policy.known_texts["texts"], policy.known_texts["vectors"]
    first = bytes(texts[: policy.known_texts["offsets"][1]]).decode()
    int8_cache = EmbeddingCache(int8_run["dataset"] / CACHE_DIRNAME, policy.encoder)
    assert np.array_equal(vectors[0], int8_cache.embed([first])[0]) and int8_cache.misses == 0


def test_a_policy_trained_on_int8_vectors_loads_in_int8_and_plays_with_any_precision(int8_run):
    policy = Policy.load(int8_run["run"])
    assert policy.encoder.precision == "int8" and policy.encoder.id == policy.meta["encoder"]["id"]
    state, candidates = "Task: open the lock", ["press red", "press blue"]
    scores = {}
    for precision in ("int8", "fp32", "bf16"):
        other = Policy.load(int8_run["run"], precision=precision)
        assert other.encoder.precision == precision
        scores[precision] = other.score(state, candidates)
    # Other vectors of the same texts, so other but close values (measured: 0.004 apart, fp32 and bf16 0.0004).
    assert not np.array_equal(scores["fp32"], scores["int8"])
    assert np.abs(scores["fp32"] - scores["int8"]).max() < 0.02
    assert np.abs(scores["fp32"] - scores["bf16"]).max() < 0.004
    # Never a different model: whole-text vectors of the same model are other vectors.
    with pytest.raises(UserError, match=r"trained on embeddings of encoder \S+-int8-perturn"):
        encoder_for(policy.meta, learn_data.whole_text_encoder())


def test_off_policy_evaluation_reads_the_vectors_training_cached(int8_run):
    cache = int8_run["dataset"] / CACHE_DIRNAME
    parts_before = sorted(p.name for p in cache.glob("*/*.parquet"))
    result = runner.invoke(app, ["evaluate", str(int8_run["run"]), "--dataset", str(int8_run["dataset"]),
                                 "--fqe-steps", "10", "--fqe-runs", "0", "--no-fqe-bounds", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["fqe"]["episodes"] > 0
    # No text was encoded again (in fp32 or any precision): no cache part or folder was added.
    assert sorted(p.name for p in cache.glob("*/*.parquet")) == parts_before


def test_a_tuned_encoder_is_trained_in_fp32_and_a_bad_precision_is_named(int8_run, tmp_path):
    result = runner.invoke(app, ["train", str(int8_run["dataset"]), "--out", str(tmp_path / "r"), "--steps", "2",
                                 "--encoder-precision", "int8", "--tune-encoder-layers", "1"])
    assert result.exit_code != 0 and (
        "--tune-encoder-layers trains the encoder in fp32, not int8: drop --encoder-precision" in result.output
    ), result.output
    result = runner.invoke(app, ["train", str(int8_run["dataset"]), "--out", str(tmp_path / "r"), "--steps", "2",
                                 "--encoder-precision", "fp8"])
    assert result.exit_code != 0 and "--encoder-precision 'fp8' is not one of fp32, bf16, int8, auto" in result.output
    assert not (tmp_path / "r").exists()
