"""How rollouts embed their states: in one batch per decision round, through a bounded memo, optionally in bf16.

Real components throughout: the packaged MiniLM (`TextEncoder`), PipelineRepair-v0, and a small CQL policy
trained on six episodes of the bundled PipelineRepair logs. A batched and a one-text-at-a-time encoder give
vectors ~1e-7 apart (padding changes the kernels' shapes), so a greedy policy must act the same with both;
fine-tuning saves its memo with each checkpoint, so that a resumed run meets the very vectors.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import learn_data
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from offline_agent.cli import app
from offline_agent.errors import UserError
from offline_agent.learn.policy import Policy, encoder_for
from offline_agent.online.config import PPOConfig
from offline_agent.online.finetune import STATE_FILE, finetune
from offline_agent.online.play import rollout_policy
from offline_agent.online.ppo import PPOTrainer
from offline_agent.text.cache import EmbeddingCache, EmbeddingMemo, text_hash
from offline_agent.text.encoder import TextEncoder, native_bf16, native_int8, resolve_precision
from offline_agent.text.states import StateSettings, dataset_texts

PIPELINE = "offline_agent/PipelineRepair-v0"
runner = CliRunner()


@pytest.fixture(scope="module")
def pipeline():
    """{"data": six bundled PipelineRepair episodes ingested, "run": CQL trained 20 steps on them}."""
    return learn_data.pipeline_run()


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    yield


class ForwardPasses:
    """The batch sizes of an encoder's forward passes, in order."""

    def __init__(self, encoder: TextEncoder):
        self.sizes: list[int] = []
        encoder.model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        self.sizes.append(int(kwargs["input_ids"].shape[0]))


def _recorded(policy: Policy, episodes: int) -> tuple[list[list[int]], list]:
    """(the indices chosen in each decision round, the outcomes) of `episodes` lockstep episodes from seed 0."""
    rounds: list[list[int]] = []
    act = policy.act_batch

    def recording(histories, observations):
        chosen = act(histories, observations)
        rounds.append(chosen)
        return chosen

    policy.act_batch = recording
    return rounds, rollout_policy(PIPELINE, policy, episodes, seed=0, n_envs=episodes)


def test_lockstep_evaluation_encodes_a_rounds_states_together_and_acts_as_one_text_at_a_time(pipeline):
    # Memos that start empty (not with the checkpoint's known texts): what is measured is how they fill.
    batched = Policy.load(pipeline["run"], known_texts=False)
    alone = Policy.load(pipeline["run"], encoder=TextEncoder(batch_size=1), known_texts=False)
    passes_batched, passes_alone = ForwardPasses(batched.encoder), ForwardPasses(alone.encoder)
    rounds, outcomes = _recorded(batched, episodes=3)
    assert (rounds, outcomes) == _recorded(alone, episodes=3)
    assert sum(o.steps for o in outcomes) >= 12
    # One encoder call per decision round at most; a round's new states share a forward pass.
    assert batched.memo.encoder_calls <= len(rounds) and 3 in passes_batched.sizes
    assert set(passes_alone.sizes) == {1} and len(passes_alone.sizes) == alone.memo.misses
    assert len(passes_batched.sizes) < len(passes_alone.sizes) / 2
    # The candidates recur: most of what a round embeds comes from the memo.
    assert batched.memo.hits > batched.memo.misses == len(batched.memo)
    shared = list(batched.memo.vectors)
    np.testing.assert_allclose(batched.memo.embed(shared), alone.memo.embed(shared), atol=1e-5, rtol=0)


