"""Our paged Llama-family model against Hugging Face transformers' own implementation."""

from __future__ import annotations

import pytest
import torch

from slora_core.config import ConfigError, ModelConfig
from slora_core.model import LlamaForCausalLM
from slora_core.model.rope import rope_settings
from slora_core.weights import load_model

PROMPT_A = [0, 17, 250, 3, 99, 141, 7, 7, 62, 201, 88, 13, 45, 190, 2, 77, 31]
PROMPT_B = [0, 5, 260, 111, 42, 9, 160, 33]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@torch.no_grad()
def hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


def test_demo_model_matches_hf_for_a_mixed_prefill(demo_dir, paged_kv):
    from transformers import AutoModelForCausalLM

    model_dir = demo_dir / "model"
    ours = load_model(model_dir, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert rope_settings(ours.config).rope_type == "llama3"
    kv = paged_kv(ours.config, block_size=4)
    a, b = kv.add_sequence(), kv.add_sequence()
    out = kv.step(ours, {a: PROMPT_A, b: PROMPT_B})
    assert rel_err(out[a], hf_logits(hf, PROMPT_A)) < 1e-4
    assert rel_err(out[b], hf_logits(hf, PROMPT_B)) < 1e-4


VARIANTS = {
    "qwen2-qkv-bias": ("qwen2", {}),
    "tied-embeddings": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "mha-no-gqa": ("llama", {"num_key_value_heads": 4}),
    "mistral": ("mistral", {"sliding_window": None}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),  # q/k/v and o_proj biases
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_hf(variant, hf_checkpoint, paged_kv):
    model_type, overrides = VARIANTS[variant]
    path, hf = hf_checkpoint(model_type, **overrides)
    ours = load_model(path, torch.float32, "cpu")
    kv = paged_kv(ours.config, block_size=8)
    seq = kv.add_sequence()
    assert rel_err(kv.step(ours, {seq: PROMPT_A})[seq], hf_logits(hf, PROMPT_A)) < 1e-4


def test_bias_and_rope_variants_are_exercised(hf_checkpoint):
    # Guards the variant test against silently testing a plain Llama.
    path, _ = hf_checkpoint("qwen2")
    model = load_model(path, torch.float32, "cpu")
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0
    for variant in ("llama3-rope", "linear-rope"):
        path, _ = hf_checkpoint(VARIANTS[variant][0], **VARIANTS[variant][1])
        settings = rope_settings(ModelConfig.from_hf_dir(path))
        assert settings.rope_type == variant.split("-")[0]
        assert settings.theta == VARIANTS[variant][1].get("rope_theta", 10000.0)


def test_chunked_prefill_and_decode_match_one_full_prefill(demo_dir, paged_kv):
    from transformers import AutoModelForCausalLM

    model_dir = demo_dir / "model"
    ours = load_model(model_dir, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    decode = [300, 12, 480]
    kv = paged_kv(ours.config, block_size=4)
    a, b = kv.add_sequence(), kv.add_sequence()
    steps = [
        {a: PROMPT_A[:6], b: PROMPT_B},          # a: first chunk, b: whole prompt
        {a: PROMPT_A[6:], b: decode[:1]},        # a: second chunk, b: decode
        {a: decode[:1], b: decode[1:2]},         # both decode
        {b: decode[2:], a: decode[1:2]},         # order in the batch changes
    ]
    got: dict[int, list[torch.Tensor]] = {a: [], b: []}
    for chunks in steps:
        for seq, logits in kv.step(ours, chunks).items():
            got[seq].append(logits)
    full_a, full_b = PROMPT_A + decode[:2], PROMPT_B + decode
    assert rel_err(torch.cat(got[a]), hf_logits(hf, full_a)) < 1e-4
    assert rel_err(torch.cat(got[b]), hf_logits(hf, full_b)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_float32(dtype, demo_dir, paged_kv):
    model_dir = demo_dir / "model"
    ref_model = load_model(model_dir, torch.float32, "cpu")
    model = load_model(model_dir, dtype, "cpu")
    assert model.lm_head.weight.dtype == dtype
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    kv32, kvh = paged_kv(ref_model.config), paged_kv(model.config, dtype=dtype)
    s32, sh = kv32.add_sequence(), kvh.add_sequence()
    ref = kv32.step(ref_model, {s32: PROMPT_A})[s32]
    out = kvh.step(model, {sh: PROMPT_A})[sh]
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 5e-2
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_model_needs_a_step_context():
    config = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         vocab_size=50)
    model = LlamaForCausalLM(config)
    with pytest.raises(RuntimeError, match="step context"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]))


@pytest.mark.parametrize("scaling", [{"rope_type": "dynamic", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0}])
def test_unsupported_or_incomplete_rope_scaling_is_rejected(scaling):
    config = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         vocab_size=50, rope_scaling=scaling)
    with pytest.raises(ConfigError, match="rope"):
        LlamaForCausalLM(config)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_demo_model_on_cuda_matches_hf_on_cpu(demo_dir, paged_kv):
    from transformers import AutoModelForCausalLM

    model_dir = demo_dir / "model"
    ours = load_model(model_dir, torch.float32, "cuda")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kv = paged_kv(ours.config, block_size=16, device="cuda")
    a, b = kv.add_sequence(), kv.add_sequence()
    out = kv.step(ours, {a: PROMPT_A[:9], b: PROMPT_B})
    out_a2 = kv.step(ours, {a: PROMPT_A[9:], b: [3]})
    assert rel_err(torch.cat([out[a], out_a2[a]]).cpu(), hf_logits(hf, PROMPT_A)) < 1e-3
    assert rel_err(torch.cat([out[b], out_a2[b]]).cpu(), hf_logits(hf, PROMPT_B + [3])) < 1e-3


@needs_cuda
def test_random_llama2_7b_shapes_run_in_fp16_on_cuda(paged_kv):
    from slora_core.weights import build_random_model

    config = ModelConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                         vocab_size=32000, rms_norm_eps=1e-5)
    model = build_random_model(config, torch.float16, "cuda", seed=0)
    kv = paged_kv(config, dtype=torch.float16, num_pages=48, block_size=16, device="cuda")
    a, b = kv.add_sequence(), kv.add_sequence()
    gen = torch.Generator().manual_seed(0)
    prompt_a = torch.randint(0, 32000, (300,), generator=gen).tolist()
    prompt_b = torch.randint(0, 32000, (77,), generator=gen).tolist()
    out = kv.step(model, {a: prompt_a, b: prompt_b})
    dec = kv.step(model, {a: [int(out[a][-1].argmax())], b: [int(out[b][-1].argmax())]})
    for logits in (out[a], out[b], dec[a], dec[b]):
        assert torch.isfinite(logits).all()
        assert 0.1 < logits.std().item() < 100
