"""Shared pieces of the GPU numerics checks: random-weight Llama checkpoints written by
`transformers`, LoRA adapters written by `peft`, Hugging Face reference runs, engine runs that
record every sampled row's logits, and the comparisons between them.

References are nobody's code here: `transformers` + `peft` on the same device, in the model
dtype and in float32.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from slora_core.config import EngineConfig, ModelConfig
from slora_core.engine import LLMEngine
from slora_core.launch import AnyEngine
from slora_core.outputs import RequestOutput
from slora_core.sampling_params import SamplingParams
from slora_core.weights import load_model

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    r: int
    alpha: int
    targets: tuple[str, ...]
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r


def hardware() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def build_base(shape: Shape, seed: int, device: str) -> LlamaForCausalLM:
    """A float32 HF Llama with HF's own random init (normal, std 0.02), built on `device`."""
    cfg = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.inter,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                      max_position_embeddings=4096, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
                      tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.eval()


@torch.no_grad()
def write_adapters(base: LlamaForCausalLM, specs: list[AdapterSpec], root: Path, seed: int,
                   gain: float = 1.0) -> dict[str, Path]:
    """Save each adapter with `peft` (PEFT directory format). A and B are random (peft starts B
    at zero, which would make every adapter a no-op); B is sized so that the LoRA delta is about
    `gain` times the base layer's output whatever the rank, alpha or rsLoRA setting."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dirs = {}
    for spec in specs:
        cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                         use_rslora=spec.rslora, lora_dropout=0.0)
        peft_model = get_peft_model(base, cfg)  # type: ignore[arg-type]
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif "lora_B" in name:
                std = 0.02 * math.sqrt(p.shape[0]) * gain / (spec.scale * math.sqrt(spec.r))
                p.copy_(torch.randn(p.shape, generator=gen) * std / math.sqrt(p.shape[0]))
        dirs[spec.name] = root / spec.name
        peft_model.save_pretrained(str(dirs[spec.name]))
        base = peft_model.unload()  # type: ignore[assignment]
    return dirs


def hf_with_adapters(model_dir: Path, adapters: dict[str, Path], dtype: torch.dtype,
                     device: str) -> Any:
    """The base model in `dtype` with every adapter loaded by peft (switch with set_adapter)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    base = base.to(device)  # type: ignore[arg-type]
    if not adapters:
        return base.eval()
    items = list(adapters.items())
    model = PeftModel.from_pretrained(base, str(items[0][1]), adapter_name=items[0][0])
    for name, path in items[1:]:
        model.load_adapter(str(path), adapter_name=name)
    return model.eval()


def save_rounded(base: LlamaForCausalLM, dtype: str, model_dir: Path) -> None:
    """Save `base` as a `dtype` checkpoint and leave it float32 holding exactly the saved
    weights (the float32 reference of that checkpoint). Buffers (rotary frequencies) stay the
    float32 values that `from_pretrained` computes: a round trip through `dtype` would shift
    every rotary angle."""
    buffers = {n: b.clone() for n, b in base.named_buffers()}
    base.to(getattr(torch, dtype)).save_pretrained(model_dir)
    base.float()
    _set_buffers(base, buffers)


def _set_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.clone()


def hf_refs_in_memory(base: LlamaForCausalLM, adapters: dict[str, Path],
                      dtypes: list[str]) -> dict[str, Any]:
    """What `hf_with_adapters` builds for each of `dtypes`, from `base` (float32 on its device,
    holding the checkpoint's weights: `save_rounded`) instead of re-reading the checkpoint: at
    8B shapes `from_pretrained` converts gigabytes on the host per dtype. The float32 model
    wraps `base` itself (peft injects its layers in place)."""
    buffers = {n: b.clone() for n, b in base.named_buffers()}
    refs = {}
    for dtype in sorted(set(dtypes), key=lambda d: d == "float32"):  # float32 (in place) last
        model: Any = base
        if dtype != "float32":
            model = copy.deepcopy(base).to(getattr(torch, dtype))
            _set_buffers(model, buffers)  # float32, as from_pretrained leaves them
        if adapters:
            items = list(adapters.items())
            model = PeftModel.from_pretrained(model, str(items[0][1]), adapter_name=items[0][0])
            for name, path in items[1:]:
                model.load_adapter(str(path), adapter_name=name)
        refs[dtype] = model.eval()
    return refs


