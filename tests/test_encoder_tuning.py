"""Fine-tuning the encoder's top layers: exactness at the start, training, checkpoints, decision time."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from learn_data import K, color_lock_dataset, fresh_copy
from learn_data import whole_text_encoder as encoder  # tuning is over whole state texts
from learn_envs import SPEC
from safetensors.torch import load_file

from offline_agent.errors import UserError
from offline_agent.learn.encoder_tuning import ENCODER_FILE, EncoderTop, TokenStates, additive_mask, token_states
from offline_agent.learn.policy import Policy, load_value_network
from offline_agent.learn.train import train
from offline_agent.text.states import StateSettings
from offline_agent.text.tuning import LAYER_PREFIX, tuned_encoder_id, weights_digest

STATE = StateSettings(k=K, per_turn=False)

TEXTS = [
    "hello",
    "Task: deliver O-6890 3 x medical_kits to river_mall.\n[obs] arrived at mill_rd.",
    "inventory at north_warehouse: water 19, tires 2, medical_kits 17 " * 30,  # cut at 256 tokens
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(("n_top", "mask_builder"), [(1, True), (2, True), (1, False)])
def test_the_untrained_top_over_cached_states_gives_the_frozen_vectors(n_top, mask_builder, monkeypatch):
    if not mask_builder:  # transformers before 4.53 has no masking_utils: the layers take our additive mask
        monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)  # `from ... import` raises ImportError
    frozen = torch.from_numpy(encoder().encode(TEXTS))
    states = token_states(encoder(), TEXTS, n_top)
    hidden, mask = states.gather(torch.arange(len(TEXTS)))
    tuned = EncoderTop(encoder(), n_top)(hidden, mask)
    # The cached states are float16: agreement to ~1e-4, not bit for bit.
    assert (tuned - frozen).abs().max().item() < 1e-3
    assert int(mask.sum(1)[2]) == encoder().max_length  # the long text was cut like `encode` cuts it


def test_the_additive_mask_blocks_padding_with_the_dtype_minimum():
    assert additive_mask(torch.tensor([[1, 0]]), torch.float32).tolist() == [[[[0.0, torch.finfo().min]]]]


def test_token_states_gather_pads_each_text_to_the_longest_and_masks_the_rest():
    hidden = torch.arange(12, dtype=torch.float16).reshape(6, 2)  # 3 texts of 1, 3, 2 tokens
    states = TokenStates(hidden, torch.tensor([0, 1, 4, 6]))
    out, mask = states.gather(torch.tensor([2, 0, 1]))
    assert mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert out[0].tolist() == [[8, 9], [10, 11], [0, 0]]
    assert out[1].tolist() == [[0, 1], [0, 0], [0, 0]]
    assert out[2].tolist() == [[2, 3], [4, 5], [6, 7]]
    assert out.dtype == torch.float32 and len(states) == 3


def test_the_weights_digest_changes_with_any_weight_and_names_the_tuned_encoder():
    state = {"layers.0.w": torch.zeros(3), "layers.0.b": torch.ones(2)}
    digest = weights_digest(state)
    assert weights_digest(dict(reversed(list(state.items())))) == digest  # order of the dict does not matter
    changed = {**state, "layers.0.w": torch.tensor([0.0, 0.0, 1e-6])}
    assert weights_digest(changed) != digest
    assert tuned_encoder_id("base-0123", state) == f"base-0123-tuned-{digest[:12]}"


def _train_tuned(tmp_path, algo, name="run", seed=0, lora_rank=0, action_gradient=False):
    dataset = tmp_path / "ds" if (tmp_path / "ds").exists() else fresh_copy(tmp_path / "ds")
    settings = {"tune_encoder_layers": 1, "encoder_learning_rate": 1e-3, "encoder_lora_rank": lora_rank,
                "encoder_action_gradient": action_gradient}
    return train(dataset, algo, tmp_path / name, steps=30, batch_size=16, seed=seed, state_settings=STATE,
                 encoder=encoder(), settings=settings)


def test_lora_starts_as_the_base_layers_and_trains_only_its_updates():
    full, lora = EncoderTop(encoder(), 1), EncoderTop(encoder(), 1, lora_rank=4)
    base_state, lora_state = full.layer_state(), lora.layer_state()
    assert set(base_state) == set(lora_state)
    assert all(torch.equal(base_state[n], lora_state[n]) for n in base_state)  # B = 0: merged W is W
    trainable = [name for name, p in lora.named_parameters() if p.requires_grad]
    # BERT's layer has six Linear layers (query, key, value, attention output, intermediate, output).
    assert len(trainable) == 12 and all(".lora_" in name for name in trainable)
    hidden, mask = token_states(encoder(), TEXTS, 1).gather(torch.arange(len(TEXTS)))
    assert torch.allclose(lora(hidden, mask), full(hidden, mask), atol=1e-6)


@pytest.mark.parametrize(
    ("algo", "lora_rank", "action_gradient"), [("cql", 0, False), ("bc", 0, True), ("bc", 4, False)]
)
def test_a_tuned_run_saves_its_layers_and_plays_with_them(algo, lora_rank, action_gradient, tmp_path):
    result = _train_tuned(tmp_path, algo, lora_rank=lora_rank, action_gradient=action_gradient)
    meta = json.loads((result.run_dir / "policy.json").read_text())
    layers = load_file(str(result.run_dir / ENCODER_FILE))
    base = encoder().id
    assert meta["encoder"]["tuned"] == {"layers": 1, "base_id": base}
    assert meta["encoder"]["id"] == tuned_encoder_id(base, layers) != base
    assert all(name.startswith(LAYER_PREFIX + "0.") for name in layers)

    # The loss moved the layers away from the base encoder's.
    untrained = EncoderTop(encoder(), 1).layer_state()
    assert set(untrained) == set(layers)
    assert max((layers[n] - untrained[n]).abs().max().item() for n in layers) > 1e-4

    # At decision time the policy's encoder is the base with the tuned layers: its vectors are those the
    # tuned top computes from the cached states, and they differ from the frozen ones.
    policy = Policy.load(result.run_dir)
    assert policy.encoder.id == meta["encoder"]["id"] and policy.encoder.tuned_layers == 1
    texts = TEXTS
    top = EncoderTop(encoder(), 1)
    top.layers.load_state_dict({n[len(LAYER_PREFIX) :]: t for n, t in layers.items()})
    hidden, mask = token_states(encoder(), texts, 1).gather(torch.arange(len(texts)))
    expected = top(hidden, mask)
    assert (torch.from_numpy(policy.encoder.encode(texts)) - expected).abs().max().item() < 1e-3
    assert (torch.from_numpy(encoder().encode(texts)) - expected).abs().max().item() > 1e-4

    # Given the base encoder (as `evaluate --encoder` would), the policy still gets its tuned copy.
    assert Policy.load(result.run_dir, encoder=encoder()).encoder.id == meta["encoder"]["id"]
    summary = json.loads((result.run_dir / "train.json").read_text())
    assert summary["encoder_tuning"]["layers"] == 1 and summary["encoder_tuning"]["state_texts"] > 0
    assert summary["encoder_tuning"]["action_gradient"] is action_gradient
    # No value network: it would learn on the frozen vectors and be scored on the tuned ones.
    assert "skipped" in summary["value_network"] and load_value_network(result.run_dir) is None


@pytest.mark.parametrize("action_gradient", [False, True])
def test_actions_teach_the_layers_only_with_action_gradient(action_gradient):
    from offline_agent.learn.encoder_tuning import EncoderTuner
    from offline_agent.learn.features import build_features, make_batch

    features = build_features(color_lock_dataset(), encoder(), STATE, keep_texts=True)
    tuner = EncoderTuner(encoder(), features, 1, action_gradient=action_gradient)
    rows = torch.arange(8)
    batch = tuner.batch(make_batch(features, rows, torch.Generator().manual_seed(0)), rows, features, step=1)
    assert batch.state.requires_grad
    assert batch.cand.requires_grad is action_gradient and batch.action.requires_grad is action_gradient
    if action_gradient:
        batch.cand.sum().backward()  # a loss of the candidates' vectors alone reaches the layers
        assert max(p.grad.abs().max().item() for p in tuner.parameters()) > 0
    # Either way the batch's vectors are the tuned encoder's, which starts as the frozen one.
    assert torch.allclose(batch.state, features.state_emb[rows], atol=1e-3)
    assert torch.allclose(batch.cand, features.action_emb[batch.cand_ids.clamp(min=0)], atol=1e-3)


def test_tuning_is_deterministic_under_a_seed(tmp_path):
    first = _train_tuned(tmp_path, "bc", "a")
    second = _train_tuned(tmp_path, "bc", "b")
    ids = [json.loads((r.run_dir / "policy.json").read_text())["encoder"]["id"] for r in (first, second)]
    assert ids[0] == ids[1]


def test_a_tuned_policy_without_its_layers_file_is_a_clear_error(tmp_path):
    result = _train_tuned(tmp_path, "bc")
    (result.run_dir / ENCODER_FILE).unlink()
    with pytest.raises(UserError, match="encoder.safetensors is missing"):
        Policy.load(result.run_dir)


def test_tuned_layers_refuse_another_base_encoder():
    with pytest.raises(UserError, match="trained on top of encoder other-0000"):
        encoder().__class__().load_tuned_layers(EncoderTop(encoder(), 1).layer_state(), base_id="other-0000")


@pytest.mark.parametrize(
    ("algo", "settings", "message"),
    [
        ("cql", {"tune_encoder_layers": -1}, "tune_encoder_layers must be >= 0"),
        ("bc", {"tune_encoder_layers": 7}, "between 1 and the encoder's 6 layers"),
        ("cql", {"tune_encoder_layers": 1, "encoder_learning_rate": 0.0}, "encoder_learning_rate must be > 0"),
        ("bc", {"tune_encoder_layers": 1, "encoder_lora_rank": -2}, "encoder_lora_rank must be >= 0"),
        ("d3rlpy-cql", {"tune_encoder_layers": 1}, "has no setting tune_encoder_layers"),
    ],
)
def test_bad_tuning_settings_are_one_line_errors(algo, settings, message, tmp_path):
    with pytest.raises(UserError, match=message):
        train(fresh_copy(tmp_path / "ds"), algo, tmp_path / "run", steps=2, state_settings=STATE, encoder=encoder(),
              settings=settings)


def test_fine_tuning_online_keeps_the_tuned_layers(tmp_path):
    from offline_agent.online.config import PPOConfig
    from offline_agent.online.finetune import finetune

    result = _train_tuned(tmp_path, "cql")
    out = tmp_path / "ppo"
    finetune(result.run_dir, SPEC, out, PPOConfig(iterations=1, num_envs=2, num_steps=4, torch_threads=1))
    assert (out / ENCODER_FILE).read_bytes() == (result.run_dir / ENCODER_FILE).read_bytes()
    assert Policy.load(out).encoder.id == Policy.load(result.run_dir).encoder.id
