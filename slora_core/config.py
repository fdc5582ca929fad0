"""Frozen configuration objects: the base model's shapes and the engine's limits."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# The base linear layers a LoRA adapter may target, in the order used by every offset table
# (`module index`). Fused projections (qkv, gate_up) carry several of these indices.
LORA_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
MODULE_INDEX: dict[str, int] = {name: i for i, name in enumerate(LORA_MODULES)}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map 'fp16'/'float16'/'bf16'/... (or a torch dtype) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


class ConfigError(ValueError):
    """A model or engine configuration that cannot be served."""


def _sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or (model_type == "qwen2" and not cfg.get("use_sliding_window", False)):
        return None
    return int(window)


@dataclass(frozen=True)
class ModelConfig:
    """The shapes of a Llama-family decoder, read from a Hugging Face `config.json`."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    model_type: str = "llama"
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # Mistral / Qwen2 window; attention here is always full
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ConfigError(f"unsupported model_type {model_type!r} (llama, mistral, qwen2)")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            return cls(
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rope_scaling=cfg.get("rope_scaling"),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                model_type=model_type,
                torch_dtype=str(cfg.get("torch_dtype") or "float32"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
                sliding_window=_sliding_window(cfg, model_type),
                raw=dict(cfg),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"{p} not found: not a Hugging Face model directory") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model serves: max_position_embeddings, scaled as vLLM reads
        rope scaling. "linear" and "dynamic" configs give the pre-scaling length (so times
        `factor`), "yarn" scales `original_max_position_embeddings`; "llama3" and "longrope"
        configs already give the extended length."""
        params = dict(self.rope_scaling or self.raw.get("rope_parameters") or {})
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        length = float(self.max_position_embeddings)
        if rope_type in ("linear", "dynamic", "yarn"):
            if rope_type == "yarn" and "original_max_position_embeddings" in params:
                length = float(params["original_max_position_embeddings"])
            length *= float(params.get("factor", 1.0))
        return int(length)

    @property
    def o_proj_bias(self) -> bool:
        """Llama's `attention_bias` also gives o_proj a bias; Qwen2's q/k/v biases do not."""
        return self.attention_bias and self.model_type == "llama"

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a base linear layer named in LORA_MODULES."""
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        try:
            return shapes[module]
        except KeyError:
            raise ConfigError(f"unknown module {module!r}; expected one of {LORA_MODULES}") from None

    @property
    def max_module_dim(self) -> int:
        return max(max(self.module_shape(m)) for m in LORA_MODULES)


def knob(default: Any, help: str) -> Any:
    """An EngineConfig field with its one description: `slora_core.engine_args` makes the
    command-line flag, environment variable and help text of every field from these."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    """Limits of one engine; each field's `help` (knob) is its documentation, and every flag
    `slora worker`, `slora batch` and the benchmarks take is generated from it. Fields that
    pick a code path are the user's trades (start-up time and memory against step time), never
    experiments: a path nothing ships is not a field (issue 36)."""

    dtype: str = knob("float32", "weights and KV cache dtype: float32, float16 or bfloat16")
    device: str = knob("cpu", "torch device, e.g. cpu or cuda")
    num_pages: int = knob(256, "page arena size in pages (KV blocks, cached prefixes and "
                               "resident adapters share it)")
    block_size: int | None = knob(None, "tokens per KV block (default: the smallest power of "
                                        "two >= 16 whose page fits a LoRA matrix of max_rank)")
    max_rank: int = knob(64, "largest adapter rank served")
    max_num_seqs: int = knob(64, "sequences one step may run")
    max_num_batched_tokens: int = knob(512, "tokens one step may compute (chunked prefill "
                                            "budget)")
    # A cap below the number of concurrent requests makes requests wait for adapter room under
    # many-adapter traffic (H200, 2,000 adapters, 256 sequences: p99 TTFT 58x that of 5
    # adapters at a cap of 64, 1.4x at 256), while the LoRA kernels' time grows with the
    # adapters a step reads but stays below the wait, so by default the batch is the only cap.
    max_adapters_per_batch: int | None = knob(
        None, "distinct adapters one step may read (default: max_num_seqs)")
    max_model_len: int | None = knob(
        None, "longest prompt + output (default: the model's context length, capped at a "
              "sliding window, which this engine serves as full attention)")
    host_cache_bytes: int = knob(1 << 30, "host memory for parsed adapters, in bytes")
    max_queue: int = knob(1024, "waiting requests past which new ones are refused as busy")
    grammar_compile_timeout_s: float = knob(
        10.0, "seconds a structured-output grammar may take to compile (off the step loop) "
              "before its request is refused as INVALID_ARGUMENT")
    # Graphs cost capture time at start-up (every bucket and LoRA module set) and a memory
    # pool, and save the host time of each step; off is also the fallback when a graph
    # disagrees with the eager path.
    cuda_graphs: bool = knob(True, "replay CUDA graphs for decode steps (CUDA only; with "
                                   "tensor parallelism the ranks run eagerly)")
    mixed_graphs: bool = knob(True, "replay CUDA graphs for steps with prefill tokens too, "
                                    "padded to token buckets (with cuda_graphs)")
    # A batch-64 decode step at 7B shapes: 10.75 vs 11.70 ms (profile-async-h200.json); on the
    # CPU nothing runs beside the host, and tensor parallelism does not support it.
    async_steps: bool | None = knob(
        None, "launch each step before reading the previous one's tokens, which feed it on "
              "the device (overlaps host work with the GPU; outputs come one step() later; "
              "default: on for one CUDA device, off otherwise)")
    # On at 1 ms since the worker front pumps its mux streams, writes them in place and hands
    # arriving requests to the core before its next slice (f33e615..36419fc): on an H100 at
    # f65c29b, 256 streams, output lengths 32-96, untraced, it cut the request TTFT p50 the
    # gateway adds from 19.2 ms [19.2, 19.3] to 0.25 ms [0.24, 0.54] over three repeats, at
    # 1.016x of in-process throughput (1.031x off), and in four more runs on that host
    # (traced or not, writer slices of 0.25 and 0.5 ms) to 0.05-0.81 ms (docs/performance.md,
    # "Late admission wins"). Its GPU idles ~150-250 us before each paced step. Before those
    # front changes it had held only when traced (c123b76: 64 streams 7.2 -> 6.0 ms, 256
    # streams 19.4 -> 19.3, three repeats). Direct to the worker (not the gateway's path) it
    # moved both ways at 256 streams (13.5 -> 22.1 ms, 101.7 -> 17.6). 0 turns it off.
    admission_lead_ms: float = knob(
        1.0, "with asynchronous steps, the serving loop takes new requests after a step "
             "returns until the step under way on the GPU is about to end, less the host's "
             "launch time and this many ms, so that they join the next step (0: off)")
    # The batch-64 decode step with 64 adapters gains 0.5-0.8 ms (1.27-1.33x its floor vs
    # 1.39x on the H200, engine-floor-*-h200.json).
    lora_row_kernels: bool = knob(
        True, "decode graphs run many-adapter LoRA one token row a program, a third LoRA "
              "graph per bucket (slora_kernels/lora_rows.py; off: 16-row tiles only)")
    # H100, 7B, batch 64, ranks 8-64 on all 7 modules, interleaved with the same arms in line:
    # 16 distinct adapters 0.805x vs 0.801x base, 64 distinct 0.700x vs 0.696x, ahead in every
    # repeat; the same tokens and logits bit for bit (distinct-adapters-fork-cb90780-h100.json;
    # again 0.805x / 0.701x at b02a099). Batch 256, 64 distinct: 0.731x vs 0.729x
    # (distinct-adapters-fork-b256-ecdfb2a-h100.json).
    lora_fork_shrink: bool = knob(
        True, "decode graphs of many adapters (past the one-adapter tile list) run each "
              "projection's LoRA shrinks on a second CUDA stream beside its base GEMM, the "
              "expands after both")
    # H200, one adapter at batch 64: 0.951x vs 0.933x base (engine-speed-{pdl,nopdl}-dccb3ce).
    lora_pdl: bool | None = knob(
        None, "launch each LoRA expand as a programmatic dependent of its shrink, so it "
              "overlaps it (Hopper+; default: the kernels', on)")
    # H200, Llama-2-7B, one r16 adapter on every request: 0.991x base merged vs 0.953x
    # unmerged in one run (engine-speed-merge-h200.json).
    merge_sole_adapter: bool | None = knob(
        None, "fold a batch's sole adapter into the base weights while it is the only one "
              "(restored bit for bit when it stops being so; default: on for one CUDA device "
              "with 16-bit weights; single-device engines only)")
    # H200, one 7B decode layer with one adapter on all 7 modules: +15.0-17.2 us against
    # +28.8-52.3 us for the kernels (lora-layer-fusion-h200.json); costs modules x max_rank
    # weight rows and an expand matrix per projection (~0.5 GB at 7B, max_rank 64).
    ride_sole_adapter: bool = knob(
        False, "run a decode step whose every token reads one (unmerged) adapter as one wider "
               "GEMM per projection (the adapter's A rows appended to the weight) and one "
               "cuBLAS expand, instead of the LoRA kernels (slora_core/lora_ride.py; "
               "single-device engines only)")
    # Off is the user's trade of a little host time (a sha256 per page) for nothing cached;
    # tests and benchmarks compare the two.
    prefix_caching: bool = knob(
        True, "keep full KV pages cached by content (the prefix's tokens and the base model or "
              "adapter content that computed them) and reuse the longest cached prefix of a new "
              "request instead of computing it; cold cached pages are evicted like idle "
              "adapters (slora_core/page_pool.py)")
    tensor_parallel_size: int = knob(
        1, "ranks (one GPU each) one engine is sharded over; rank 0 schedules "
           "(slora_core/tp, started by slora_core.launch.start_engine)")

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if not self.admission_lead_ms >= 0.0:  # NaN too
            raise ConfigError(f"admission_lead_ms must be at least 0, got "
                              f"{self.admission_lead_ms}")
        for name in ("num_pages", "max_rank", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("block_size", "max_model_len", "max_adapters_per_batch"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if not self.grammar_compile_timeout_s > 0:
            raise ConfigError(f"grammar_compile_timeout_s must be positive, got "
                              f"{self.grammar_compile_timeout_s}")
        if self.merge_sole_adapter and self.tensor_parallel_size > 1:
            raise ConfigError("merge_sole_adapter needs tensor_parallel_size 1 (each rank "
                              "holds a shard of the weights a merge would change)")
        if self.ride_sole_adapter and self.tensor_parallel_size > 1:
            raise ConfigError("ride_sole_adapter needs tensor_parallel_size 1 (its outputs are "
                              "strided views, which the ranks' all-reduce does not take)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def steps_async(self) -> bool:
        """Whether steps run asynchronously: `async_steps`, or by default on one CUDA device."""
        if self.async_steps is not None:
            return self.async_steps
        return self.device.startswith("cuda") and self.tensor_parallel_size == 1

    @property
    def merges_sole_adapter(self) -> bool:
        """Whether sole adapters are merged: `merge_sole_adapter`, or by default on one CUDA
        device with 16-bit weights."""
        if self.merge_sole_adapter is not None:
            return self.merge_sole_adapter
        return (self.device.startswith("cuda") and self.tensor_parallel_size == 1
                and self.torch_dtype in (torch.float16, torch.bfloat16))

    @property
    def adapter_cap(self) -> int:
        """The max_adapters_per_batch in force."""
        return self.max_adapters_per_batch or self.max_num_seqs

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        """`max_model_len` for `model`: the model's own limit when unset; a value above that
        limit is refused, and so is one past a sliding window (this engine attends fully, which
        equals the window only within it)."""
        limit = model.max_model_len
        window = model.sliding_window
        if self.max_model_len is None:
            return limit if window is None else min(limit, window)
        if self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's limit of {limit} tokens "
                f"(config.json max_position_embeddings={model.max_position_embeddings}"
                f"{', with rope scaling' if limit != model.max_position_embeddings else ''})"
            )
        if window is not None and self.max_model_len > window:
            raise ConfigError(
                f"the model uses sliding-window attention (window {window}), which this engine "
                f"does not implement: set max_model_len <= {window} (now {self.max_model_len}) "
                f"so full attention gives the same result"
            )
        return self.max_model_len

    def check_model(self, model: ModelConfig) -> None:
        """Refuse a model this engine would serve wrongly (see resolve_max_model_len)."""
        self.resolve_max_model_len(model)

    def resolve_block_size(self, model: ModelConfig) -> int:
        """The KV block size whose page fits the largest A or B matrix at `max_rank`."""
        per_token = model.num_hidden_layers * 2 * model.num_key_value_heads * model.head_dim
        need = self.max_rank * model.max_module_dim
        if self.block_size is not None:
            if self.block_size * per_token < need:
                raise ConfigError(
                    f"block_size={self.block_size} gives pages of {self.block_size * per_token} "
                    f"elements, but a rank-{self.max_rank} matrix needs {need}"
                )
            return self.block_size
        bs = 16
        while bs * per_token < need:
            bs *= 2
        return bs
