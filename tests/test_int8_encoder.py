"""The int8 encoder (`--encoder-precision int8`): MiniLM exported to ONNX, quantised, run by ONNX Runtime.

Real components: the packaged MiniLM, onnxruntime, a CQL policy trained on the bundled PipelineRepair logs, and
(where ../shared is present) the real tau-bench logs. The target is the issue's: vectors within cosine 0.99 of
the fp32 ones of the same texts.
"""

from __future__ import annotations

import json
import sys

import learn_data
import numpy as np
import pytest
from typer.testing import CliRunner

from offline_agent.cli import app
from offline_agent.errors import UserError
from offline_agent.ingest import ingest
from offline_agent.learn.policy import Policy
from offline_agent.text import int8
from offline_agent.text.encoder import TextEncoder, resolve_precision
from offline_agent.text.states import StateSettings, dataset_texts, turn_blocks

PIPELINE = "offline_agent/PipelineRepair-v0"
runner = CliRunner()


@pytest.fixture(scope="module")
def encoders():
    """(fp32, int8) one-view encoders of the packaged MiniLM; the int8 one built (its first encode)."""
    fp32, quantised = TextEncoder(per_turn=False), TextEncoder(per_turn=False, precision="int8")
    quantised.encode(["a first text builds the int8 model"])
    return fp32, quantised


