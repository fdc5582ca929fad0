"""Seeded demo assets: a tiny Llama (HF directory with a trained byte-level BPE tokenizer) and a
dozen PEFT LoRA adapters of mixed ranks and target modules, for tests and the local stack.

Everything is generated from `seed` on the CPU in float32, so the same seed writes the same
bytes. Nothing here needs transformers or peft; the files follow their formats so that
`AutoTokenizer`, `AutoModelForCausalLM` and `PeftModel.from_pretrained` load them unchanged.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from slora_core.config import ModelConfig
from slora_core.weights import checkpoint_shapes

BOS, EOS = "<s>", "</s>"
VOCAB_SIZE = 512
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

# A tiny Llama-3-style model. `original_max_position_embeddings` is small so that the llama3
# scaling touches all three frequency bands of a 16-dim head (kept, interpolated, slowed).
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}

# A ChatML-style chat template (as Qwen2's, without its default system prompt). The tokenizer
# has no <|im_start|>/<|im_end|> tokens (adding them would retrain the BPE and change every
# demo output), so the markers are plain text: a few byte-level tokens each. BOS comes from
# the template, as in real models, since chat prompts are tokenized without special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Built-in training text for the tokenizer (written for this project).
CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the porch.
A small boat drifted across the quiet lake, and the children waved from the shore.
Every morning the baker opens the shop at six and sells warm bread to the neighbours.
The library on the hill keeps old maps, letters and books about the history of the town.
When the rain stopped, the streets were full of people walking to the market again.
She wrote a long letter to her brother, telling him about the new job in the city.
The engineers measured the bridge twice before they allowed the first trucks to cross it.
In the evening the sky turned orange, then purple, and finally the stars came out.
He planted tomatoes, beans and sunflowers in the garden behind the old stone house.
The train to the coast leaves at noon and arrives a little after three in the afternoon.
Our teacher asked us to read two chapters and answer the questions at the end of each.
The museum opened a new room with paintings of ships, harbours and stormy seas.
A friendly cat sleeps on the windowsill and watches the birds in the apple tree.
The doctor said that a short walk every day is good for the heart and the mind.
They cooked soup with carrots, onions and potatoes, and shared it with the whole street.
Music from the festival could be heard across the valley until late at night.
The company hired new people to answer questions from customers about their orders.
If you follow the river north, you will reach a village with a wooden church.
The students built a simple robot that could follow a line drawn on the floor.
Winter came early that year, and the first snow covered the fields in white.
A good story has a beginning, a middle and an end, and characters we care about.
The scientist explained how plants use sunlight, water and air to make their food.
We counted the numbers one, two, three, four, five, six, seven, eight, nine and ten.
The market sells fresh fish, cheese, honey, fruit and flowers every Saturday morning.
Please remember to close the door, turn off the lights and water the plants.
"""


@dataclass(frozen=True)
class AdapterSpec:
    """One demo adapter: PEFT LoRA hyper-parameters (target_modules a list or a regex)."""

    name: str
    r: int
    lora_alpha: int
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, int] = field(default_factory=dict)


ADAPTERS: tuple[AdapterSpec, ...] = (
    AdapterSpec("qv-r4", 4, 8, ("q_proj", "v_proj")),
    AdapterSpec("attn-r8", 8, 16, ATTENTION),
    AdapterSpec("attn-r12", 12, 24, ATTENTION),
    AdapterSpec("all-r16", 16, 16, ALL_LINEAR),
    AdapterSpec("mlp-r32", 32, 64, ("gate_proj", "up_proj", "down_proj")),
    AdapterSpec("all-r64", 64, 128, ALL_LINEAR),
    AdapterSpec("ko-r6", 6, 6, ("k_proj", "o_proj")),
    AdapterSpec("gateup-r40", 40, 20, ("gate_proj", "up_proj")),
    AdapterSpec("qdown-r20", 20, 40, ("q_proj", "down_proj")),
    # PEFT full-matches a string target against module names such as model.layers.1.mlp.down_proj.
    AdapterSpec("regex-r24", 24, 48, r"model\.layers\.1\.(self_attn\.[qv]_proj|mlp\.down_proj)"),
    AdapterSpec("rslora-r48", 48, 16, ALL_LINEAR, use_rslora=True),
    AdapterSpec("pattern-r8", 8, 16, ALL_LINEAR,
                rank_pattern={"v_proj": 32, "model.layers.1.mlp.down_proj": 4},
                alpha_pattern={"v_proj": 8}),
)


@dataclass(frozen=True)
class DemoAssets:
    """Where `write_demo_assets` put things."""

    root: Path
    model_dir: Path
    adapter_dirs: dict[str, Path]
    manifest: Path