def test_fine_tuning_rollouts_encode_a_steps_states_together_and_sample_as_one_text_at_a_time(pipeline):
    config = PPOConfig(num_envs=3, num_steps=5, vector="sync", seed=0)
    trainers = [
        PPOTrainer(Policy.load(pipeline["run"], known_texts=False), PIPELINE, config),
        PPOTrainer(Policy.load(pipeline["run"], encoder=TextEncoder(batch_size=1), known_texts=False), PIPELINE,
                   config),
    ]
    try:
        passes = [ForwardPasses(t.reference.encoder) for t in trainers]
        with torch.no_grad():
            for trainer in trainers:
                trainer.collect_rollout(beta=0.1)
        batched, alone = trainers
        assert torch.equal(batched.storage.actions, alone.storage.actions)
        torch.testing.assert_close(batched.storage.obs_state, alone.storage.obs_state, atol=1e-5, rtol=0)
        # One encoder call per step at most (states, and new candidates in a pass of their own).
        assert batched.featurizer.memo.encoder_calls <= config.num_steps
        assert set(passes[1].sizes) == {1} and len(passes[0].sizes) < len(passes[1].sizes) / 2
        assert batched.featurizer.encoded == alone.featurizer.encoded == len(batched.featurizer.memo)
    finally:
        for trainer in trainers:
            trainer.close()


def test_the_memo_encodes_only_new_texts_in_one_call_and_forgets_the_least_recently_used():
    encoder = learn_data.encoder()
    texts = ['{"name": "retry", "arguments": {"stage": "load"}}', "[obs] the load stage failed", "Task: fix it"]
    a, b, c = texts
    memo = EmbeddingMemo(encoder, max_entries=3)
    first = memo.embed([a, b, a])
    assert (memo.encoder_calls, memo.misses, memo.hits, len(memo)) == (1, 2, 0, 2)
    np.testing.assert_array_equal(first[0], first[2])
    np.testing.assert_allclose(first, encoder.encode([a, b, a]), atol=1e-6, rtol=0)
    memo.embed([b, c])  # b is used again: a is now the least recently used
    assert (memo.encoder_calls, memo.misses, memo.hits) == (2, 3, 1)
    memo.embed([b, c, b])  # nothing new: no encoder call
    assert (memo.encoder_calls, memo.hits) == (2, 3)
    memo.embed(["a fourth text"])
    assert a not in memo and len(memo) == 3 and memo.evicted == 1
    assert list(memo.vectors) == [b, c, "a fourth text"]
    memo.embed([a])
    assert memo.misses == 5 and b not in memo
    assert memo.embed([]).shape == (0, encoder.dim)


def test_the_memo_forgets_its_vectors_when_its_encoder_becomes_another():
    import copy

    encoder = copy.copy(learn_data.encoder())  # the same model; its id is this copy's own
    memo = EmbeddingMemo(encoder)
    memo.embed(["[obs] the load stage failed", "Task: fix it"])
    memo.embed(["Task: fix it"])
    assert (memo.encoder_calls, memo.hits) == (1, 1)
    # What `load_tuned_layers` does: new top layers, a new id, so none of the old vectors may be served.
    encoder.model_id = encoder.model_id + "-tuned-000000000000"
    memo.embed(["Task: fix it"])
    assert (memo.encoder_calls, memo.hits, len(memo), memo.evicted) == (2, 1, 1, 2)
    assert memo.encoder_id == encoder.id


def test_a_memo_round_trips_through_arrays_in_order_and_bit_for_bit():
    encoder = learn_data.encoder()
    memo = EmbeddingMemo(encoder)
    memo.embed(["first", "second, café ✓", "third"])
    memo.embed(["first"])
    restored = EmbeddingMemo(encoder)
    restored.load_arrays(memo.arrays())
    assert list(restored.vectors) == list(memo.vectors) == ["second, café ✓", "third", "first"]
    for text, vector in memo.vectors.items():
        np.testing.assert_array_equal(restored.vectors[text], vector)
    small = EmbeddingMemo(encoder, max_entries=2)
    small.load_arrays(memo.arrays())  # keeps the most recently used
    assert list(small.vectors) == ["third", "first"]
    with pytest.raises(ValueError, match="at least 1 text"):
        EmbeddingMemo(encoder, max_entries=0)