def _blocks(dataset, encoder: TextEncoder, n: int) -> list[str]:
    """`n` distinct state blocks (task, observation or action turns) of a dataset, spread over it."""
    texts = dataset_texts(dataset, StateSettings(), encoder.count_tokens)
    blocks = sorted({block for state in texts.states for block in turn_blocks(state)} | set(texts.candidates))
    return blocks[:: max(1, len(blocks) // n)][:n]


def test_int8_vectors_are_within_cosine_0_99_of_fp32_on_the_bundled_logs(encoders):
    fp32, quantised = encoders
    sample = _blocks(learn_data.pipeline_run()["data"], fp32, 80)
    cosine = (fp32.encode(sample) * quantised.encode(sample)).sum(axis=1)
    assert cosine.min() >= 0.99, (cosine.min(), sample[int(cosine.argmin())])
    assert cosine.mean() > 0.993  # measured 0.995: most texts are much closer than the worst


def test_int8_vectors_are_within_cosine_0_99_of_fp32_on_real_tau_bench_turns(encoders, real_data, tmp_path):
    fp32, quantised = encoders
    ingest([real_data / "tau_bench_airline" / "gpt-4o-airline.json"], tmp_path / "tau")
    sample = _blocks(tmp_path / "tau", fp32, 120)
    cosine = (fp32.encode(sample) * quantised.encode(sample)).sum(axis=1)
    assert cosine.min() >= 0.99, (cosine.min(), sample[int(cosine.argmin())])


def test_a_texts_int8_vector_does_not_depend_on_the_texts_encoded_with_it(encoders):
    # One activation scale per tensor: in a padded batch a short text's vector would follow its neighbours'.
    _, quantised = encoders
    text = "[obs] stage build failed: exit code 2"
    alone = quantised.encode([text])
    beside = quantised.encode(["[task] a much longer text " * 20, text, "ok"])
    np.testing.assert_array_equal(alone[0], beside[1])
    np.testing.assert_array_equal(quantised.encode([text]), alone)  # and the same on every call


@pytest.mark.filterwarnings("ignore")  # the tracer's warnings, as in the product, where they are silenced
def test_the_first_layer_and_two_down_projections_stay_in_fp32(encoders):
    import onnx
    import torch

    fp32, _ = encoders
    batch = fp32.tokenizer(["a text"], return_tensors="pt")
    names = [n for n in fp32.tokenizer.model_input_names if n in batch]
    path = learn_data.root() / "exported.onnx"
    torch.onnx.export(int8._last_hidden(fp32.model, names), tuple(batch[n] for n in names), str(path),
                      input_names=names, opset_version=17, dynamo=False)
    kept = int8.layers_kept_in_fp32(onnx.load(str(path)))
    layer0 = [name for name in kept if "/layer.0/" in name]
    assert len(layer0) == 8  # query, key, value, the two attention products, attention output, both FFN matrices
    assert sorted(set(kept) - set(layer0)) == [
        "/m/encoder/layer.1/output/dense/MatMul", "/m/encoder/layer.2/output/dense/MatMul"
    ]


def test_int8_vectors_have_an_id_of_their_own_and_stand_in_for_fp32_ones(encoders):
    fp32, quantised = encoders
    assert quantised.id == fp32.id + "-int8" and quantised.fp32_id == fp32.id
    policy = Policy.load(learn_data.pipeline_run()["run"], precision="int8")
    assert policy.encoder.precision == "int8" and policy.encoder.id.endswith("-int8-perturn")


def test_evaluate_plays_an_fp32_policy_with_an_int8_encoder(one_torch_thread):
    run = learn_data.pipeline_run()["run"]
    result = runner.invoke(app, ["evaluate", str(run), "--env", PIPELINE, "-n", "2", "--encoder-precision", "int8",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["episodes"] == 2 and report["encoder_precision"] == "int8"
    # The summary says which precision ran: "auto" resolves per machine, and the figures depend a little on it.
    result = runner.invoke(app, ["evaluate", str(run), "--env", PIPELINE, "-n", "2", "--encoder-precision", "int8"])
    assert result.exit_code == 0 and ", 2 episodes (encoder in int8): success rate" in result.output, result.output
    result = runner.invoke(app, ["evaluate", "behaviour:expert", "--env", PIPELINE, "-n", "2", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["encoder_precision"] is None, result.output


def test_an_encoder_whose_int8_vectors_stray_is_refused(monkeypatch, encoders):
    monkeypatch.setattr(int8, "MIN_COSINE", 1.0001)  # no vector passes: what a model that quantises badly meets
    with pytest.raises(UserError, match=r"int8 vectors stray from its fp32 ones \(cosine 0\.99\d+ < 1\.0001"):
        TextEncoder(precision="int8").encode(["text"])  # built already (`encoders`): checked again
    monkeypatch.setattr(int8, "_BUILT", type(int8._BUILT)())
    with pytest.raises(UserError, match=r"int8 vectors stray from its fp32 ones \(cosine 0\.99\d+ < 1\.0001"):
        TextEncoder(precision="int8").encode(["text"])  # and when built anew


def test_auto_falls_back_to_what_torch_runs_where_a_model_cannot_take_int8(monkeypatch, encoders):
    import torch

    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    fp32, quantised = encoders
    assert TextEncoder(per_turn=False, precision="auto").id == quantised.id  # MiniLM takes int8
    monkeypatch.setattr(int8, "MIN_COSINE", 1.0001)  # vectors that stray, from the model built already
    with pytest.warns(UserWarning, match=r"auto: encoder \S+ does not run in int8 \(this encoder's int8 vectors "
                      r"stray .*\); it runs in bf16"):
        strays = TextEncoder(per_turn=False, precision="auto")
    assert strays.precision == "bf16" and strays.id == fp32.id + "-bf16"
    np.testing.assert_allclose(strays.encode(["a text"]), fp32.encode(["a text"]), atol=1e-2)

    def cannot_trace(*args):
        raise RuntimeError("Exporting the operator 'aten::fancy' to ONNX opset version 17 is not supported.\nmore")

    monkeypatch.setattr(int8, "_BUILT", type(int8._BUILT)())
    monkeypatch.setattr(int8, "_quantised_session", cannot_trace)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with pytest.warns(UserWarning, match=r"int8 \(this encoder cannot be quantised to int8 with ONNX Runtime "
                      r"\(Exporting the operator 'aten::fancy' .* not supported\.\): .*\); it runs in fp32"):
        untraceable = TextEncoder(per_turn=False, precision="auto")
    assert untraceable.precision == "fp32" and untraceable.id == fp32.id
    # Named, int8 is what was asked for: no fallback, and one line that says what to do.
    with pytest.raises(UserError, match=r"cannot be quantised to int8 .*aten::fancy.*: use --encoder-precision bf16"):
        TextEncoder(per_turn=False, precision="int8").encode(["a text"])


def test_a_process_builds_a_models_int8_model_once(monkeypatch, encoders):
    _, quantised = encoders
    builds = []
    real = int8.Int8Encoder

    def counted(*args):
        builds.append(1)
        return real(*args)

    monkeypatch.setattr(int8, "Int8Encoder", counted)
    again = TextEncoder(per_turn=False, precision="int8")  # another load of the same model: no build
    text = "[obs] stage build failed: exit code 2"
    np.testing.assert_array_equal(again.encode([text]), quantised.encode([text]))
    assert builds == [] and again._int8_encoder() is quantised._int8_encoder()
    shorter = TextEncoder(per_turn=False, precision="int8", max_length=128)  # other vectors of long texts: a build
    shorter.encode([text])
    assert builds == [1] and shorter._int8_encoder() is not quantised._int8_encoder()
    tuned = TextEncoder(per_turn=False, precision="int8", max_length=64)  # a third model: the oldest goes
    tuned.encode([text])
    assert builds == [1, 1] and len(int8._BUILT) == int8.KEEP_BUILT
    assert (quantised.path, quantised.model_id) not in int8._BUILT


def test_int8_without_onnxruntime_or_off_the_cpu_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # an import of it fails, as where it is not installed
    with pytest.raises(UserError, match=r"\(onnxruntime\): `pip install onnxruntime onnx`"):
        resolve_precision("int8")
    monkeypatch.undo()
    with pytest.raises(UserError, match="int8 runs on the CPU, not on --device cuda"):
        resolve_precision("int8", "cuda")
