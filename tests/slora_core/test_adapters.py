"""slora_core.adapters against real peft: good adapters give peft's own deltas; bad ones fail
with the right error class and a message naming the problem."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from slora_core.adapters import (
    AdapterError,
    AdapterFormatError,
    AdapterIncompatibleError,
    LoraAdapter,
    digest_adapter_dir,
    load_adapter,
)
from slora_core.config import ModelConfig

HF_CONFIG = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=64,
)
MODEL = ModelConfig.from_dict({**HF_CONFIG, "model_type": "llama"})
CFG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _base_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**HF_CONFIG))


def make_peft_adapter(path: Path, seed: int = 1, **lora: Any) -> Path:
    """Save a PEFT adapter with random (non-zero) A and B on the tiny Llama."""
    base = _base_model()
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(str(path))
    return path


def peft_deltas(path: Path) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, module) -> delta W as peft computes it after loading the directory itself."""
    model = PeftModel.from_pretrained(_base_model(), str(path))
    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, PeftLoraLinear):
            m = re.search(r"layers\.(\d+)\.\w+\.(\w+)$", name)
            assert m is not None, name
            deltas[(int(m[1]), m[2])] = module.get_delta_weight("default").detach()
    return deltas


def assert_matches_peft(adapter: LoraAdapter, path: Path) -> None:
    ref = peft_deltas(path)
    assert set(adapter.weights) == set(ref)
    for key, w in adapter.weights.items():
        ours = w.scale * (w.b.double() @ w.a.double())
        err = (ours - ref[key].double()).norm() / ref[key].double().norm()
        assert err < 1e-5, (key, float(err))


def edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / CFG_FILE).read_text())
    cfg.update(changes)
    (path / CFG_FILE).write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / WEIGHTS_FILE))
    fn(tensors)
    save_file(tensors, str(path / WEIGHTS_FILE))


# ---- good adapters: same modules and deltas as peft --------------------------------------

GOOD_CASES: dict[str, dict[str, Any]] = {
    "list_all_modules": dict(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "regex": dict(r=4, lora_alpha=16,
                  target_modules=r".*\.layers\.[12]\.(self_attn\.(q|v)_proj|mlp\.down_proj)"),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "up_proj"]),
    "rank_alpha_patterns": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        rank_pattern={"v_proj": 2, "layers.1.mlp.down_proj": 6},
        alpha_pattern={"layers.0.self_attn.q_proj": 3, "o_proj": 5}),
    "layers_to_transform": dict(r=4, lora_alpha=8, target_modules=["k_proj", "gate_proj"],
                                layers_to_transform=[0, 2], layers_pattern="layers"),
    "exclude_modules": dict(r=2, lora_alpha=4, target_modules="all-linear",
                            exclude_modules=["down_proj", "k_proj"]),
}


@pytest.mark.parametrize("case", sorted(GOOD_CASES))
def test_good_adapter_matches_peft_delta(tmp_path: Path, case: str) -> None:
    path = make_peft_adapter(tmp_path / case, **GOOD_CASES[case])
    adapter = load_adapter(path, MODEL, max_rank=8)
    assert_matches_peft(adapter, path)
    assert adapter.sha256 == digest_adapter_dir(path)
    assert adapter.rank == max(w.a.shape[0] for w in adapter.weights.values())
    assert adapter.num_bytes == 4 * sum(w.a.numel() + w.b.numel() for w in adapter.weights.values())
    for (_, module), w in adapter.weights.items():
        in_f, out_f = MODEL.module_shape(module)
        assert w.a.shape == (w.rank, in_f) and w.b.shape == (out_f, w.rank)
        assert w.a.is_contiguous() and w.b.is_contiguous() and w.a.dtype == torch.float32


def test_targets_scales_and_metadata(tmp_path: Path) -> None:
    path = make_peft_adapter(tmp_path / "a", **GOOD_CASES["rank_alpha_patterns"])
    edit_config(path, base_model_name_or_path="org/tiny-llama")
    adapter = load_adapter(path, MODEL, max_rank=8)
    assert adapter.target_modules == ("q_proj", "v_proj", "o_proj", "down_proj")
    assert adapter.weights[(1, "down_proj")].rank == 6 and adapter.rank == 6
    assert adapter.weights[(0, "q_proj")].scale == 3 / 4
    assert adapter.weights[(1, "q_proj")].scale == 8 / 4
    assert adapter.weights[(2, "v_proj")].scale == 8 / 2
    assert adapter.weights[(0, "o_proj")].scale == 5 / 4
    assert adapter.base_model_name_or_path == "org/tiny-llama"
    assert adapter.lora_alpha == 8 and not adapter.use_rslora
    assert adapter.config["rank_pattern"] == {"v_proj": 2, "layers.1.mlp.down_proj": 6}


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tmp_path_factory.mktemp("good") / "adapter", r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture
def adapter_dir(good_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good_dir, tmp_path / "adapter"))