def test_policies_share_a_memo_or_a_plain_dict_of_vectors(pipeline):
    first = Policy.load(pipeline["run"], known_texts=False)  # the shared vectors are the encoded ones only
    second = Policy(first.network, first.encoder, first.meta, memo=first.memo)  # as validation does
    observation = {"text": "Pipeline status: load failed", "candidates": ["retry load", "skip load"]}
    first.act(observation)
    calls = first.memo.encoder_calls
    second.act(observation)
    assert first.memo.encoder_calls == calls and first.memo.hits >= 3
    store: dict = {}  # what the benchmarks share between the policies they compare
    Policy(first.network, first.encoder, first.meta, memo=store).act(observation)
    assert set(store) == set(first.memo.vectors)
    other = TextEncoder(batch_size=1)
    with pytest.raises(ValueError, match="memo passed holds vectors of"):
        Policy(first.network, other, first.meta, memo=first.memo)


def test_the_packaged_encoder_counts_tokens_with_the_fast_tokenizer():
    # render_state counts the tokens of every state, several times when it trims one to the encoder's window.
    encoder = learn_data.encoder()
    assert encoder.tokenizer.is_fast
    encoder.encode(["the stage failed " * 100])  # a truncating call must not leave the counter truncating
    assert encoder.count_tokens("the stage failed " * 100) == 300 + 2  # [CLS] ... [SEP]


def test_bf16_vectors_are_within_cosine_0_99_of_fp32_on_real_state_texts(pipeline):
    fp32, bf16 = learn_data.encoder(), TextEncoder(precision="bf16")
    texts = dataset_texts(pipeline["data"], StateSettings().for_encoder(fp32), fp32.count_tokens)
    sample = texts.states[::8][:16] + texts.candidates[:8]
    cosine = (fp32.encode(sample) * bf16.encode(sample)).sum(axis=1)
    assert cosine.min() > 0.99, cosine.min()


def test_bf16_vectors_have_an_id_and_cache_of_their_own_and_stand_in_for_fp32_ones_on_purpose(pipeline, tmp_path):
    fp32 = learn_data.encoder()
    policy = Policy.load(pipeline["run"], precision="bf16")
    bf16 = policy.encoder
    assert bf16.precision == "bf16" and bf16.id == fp32.single_id + "-bf16-perturn" and bf16.fp32_id == fp32.id
    # The dataset embedding cache never mixes the two: bf16 vectors go to a folder of their own.
    bf16_cache, fp32_cache = EmbeddingCache(tmp_path, bf16), EmbeddingCache(tmp_path, fp32)
    assert bf16_cache.folder != fp32_cache.folder
    bf16_cache.embed(["Task: fix it"])
    assert fp32_cache.lookup([text_hash("Task: fix it")]) == {}
    assert json.loads((bf16_cache.folder / "encoder.json").read_text())["precision"] == "bf16"
    # A policy trained on bf16 vectors (`train --encoder-precision bf16`) is played with fp32 ones as well, and
    # loads in bf16 when no precision is asked for; never with another model's (whole-text vectors are others).
    trained_on_bf16 = {**policy.meta, "encoder": {**policy.meta["encoder"], "id": bf16.id}}
    assert encoder_for(trained_on_bf16, bf16) is bf16 and encoder_for(trained_on_bf16, fp32) is fp32
    assert encoder_for(trained_on_bf16).precision == "bf16"
    with pytest.raises(UserError, match=r"trained on embeddings of encoder \S+-bf16"):
        encoder_for(trained_on_bf16, learn_data.whole_text_encoder())
    with pytest.raises(UserError, match="--encoder-precision 'fp16' is not one of fp32, bf16, int8, auto"):
        TextEncoder(precision="fp16")


def test_auto_precision_is_int8_then_bf16_exactly_where_the_cpu_has_their_instructions(monkeypatch):
    # Rollouts default to "auto": int8 where the CPU has int8 dot-product instructions (the fastest), else bf16
    # where it is native (about 2x fp32), and fp32 where torch would emulate either.
    assert resolve_precision("fp32") == "fp32" and resolve_precision("bf16") == "bf16"
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert not native_int8("cpu") and not native_bf16("cpu") and resolve_precision("auto") == "fp32"
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert native_bf16("cpu") and resolve_precision("auto") == "bf16"
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    assert native_int8("cpu") and resolve_precision("auto") == "int8"
    assert resolve_precision("auto", "meta") == "fp32"  # not a CPU: no int8, and no bf16 either
    # Without ONNX Runtime installed, "auto" runs what torch runs instead of failing.
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert not native_int8("cpu") and resolve_precision("auto") == "bf16"
    with pytest.raises(UserError, match="--encoder-precision 'half' is not one of fp32, bf16, int8, auto"):
        resolve_precision("half")


