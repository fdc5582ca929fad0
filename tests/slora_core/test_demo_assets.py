"""The demo assets load unchanged in transformers + peft, are deterministic, and every adapter
changes the tiny model's greedy output."""

from __future__ import annotations

import argparse
import hashlib
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from devtools.demo_assets import ADAPTERS, CORPUS, write_demo_assets
from services.commands import demo_assets as demo_assets_command

PROMPTS = ["The quick brown fox", "Once upon a time in the city", "Music from the"]


def digests(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_writes_identical_files_and_another_seed_differs(demo_dir, tmp_path):
    write_demo_assets(tmp_path / "again", seed=0)
    assert digests(tmp_path / "again") == digests(demo_dir)
    write_demo_assets(tmp_path / "other", seed=1)
    a = load_file(demo_dir / "model" / "model.safetensors")
    b = load_file(tmp_path / "other" / "model" / "model.safetensors")
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])


def test_layout_and_manifest(demo_dir):
    manifest = json.loads((demo_dir / "manifest.json").read_text())
    names = [a["name"] for a in manifest["adapters"]]
    assert names == [s.name for s in ADAPTERS] and len(names) == 12
    ranks = [a["r"] for a in manifest["adapters"]]
    assert min(ranks) == 4 and max(ranks) == 64
    for entry in manifest["adapters"]:
        d = demo_dir / entry["path"]
        assert (d / "adapter_config.json").is_file() and (d / "adapter_model.safetensors").is_file()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (demo_dir / "model" / name).is_file()


def test_transformers_tokenizer_round_trips_with_bos(demo_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir / "model")
    assert len(tok) == 512 and tok.bos_token_id == 0 and tok.eos_token_id == 1
    line = CORPUS.splitlines()[3]
    ids = tok(line).input_ids
    assert ids[0] == 0 and len(ids) < len(line) / 2  # BPE merges learned from the corpus
    assert tok.decode(ids, skip_special_tokens=True) == line
    assert tok.decode(tok("naïve émigré 123").input_ids[1:]) == "naïve émigré 123"


@pytest.fixture(scope="module")
def hf_base(demo_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(demo_dir / "model")


@torch.no_grad()
def greedy(model, tok, prompt, n=16):
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_base_greedy_generations_are_not_degenerate(hf_base):
    model, tok = hf_base
    outputs = [greedy(model, tok, p, n=24) for p in PROMPTS]
    assert len({tuple(o) for o in outputs}) == len(PROMPTS)
    for out in outputs:
        assert len(set(out)) >= 8, out


@pytest.fixture(scope="module")
def base_greedy(hf_base):
    """The base model's greedy tokens for PROMPTS, computed once for the 12 adapter cases."""
    model, tok = hf_base
    return [greedy(model, tok, p) for p in PROMPTS]


# One adapter of each kind (plain, rank 64 on every module, rank/alpha patterns, a regex target,
# rsLoRA) by default; the rest of the 12, other ranks and module sets, with `-m slow`.
DEFAULT_RUN = {"qv-r4", "all-r64", "pattern-r8", "regex-r24", "rslora-r48"}


@pytest.mark.parametrize("spec", [s if s.name in DEFAULT_RUN else
                                  pytest.param(s, marks=pytest.mark.slow) for s in ADAPTERS],
                         ids=lambda s: s.name)
def test_peft_loads_adapter_unchanged_and_it_changes_greedy_tokens(spec, demo_dir, hf_base,
                                                                    base_greedy):
    import copy

    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    base, tok = hf_base
    adapter_dir = demo_dir / "adapters" / spec.name
    model = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).eval()
    files = load_file(adapter_dir / "adapter_model.safetensors")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert 2 * len(layers) == len(files)
    for name, layer in layers.items():
        a = files[f"{name}.lora_A.weight"]
        b = files[f"{name}.lora_B.weight"]
        assert torch.equal(layer.lora_A["default"].weight, a)
        assert torch.equal(layer.lora_B["default"].weight, b)
        assert b.abs().min() > 0  # lora_B is non-zero, unlike PEFT's own init
        r, alpha = layer.r["default"], layer.lora_alpha["default"]
        assert a.shape[0] == r
        expected_scale = alpha / math.sqrt(r) if spec.use_rslora else alpha / r
        assert layer.scaling["default"] == pytest.approx(expected_scale)
    changed = [greedy(model, tok, p) != want for p, want in zip(PROMPTS, base_greedy, strict=True)]
    assert all(changed), (spec.name, changed)


def test_patterns_give_per_module_ranks(demo_dir):
    files = load_file(demo_dir / "adapters" / "pattern-r8" / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers"
    assert files[f"{prefix}.0.self_attn.v_proj.lora_A.weight"].shape[0] == 32
    assert files[f"{prefix}.1.mlp.down_proj.lora_A.weight"].shape[0] == 4
    assert files[f"{prefix}.0.mlp.down_proj.lora_A.weight"].shape[0] == 8
    regex = load_file(demo_dir / "adapters" / "regex-r24" / "adapter_model.safetensors")
    assert sorted({k.split(".lora_")[0].removeprefix(prefix + ".") for k in regex}) == [
        "1.mlp.down_proj", "1.self_attn.q_proj", "1.self_attn.v_proj"]


def test_cli_writes_the_assets(tmp_path, capsys):
    # Only this command's parser: the full `slora` CLI also imports generated protobuf code.
    parser = argparse.ArgumentParser(prog="slora")
    demo_assets_command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo-assets", str(tmp_path / "d"), "--seed", "7"])
    assert args.func(args) == 0
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["seed"] == 7 and len(manifest["adapters"]) == 12
    assert "manifest:" in capsys.readouterr().out
