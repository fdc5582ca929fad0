"""Loading HF checkpoints (single file, sharded, tied) and the errors for bad ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from slora_core.config import ConfigError, ModelConfig
from slora_core.weights import build_random_model, checkpoint_shapes, load_model

PROMPT = [0, 17, 250, 3, 99, 141, 7, 62, 201, 88, 13]


def logits_of(model, paged_kv, ids=PROMPT):
    kv = paged_kv(model.config)
    seq = kv.add_sequence()
    return kv.step(model, {seq: ids})[seq]


def test_sharded_checkpoint_loads_and_matches_hf(hf_checkpoint, paged_kv):
    path, hf = hf_checkpoint("llama", max_shard_size="40KB")
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (path / "model.safetensors.index.json").is_file()
    ours = load_model(path, torch.float32, "cpu")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    out = logits_of(ours, paged_kv)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_fused_projections_hold_hf_rows_in_order(hf_checkpoint):
    path, hf = hf_checkpoint("qwen2")
    ours = load_model(path, torch.float32, "cpu")
    attn, hf_attn = ours.model.layers[1].self_attn, hf.model.layers[1].self_attn
    for part in ("weight", "bias"):
        expected = torch.cat([getattr(hf_attn.q_proj, part), getattr(hf_attn.k_proj, part),
                              getattr(hf_attn.v_proj, part)])
        assert torch.equal(getattr(attn.qkv_proj, part), expected)
    mlp, hf_mlp = ours.model.layers[1].mlp, hf.model.layers[1].mlp
    assert torch.equal(mlp.gate_up_proj.weight,
                       torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]))


def test_tied_embeddings_share_one_tensor(hf_checkpoint):
    path, _ = hf_checkpoint("llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    ours = load_model(path, torch.float32, "cpu")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_checkpoint_shapes_are_those_transformers_saves(hf_checkpoint):
    for model_type, overrides in (("qwen2", {}), ("llama", {"tie_word_embeddings": True})):
        path, _ = hf_checkpoint(model_type, **overrides)
        saved = {k: tuple(v.shape) for k, v in load_file(path / "model.safetensors").items()}
        assert checkpoint_shapes(ModelConfig.from_hf_dir(path)) == saved


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor_is_named(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"lacks tensors \['model\.layers\.1\.mlp\.up_proj"):
        load_model(path, torch.float32, "cpu")


def test_missing_lm_head_of_an_untied_model_is_named(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    _rewrite(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ConfigError, match="lm_head.weight"):
        load_model(path, torch.float32, "cpu")


def test_unexpected_tensor_names_file_and_tensor(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(ConfigError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias' in .*model\.safetensors"):
        load_model(path, torch.float32, "cpu")


def test_wrong_shape_names_file_tensor_and_shapes(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(ConfigError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' in .*model\.safetensors has shape \(16, 64\), expected \(32, 64\)"):
        load_model(path, torch.float32, "cpu")


def test_integer_tensor_is_rejected(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    _rewrite(path, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(ConfigError, match=r"'model\.norm\.weight' .* dtype torch\.int32"):
        load_model(path, torch.float32, "cpu")


def test_index_naming_a_missing_shard_is_reported(hf_checkpoint):
    path, _ = hf_checkpoint("llama", max_shard_size="40KB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ConfigError, match=f"{victim.name} is listed in .*index.json"):
        load_model(path, torch.float32, "cpu")


def test_bad_index_and_no_weights_are_reported(hf_checkpoint):
    path, _ = hf_checkpoint("llama", max_shard_size="40KB")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ConfigError, match="not a valid safetensors index"):
        load_model(path, torch.float32, "cpu")
    path, _ = hf_checkpoint("llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no safetensors weights"):
        load_model(path, torch.float32, "cpu")


def test_tensor_in_two_shards_is_reported(hf_checkpoint):
    path, _ = hf_checkpoint("llama", max_shard_size="40KB")
    first, second = sorted(path.glob("model-*.safetensors"))[:2]
    tensors = load_file(second)
    tensors.update(load_file(first))
    save_file(tensors, str(second))
    with pytest.raises(ConfigError, match="appears in both"):
        load_model(path, torch.float32, "cpu")


def test_random_model_is_seeded_finite_and_scaled(paged_kv):
    config = ModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         vocab_size=500, tie_word_embeddings=True, attention_bias=True)
    a = build_random_model(config, torch.float32, "cpu", seed=3)
    b = build_random_model(config, torch.float32, "cpu", seed=3)
    c = build_random_model(config, torch.float32, "cpu", seed=4)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.lm_head.weight is a.model.embed_tokens.weight
    w = a.model.layers[0].mlp.down_proj.weight
    assert 0.015 < w.std().item() < 0.025
    assert torch.equal(a.model.norm.weight, torch.ones(128))
    logits = logits_of(a, paged_kv, [1, 2, 3, 4, 5])
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_random_model_in_bf16_keeps_float32_rope():
    config = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=100, rope_theta=500000.0)
    model = build_random_model(config, torch.bfloat16, "cpu", seed=0)
    assert model.lm_head.weight.dtype == torch.bfloat16
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32
    expected = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.equal(inv_freq, expected)