def test_auto_precision_encoders_say_which_precision_they_run(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    encoder = TextEncoder(precision="auto")
    assert encoder.precision == "fp32" and encoder.id == learn_data.encoder().id  # the cache folder is fp32's
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    encoder = TextEncoder(precision="auto")
    assert encoder.precision == "int8" and encoder.id == learn_data.encoder().id.replace("-perturn", "-int8-perturn")
    # and an id says which precision made its vectors (what a resumed run reads off its saved id)
    assert [TextEncoder.precision_of(e.id) for e in (learn_data.encoder(), encoder)] == ["fp32", "int8"]
    assert TextEncoder.precision_of(encoder.single_id.replace("-int8", "-bf16")) == "bf16"


def test_evaluate_plays_an_fp32_policy_with_a_bf16_encoder(pipeline):
    result = runner.invoke(
        app, ["evaluate", str(pipeline["run"]), "--env", PIPELINE, "-n", "2", "--encoder-precision", "bf16", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["episodes"] == 2
    result = runner.invoke(app, ["evaluate", str(pipeline["run"]), "--env", PIPELINE, "--encoder-precision", "int4"])
    assert result.exit_code != 0 and "--encoder-precision 'int4' is not one of fp32, bf16, int8, auto" in result.output


def test_a_resumed_run_meets_the_very_vectors_of_an_uninterrupted_one(pipeline, tmp_path):
    """With MiniLM, the vectors of a text encoded in one batch or another differ in their last bits, and
    without the memo saved a resumed run's parameters drifted from the uninterrupted run's in its first
    update (checked by hand); with it they are the same, memo included."""

    def run(out: Path, iterations: int, resume: bool = False) -> None:
        config = PPOConfig(iterations=iterations, num_envs=2, num_steps=4, vector="sync", beta=0.01,
                           checkpoint_every=1, num_minibatches=2, update_epochs=1)
        finetune(pipeline["run"], PIPELINE, out, config, resume=resume)

    run(tmp_path / "whole", 2)
    run(tmp_path / "cut", 1)
    run(tmp_path / "cut", 2, resume=True)
    whole, resumed = load_file(str(tmp_path / "whole" / STATE_FILE)), load_file(str(tmp_path / "cut" / STATE_FILE))
    assert whole.keys() == resumed.keys() and whole["memo/rollout/vectors"].shape[0] > 8
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key


def test_a_resume_with_the_default_precision_goes_on_in_the_interrupted_runs(pipeline, tmp_path):
    # A run started in bf16 (auto's choice before int8 became the default on CPUs with int8 instructions) and
    # resumed with "auto" goes on in bf16 instead of refusing its own vectors; a precision named differs and fails.
    config = PPOConfig(iterations=1, num_envs=2, num_steps=4, vector="sync", beta=0.01, checkpoint_every=1,
                       num_minibatches=2, update_epochs=1)
    out = tmp_path / "run"
    finetune(pipeline["run"], PIPELINE, out, config, encoder_precision="bf16")
    result = finetune(pipeline["run"], PIPELINE, out, replace(config, iterations=2), resume=True)
    summary = json.loads((out / "finetune.json").read_text())
    assert result.iterations == 2 and summary["encoder_precision"] == "bf16"
    with pytest.raises(UserError, match=r"fine-tuned on embeddings of encoder \S+-bf16-perturn, .* \S+-int8-perturn"):
        finetune(pipeline["run"], PIPELINE, out, replace(config, iterations=3), resume=True, encoder_precision="int8")