@contextmanager
def hf_adapter(model: Any, adapter: str | None) -> Iterator[Any]:
    """`model` with `adapter` active (None: the base model, adapters disabled)."""
    if adapter is None:
        if isinstance(model, PeftModel):
            with model.disable_adapter():
                yield model
        else:
            yield model
        return
    model.set_adapter(adapter)
    yield model


@torch.no_grad()
def hf_logits(model: Any, adapter: str | None, ids: list[int], n_last: int) -> torch.Tensor:
    """float32 logits predicting positions len(ids)-n_last+1 .. len(ids) (teacher forced)."""
    with hf_adapter(model, adapter) as m:
        x = torch.tensor([ids], device=m.device)
        out = m(x, logits_to_keep=n_last).logits[0].float()
    return out[-n_last:]


@dataclass
class EngineRun:
    tokens: dict[str, list[int]]
    logits: dict[str, list[torch.Tensor]]  # one float32 row per sampled token, on the device
    finish: dict[str, RequestOutput]
    stats: dict[str, int]
    seconds: float


def make_engine(model_dir: Path, dtype: str, device: str, adapters: dict[str, Path],
                **config: Any) -> LLMEngine:
    cfg = EngineConfig(dtype=dtype, device=device, **config)
    model = load_model(model_dir, cfg.torch_dtype, device)
    engine = LLMEngine(model, ModelConfig.from_hf_dir(model_dir), None, cfg)
    for name, path in adapters.items():
        engine.register_adapter(name, path)
    return engine


def run_engine(engine: AnyEngine, requests: list[tuple[str, list[int], str | None]],
               new_tokens: int, keep_logits: bool = True) -> EngineRun:
    """Greedy, EOS ignored; records each request's sampled rows of logits (cloned: graph
    replays return a static buffer)."""
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid, _, _ in requests}
    run = engine.runner.run
    wrapped = "run" in vars(engine.runner)  # a caller's wrapper, put back at the end

    def spy(scheduled: Any, patch: Any = None) -> torch.Tensor:
        out = run(scheduled, patch)
        if keep_logits:
            rows = [s.seq.request_id for s in scheduled if s.samples]
            for rid, row in zip(rows, out.clone(), strict=True):
                logits[rid].append(row)
        return out

    engine.runner.run = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    for rid, prompt, adapter in requests:
        engine.add_request(rid, prompt, params, adapter=adapter)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    finish: dict[str, RequestOutput] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finish[out.request_id] = out
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if wrapped:
        engine.runner.run = run  # type: ignore[method-assign]
    else:
        # The bound method stored on its own runner would make the engine a reference cycle,
        # freed only by the cyclic collector at some later allocation (a CUDA-graph capture
        # then had to pause collection: slora_core.cuda_graphs._gc_paused).
        del engine.runner.run
    # Asynchronous steps compute one row past a request's end; it was never sampled.
    for rid in logits:
        del logits[rid][len(tokens[rid]) + (finish[rid].finish_reason == "error"):]
    s = engine.stats
    stats = {"steps": s.steps, "preemptions": s.preemptions, "adapter_loads": s.adapter_loads,
             "adapter_evictions": s.adapter_evictions, "adapter_host_hits": s.adapter_host_hits}
    if engine.runner.merge is not None:  # EngineConfig.merge_sole_adapter
        merge = engine.runner.merge
        stats.update(merges=merge.merges, merged_steps=merge.merged_steps,
                     merge_refusals=merge.refusals, merge_peak_exceptions=merge.peak_exceptions,
                     merge_peak_restore_bytes=merge.peak_nbytes)
    if engine.runner.ride is not None:  # EngineConfig.ride_sole_adapter
        stats.update(ride_steps=engine.runner.ride.ride_steps, ride_loads=engine.runner.ride.loads)
    return EngineRun(tokens, logits, finish, stats, seconds)