def write_demo_assets(root: str | Path, seed: int = 0, *,
                      model_overrides: dict[str, Any] | None = None,
                      adapters: tuple[str, ...] | None = None,
                      dtype: torch.dtype = torch.float32, device: str = "cpu") -> DemoAssets:
    """Write root/model/, root/adapters/<name>/ for every spec in ADAPTERS (or those named in
    `adapters`), and root/manifest.json. The same seed writes byte-identical files.
    `model_overrides` changes the model's shape (benchmarks at real sizes, e.g. Llama-2-7B's
    hidden_size/num_hidden_layers/...), `dtype` the stored weights' dtype and `device` where the
    random base weights are drawn (a GPU draws a 7B model in seconds; files then depend on the
    device's generator as well as the seed)."""
    root = Path(root)
    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    _write_json(model_dir / "tokenizer_config.json", _tokenizer_config())
    config_dict = {**MODEL_CONFIG, **(model_overrides or {}),
                   "vocab_size": tokenizer.get_vocab_size()}
    _write_json(model_dir / "config.json", config_dict)
    _write_json(model_dir / "generation_config.json", {
        "bos_token_id": config_dict["bos_token_id"], "eos_token_id": config_dict["eos_token_id"],
        "do_sample": False})
    config = ModelConfig.from_dict(config_dict)
    save_file(base_weights(config, seed, dtype, device), str(model_dir / "model.safetensors"),
              metadata={"format": "pt"})
    adapter_dirs = {}
    for i, spec in enumerate(ADAPTERS):
        if adapters is not None and spec.name not in adapters:
            continue
        adapter_dirs[spec.name] = write_adapter(root / "adapters" / spec.name, spec, config,
                                                seed=seed * 1000 + i + 1)
    manifest = root / "manifest.json"
    _write_json(manifest, _manifest(seed, adapter_dirs))
    return DemoAssets(root=root, model_dir=model_dir, adapter_dirs=adapter_dirs, manifest=manifest)


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE of VOCAB_SIZE tokens trained on CORPUS; `<s>` = 0 (prepended to every
    encoding), `</s>` = 1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def base_weights(config: ModelConfig, seed: int, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> dict[str, torch.Tensor]:
    """Seeded HF-named float32 weights scaled so that the residual stream stays O(1) and the
    logits spread by a few units: a random tiny model whose greedy output depends on context
    (not one token forever)."""
    gen = torch.Generator(device).manual_seed(seed)
    out = {}
    for name, shape in checkpoint_shapes(config).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen, device=device)
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=gen, device=device) * (3.0 / math.sqrt(shape[1]))
        else:
            t = torch.randn(shape, generator=gen, device=device) * (1.0 / math.sqrt(shape[1]))
        out[name] = t.to(dtype).contiguous().cpu()
    return out


def adapter_modules(spec: AdapterSpec, config: ModelConfig) -> list[tuple[int, str]]:
    """(layer, module) pairs the spec targets, resolved the way PEFT resolves them (a list
    matches the last name component, a string full-matches the module path)."""
    pairs = []
    for layer in range(config.num_hidden_layers):
        for module in ALL_LINEAR:
            block = "self_attn" if module in ATTENTION else "mlp"
            path = f"model.layers.{layer}.{block}.{module}"
            if isinstance(spec.target_modules, str):
                hit = re.fullmatch(spec.target_modules, path) is not None
            else:
                hit = module in spec.target_modules
            if hit:
                pairs.append((layer, module))
    return pairs


def _pattern_value(pattern: dict[str, int], path: str, default: int) -> int:
    # PEFT's get_pattern_key: a key matches a module path that ends with it (on a dot boundary).
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def write_adapter(out_dir: Path, spec: AdapterSpec, config: ModelConfig, seed: int) -> Path:
    """Write adapter_config.json + adapter_model.safetensors with seeded non-zero A and B.

    B is scaled per module so that scale * B @ A moves the module's output by about half
    the base output's size whatever the rank, alpha or rsLoRA setting: every adapter then
    visibly changes the tiny model's greedy tokens."""
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, module in adapter_modules(spec, config):
        block = "self_attn" if module in ATTENTION else "mlp"
        path = f"model.layers.{layer}.{block}.{module}"
        r = _pattern_value(spec.rank_pattern, path, spec.r)
        alpha = _pattern_value(spec.alpha_pattern, path, spec.lora_alpha)
        scale = alpha / math.sqrt(r) if spec.use_rslora else alpha / r
        fan_in, fan_out = config.module_shape(module)
        a = torch.randn(r, fan_in, generator=gen) / math.sqrt(fan_in)
        b = torch.randn(fan_out, r, generator=gen) * (0.5 / (scale * math.sqrt(r)))
        prefix = f"base_model.model.{path}"
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "adapter_config.json", _adapter_config(spec))
    return out_dir


def _adapter_config(spec: AdapterSpec) -> dict[str, Any]:
    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "slora-demo-tiny-llama",
        "r": spec.r,
        "lora_alpha": spec.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": spec.use_rslora,
        "use_dora": False,
        "rank_pattern": dict(spec.rank_pattern),
        "alpha_pattern": dict(spec.alpha_pattern),
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _manifest(seed: int, adapter_dirs: dict[str, Path]) -> dict[str, Any]:
    specs = {s.name: s for s in ADAPTERS}
    return {
        "seed": seed,
        "model": "model",
        "adapters": [
            {
                "name": name,
                "path": f"adapters/{name}",
                "r": specs[name].r,
                "lora_alpha": specs[name].lora_alpha,
                "target_modules": _adapter_config(specs[name])["target_modules"],
                "use_rslora": specs[name].use_rslora,
                "has_patterns": bool(specs[name].rank_pattern or specs[name].alpha_pattern),
            }
            for name in adapter_dirs
        ],
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