def test_all_linear_string_in_config(adapter_dir: Path, tmp_path: Path) -> None:
    path = make_peft_adapter(tmp_path / "all", r=2, lora_alpha=4, target_modules="all-linear")
    edit_config(path, target_modules="ALL-LINEAR")  # peft saves the expanded list; accept both
    adapter = load_adapter(path, MODEL, max_rank=8)
    assert len(adapter.weights) == 7 * MODEL.num_hidden_layers
    assert_matches_peft(adapter, path)


def test_adapter_name_segment_in_keys(adapter_dir: Path) -> None:
    expected = load_adapter(adapter_dir, MODEL, max_rank=8)

    def rename(t: dict[str, torch.Tensor]) -> None:
        for key in list(t):
            t[key.replace(".weight", ".default.weight")] = t.pop(key)

    edit_tensors(adapter_dir, rename)
    adapter = load_adapter(adapter_dir, MODEL, max_rank=8)
    for key, w in expected.weights.items():
        assert torch.equal(adapter.weights[key].a, w.a) and torch.equal(adapter.weights[key].b, w.b)


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_are_converted(adapter_dir: Path, stored: torch.dtype, dtype: torch.dtype) -> None:
    edit_tensors(adapter_dir, lambda t: t.update({k: v.to(stored) for k, v in t.items()}))
    source = load_file(str(adapter_dir / WEIGHTS_FILE))
    adapter = load_adapter(adapter_dir, MODEL, max_rank=8, dtype=dtype)
    w = adapter.weights[(0, "q_proj")]
    assert w.a.dtype == dtype and w.b.dtype == dtype
    assert torch.equal(w.a, source[f"{Q0}.lora_A.weight"].to(dtype))
    assert adapter.num_bytes == sum(
        (x.a.numel() + x.b.numel()) * x.a.element_size() for x in adapter.weights.values())


# ---- digest -------------------------------------------------------------------------------

def test_digest_is_the_documented_layout(adapter_dir: Path) -> None:
    h = hashlib.sha256()
    for name in (CFG_FILE, WEIGHTS_FILE):
        data = (adapter_dir / name).read_bytes()
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    assert digest_adapter_dir(adapter_dir) == h.hexdigest()
    adapter = load_adapter(adapter_dir, MODEL, max_rank=8,
                           expected_sha256=h.hexdigest().upper())
    assert adapter.sha256 == h.hexdigest()


def test_digest_covers_config_and_weights(adapter_dir: Path) -> None:
    first = digest_adapter_dir(adapter_dir)
    edit_config(adapter_dir, lora_alpha=9)
    second = digest_adapter_dir(adapter_dir)
    edit_tensors(adapter_dir, lambda t: t[f"{Q0}.lora_A.weight"].mul_(2))
    assert len({first, second, digest_adapter_dir(adapter_dir)}) == 3


# ---- bad adapters -------------------------------------------------------------------------

def _set_tensor(key: str, value: torch.Tensor) -> Callable[[Path], None]:
    return lambda p: edit_tensors(p, lambda t: t.update({key: value}))


def _config(**changes: Any) -> Callable[[Path], None]:
    return lambda p: edit_config(p, **changes)


def _drop_field(name: str) -> Callable[[Path], None]:
    def fn(p: Path) -> None:
        cfg = json.loads((p / CFG_FILE).read_text())
        del cfg[name]
        (p / CFG_FILE).write_text(json.dumps(cfg))
    return fn


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda p: (p / name).write_bytes(data)


def _bin_only(p: Path) -> None:
    (p / WEIGHTS_FILE).rename(p / "adapter_model.bin")


def _truncate(p: Path) -> None:
    data = (p / WEIGHTS_FILE).read_bytes()
    (p / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])


def _move_layer(src: int, dst: int) -> Callable[[Path], None]:
    def fn(t: dict[str, torch.Tensor]) -> None:
        for key in [k for k in t if f".layers.{src}." in k]:
            t[key.replace(f".layers.{src}.", f".layers.{dst}.")] = t.pop(key)
    return lambda p: edit_tensors(p, fn)


