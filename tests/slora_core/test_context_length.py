"""max_model_len comes from the model's config (rope scaling included), may be lowered but not
raised, and too-long prompts are refused with the limit in the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.demo_assets import write_demo_assets
from slora_core.config import ConfigError, EngineConfig, ModelConfig
from slora_core.engine import LLMEngine, RequestError
from slora_core.sampling_params import SamplingParams

BASE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 50,
        "max_position_embeddings": 1024}


@pytest.mark.parametrize("extra, expected", [
    ({}, 1024),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 4096),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 2048),  # transformers 4.3x key
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 512}}, 2048),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}, 1024),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, 2048),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 1024),
])
def test_model_limit_follows_max_position_embeddings_and_rope_scaling(extra, expected):
    assert ModelConfig.from_dict({**BASE, **extra}).max_model_len == expected


def test_engine_config_resolves_against_the_model():
    model = ModelConfig.from_dict(BASE)
    assert EngineConfig().max_model_len is None
    assert EngineConfig().resolve_max_model_len(model) == 1024
    assert EngineConfig(max_model_len=300).resolve_max_model_len(model) == 300
    with pytest.raises(ConfigError, match="max_model_len=1025 exceeds the model's limit of 1024"):
        EngineConfig(max_model_len=1025).resolve_max_model_len(model)
    with pytest.raises(ConfigError, match="must be positive"):
        EngineConfig(max_model_len=0)
    # A sliding window this engine does not implement caps the default instead of refusing.
    mistral = ModelConfig.from_dict({**BASE, "model_type": "mistral", "sliding_window": 256})
    assert EngineConfig().resolve_max_model_len(mistral) == 256
    with pytest.raises(ConfigError, match="max_model_len <= 256"):
        EngineConfig(max_model_len=512).resolve_max_model_len(mistral)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with a 96-token context (its llama3 rope scaling keeps that length)."""
    root = tmp_path_factory.mktemp("ctx")
    return write_demo_assets(root, model_overrides={"max_position_embeddings": 96},
                             adapters=()).model_dir


def test_engine_takes_the_limit_from_the_model_dir(small_model):
    engine = LLMEngine.from_model_dir(small_model, EngineConfig(num_pages=32))
    assert engine.max_model_len == engine.config.max_model_len == 96
    engine.add_request("fits", [5] * 90, SamplingParams(max_new_tokens=6, temperature=0))
    with pytest.raises(RequestError, match=r"\(91 tokens\).*max_model_len=96"):
        engine.add_request("long", [5] * 91, SamplingParams(max_new_tokens=6))
    with pytest.raises(RequestError, match="max_model_len=96"):
        engine.add_request("text", "The quick brown fox " * 40, SamplingParams(max_new_tokens=1))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["fits"].completion_tokens == 6 and outs["fits"].prompt_tokens == 90
    assert set(outs) == {"fits"}  # the refused requests left nothing behind


def test_a_lower_override_is_served_and_a_higher_one_refused(small_model):
    engine = LLMEngine.from_model_dir(small_model, EngineConfig(num_pages=32, max_model_len=40))
    assert engine.config.max_model_len == 40
    with pytest.raises(RequestError, match=r"max_model_len=40"):
        engine.add_request("r", [5] * 36, SamplingParams(max_new_tokens=5))
    engine.add_request("r", [5] * 36, SamplingParams(max_new_tokens=4))
    with pytest.raises(ConfigError, match="exceeds the model's limit of 96 tokens"):
        LLMEngine.from_model_dir(small_model, EngineConfig(max_model_len=97))