def disagreements(tokens: list[int], ref: torch.Tensor, ref32: torch.Tensor
                  ) -> list[dict[str, Any]]:
    """The positions where `tokens` differ from HF float32's greedy choice (`ref32`, teacher
    forced on `tokens`), each with HF float32's margin between its choice and ours and the
    dtype's noise there: HF same-dtype's (`ref`) largest |logit error| against float32 at that
    position. Two computations that each move every logit by at most e can swap tokens closer
    than 2e, so a disagreement with margin <= 2e is a near-tie (`within_noise`): rounding to
    the dtype decides it, not the engine."""
    best = ref32.argmax(-1)
    toks = torch.tensor(tokens, device=best.device)
    out = []
    for i in (toks != best).nonzero().flatten().tolist():
        margin = float(ref32[i, best[i]] - ref32[i, toks[i]])
        noise = float((ref[i] - ref32[i]).abs().max())
        out.append({"position": i, "token": int(toks[i]), "hf_fp32_token": int(best[i]),
                    "hf_fp32_margin": margin, "hf_same_dtype_max_abs_logit_err": noise,
                    "within_noise": margin <= 2 * noise})
    return out


@dataclass
class Agreement:
    """Greedy agreement with HF float32 over a run's requests, teacher forced on the run's own
    tokens, next to HF same-dtype's on the same positions; `add` one request at a time."""

    agree: int = 0
    agree_ref: int = 0
    total: int = 0
    missed: list[dict[str, Any]] = field(default_factory=list)

    def add(self, rid: str, tokens: list[int], ref: torch.Tensor, ref32: torch.Tensor) -> None:
        best = ref32.argmax(-1)
        self.agree += int((torch.tensor(tokens, device=best.device) == best).sum())
        self.agree_ref += int((ref.argmax(-1) == best).sum())
        self.missed += [{"request": rid, **d} for d in disagreements(tokens, ref, ref32)]
        self.total += len(tokens)

    def summary(self) -> dict[str, Any]:
        n = max(self.total, 1)
        return {"greedy_agreement_with_hf_fp32": self.agree / n,
                "hf_same_dtype_agreement_with_hf_fp32": self.agree_ref / n,
                "positions": self.total,
                "agreement": agreement_verdict(
                    self.total - self.agree, self.total - self.agree_ref,
                    sum(not d["within_noise"] for d in self.missed)),
                "disagreements": self.missed}


def agreement_verdict(ours: int, hf: int, beyond_noise: int) -> dict[str, Any]:
    """Whether our greedy tokens are as faithful to HF float32 as HF's own dtype, from the
    disagreement counts over the same positions (`ours`, `hf`) and how many of ours are
    wider than the dtype's noise. A flat `ours <= hf` over a few hundred positions turns on
    one near-tie (gpu_numerics fp16 on the H200: 3 vs 2 of 288); so: faithful when ours <=
    hf, or when every one of ours is a near-tie (`disagreements`) and the count gap is inside
    two standard deviations of a difference of two Poisson counts, 2 * sqrt(ours + hf)."""
    gap_ok = ours - hf <= 2 * math.sqrt(ours + hf)
    return {"disagreements": ours, "hf_same_dtype_disagreements": hf,
            "disagreements_beyond_noise": beyond_noise, "agreement_at_least_hf": ours <= hf,
            "count_gap_within_2_sigma": gap_ok,
            "faithful": ours <= hf or (beyond_noise == 0 and gap_ok)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the last dim, max over rows (inf when a row of a is not finite)."""
    if not bool(torch.isfinite(a).all()):
        return math.inf
    num = (a.double() - b.double()).norm(dim=-1)
    return float((num / b.double().norm(dim=-1)).max())


def nonfinite_rows(rows: list[torch.Tensor]) -> int:
    return sum(int(not bool(torch.isfinite(r).all())) for r in rows)