def _drop(pattern: str) -> Callable[[Path], None]:
    return lambda p: edit_tensors(p, lambda t: [t.pop(k) for k in list(t) if pattern in k])


def _scaled_a(value: float, dtype: torch.dtype = torch.float32) -> Callable[[Path], None]:
    def fn(t: dict[str, torch.Tensor]) -> None:
        a = t[f"{Q0}.lora_A.weight"].to(dtype)
        a[0, 0] = value
        t[f"{Q0}.lora_A.weight"] = a
    return lambda p: edit_tensors(p, fn)


def _all_to(dtype: torch.dtype) -> Callable[[Path], None]:
    return lambda p: edit_tensors(p, lambda t: t.update({k: v.to(dtype) for k, v in t.items()}))


FORMAT, INCOMPATIBLE = AdapterFormatError, AdapterIncompatibleError
BAD_CASES: dict[str, tuple[Callable[[Path], None], type[AdapterError], str]] = {
    "no_config": (lambda p: (p / CFG_FILE).unlink(), FORMAT, "adapter_config.json not found"),
    "no_weights": (lambda p: (p / WEIGHTS_FILE).unlink(), FORMAT,
                   "adapter_model.safetensors not found"),
    "pickle_only": (_bin_only, FORMAT, "only adapter_model.bin"),
    "malformed_json": (_write(CFG_FILE, b'{"r": 4,'), FORMAT, "not valid JSON"),
    "json_not_object": (_write(CFG_FILE, b"[1]"), FORMAT, "JSON object"),
    "no_peft_type": (_drop_field("peft_type"), FORMAT, "lacks 'peft_type'"),
    "missing_r": (_drop_field("r"), FORMAT, "lacks required field 'r'"),
    "r_not_int": (_config(r="4"), FORMAT, "r='4'"),
    "bad_rank_pattern_regex": (_config(rank_pattern={"q_proj(": 2}), FORMAT, "rank_pattern key"),
    "peft_type_loha": (_config(peft_type="LOHA"), INCOMPATIBLE, "peft_type 'LOHA'"),
    "dora_config": (_config(use_dora=True), INCOMPATIBLE, "use_dora"),
    "dora_tensor": (_set_tensor(f"{Q0}.lora_magnitude_vector", torch.ones(32)), INCOMPATIBLE,
                    "DoRA"),
    "modules_to_save": (_config(modules_to_save=["lm_head"]), INCOMPATIBLE, "modules_to_save"),
    "modules_to_save_tensor": (_set_tensor("base_model.model.lm_head.modules_to_save.weight",
                                           torch.ones(64, 32)), INCOMPATIBLE, "modules_to_save"),
    "bias_all": (_config(bias="all"), INCOMPATIBLE, "bias='all'"),
    "lora_bias": (_config(lora_bias=True), INCOMPATIBLE, "lora_bias"),
    "lora_bias_tensor": (_set_tensor(f"{Q0}.lora_B.bias", torch.ones(32)), INCOMPATIBLE,
                         "lora_bias"),
    "embedding_target": (_config(target_modules=["q_proj", "embed_tokens"]), INCOMPATIBLE,
                         "embed_tokens"),
    "lm_head_target": (_config(target_modules=r".*(q_proj|lm_head)"), INCOMPATIBLE, "lm_head"),
    "embedding_tensor": (_set_tensor("base_model.model.model.embed_tokens.lora_embedding_A",
                                     torch.ones(4, 64)), INCOMPATIBLE, "embedding"),
    "lm_head_tensor": (_set_tensor("base_model.model.lm_head.lora_A.weight", torch.ones(4, 32)),
                       INCOMPATIBLE, "lm_head"),
    "unknown_target": (_config(target_modules=["q_proj", "query_key_value"]), INCOMPATIBLE,
                       "'query_key_value' does not exist"),
    "non_linear_target": (_config(target_modules=["q_proj", "mlp"]), INCOMPATIBLE,
                          "not one of the linear layers"),
    "regex_matches_nothing": (_config(target_modules=r".*\.attn\.c_attn"), INCOMPATIBLE,
                              "selects no module"),
    "unknown_module_tensor": (_set_tensor(
        "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight", torch.ones(4, 32)),
        INCOMPATIBLE, "qkv_proj"),
    "layer_out_of_range": (_move_layer(2, 7), INCOMPATIBLE, "layer 7"),
    "layers_to_transform_out_of_range": (_config(layers_to_transform=[0, 5]), INCOMPATIBLE,
                                         "layers_to_transform names layer 5"),
    "a_b_rank_disagree": (_set_tensor(f"{Q0}.lora_B.weight", torch.ones(32, 3)), FORMAT,
                          "has rank 4 but lora_B [32, 3] has rank 3"),
    "rank_disagrees_with_config": (_config(r=2), FORMAT, "config gives it rank 2"),
    "a_wrong_in_features": (_set_tensor(f"{Q0}.lora_A.weight", torch.ones(4, 33)), INCOMPATIBLE,
                            "in_features=32"),
    "a_not_2d": (_set_tensor(f"{Q0}.lora_A.weight", torch.ones(4, 32, 1)), FORMAT, "expected 2-D"),
    "missing_b": (_drop(f"{Q0}.lora_B"), FORMAT, "has no lora_B tensor"),
    "missing_pair": (_drop("layers.1.mlp.down_proj"), FORMAT,
                     "targets model.layers.1.mlp.down_proj, but"),
    "duplicate_adapter_names": (_set_tensor(f"{Q0}.lora_A.other.weight", torch.ones(4, 32)),
                                FORMAT, "both lora_A"),
    "nan": (_scaled_a(float("nan")), FORMAT, f"{Q0}.lora_A.weight' contains non-finite"),
    "inf_fp16": (_scaled_a(float("inf"), torch.float16), FORMAT, "non-finite"),
    "float64": (_all_to(torch.float64), FORMAT, "dtype torch.float64"),
    "int8": (_all_to(torch.int8), FORMAT, "dtype torch.int8"),
    "truncated": (_truncate, FORMAT, "not a valid safetensors file"),
    "garbage": (_write(WEIGHTS_FILE, b"\x00" * 64), FORMAT, "not a valid safetensors file"),
    "empty_file": (lambda p: save_file({}, str(p / WEIGHTS_FILE)), FORMAT, "holds no tensors"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_adapter(adapter_dir: Path, case: str) -> None:
    mutate, error, fragment = BAD_CASES[case]
    mutate(adapter_dir)
    with pytest.raises(error) as info:
        load_adapter(adapter_dir, MODEL, max_rank=8)
    assert fragment in str(info.value)


def test_untargeted_tensor_names_it(adapter_dir: Path) -> None:
    edit_config(adapter_dir, target_modules=["q_proj", "v_proj"])
    with pytest.raises(AdapterFormatError, match=r"mlp\.down_proj\.lora_A\.weight.* does not target"):
        load_adapter(adapter_dir, MODEL, max_rank=8)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(AdapterFormatError, match="does not exist"):
        load_adapter(tmp_path / "nope", MODEL, max_rank=8)
    with pytest.raises(AdapterFormatError, match="does not exist"):
        digest_adapter_dir(tmp_path / "nope")


def test_rank_above_max_rank(adapter_dir: Path) -> None:
    with pytest.raises(AdapterIncompatibleError, match="rank 4, above this engine's max_rank=2"):
        load_adapter(adapter_dir, MODEL, max_rank=2)


def test_other_base_model_shapes(adapter_dir: Path) -> None:
    wider = ModelConfig.from_dict({**HF_CONFIG, "hidden_size": 64})
    with pytest.raises(AdapterIncompatibleError, match=r"do not fit the base \w+ \(in_features="):
        load_adapter(adapter_dir, wider, max_rank=8)
    shallower = ModelConfig.from_dict({**HF_CONFIG, "num_hidden_layers": 2})
    with pytest.raises(AdapterIncompatibleError, match="layer 2, but the base model has 2 layers"):
        load_adapter(adapter_dir, shallower, max_rank=8)


def test_fp16_overflow(adapter_dir: Path) -> None:
    _scaled_a(1e6)(adapter_dir)
    load_adapter(adapter_dir, MODEL, max_rank=8, dtype=torch.float32)
    with pytest.raises(AdapterFormatError, match="overflows torch.float16"):
        load_adapter(adapter_dir, MODEL, max_rank=8, dtype=torch.float16)


def test_sha256_mismatch(adapter_dir: Path) -> None:
    with pytest.raises(AdapterFormatError, match="sha256 mismatch"):
        load_adapter(adapter_dir, MODEL, max_rank=8, expected_sha256="0" * 64)


def test_error_classes_are_value_errors() -> None:
    assert issubclass(AdapterFormatError, AdapterError)
    assert issubclass(AdapterIncompatibleError, AdapterError)
    assert issubclass(AdapterError, ValueError)
