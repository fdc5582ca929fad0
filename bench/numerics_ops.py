"""Op-by-op comparison of one prefill: every module output of our model (eager, Triton ops on
CUDA) and of HF + peft in the same dtype, each against HF + peft in float32 on the same input
(and HF + peft with its float32 adapter weights rounded to the dtype, as our arena stores
them), plus the small fused ops alone on inputs with massive channels against float64."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from bench.numerics_common import hf_adapter, make_engine, run_engine
from slora_core import ops

# Per layer, in forward order.
OPS = ("input_norm", "qkv_proj+lora", "attention", "o_proj+lora", "post_attn_norm",
       "gate_up_proj+lora", "silu_mul", "down_proj+lora", "residual_stream")


def _hook(store: dict[str, torch.Tensor], key: str, pick: Callable[[Any], torch.Tensor],
          pre: bool = False) -> Callable[..., None]:
    def fn(module: nn.Module, inputs: Any, output: Any = None) -> None:
        store.setdefault(key, pick(inputs if pre else output).detach().float().clone())
    return fn


def _ours(model_dir: Path, adapters: dict[str, Path], dtype: str, device: str,
          prompt: list[int], adapter: str | None) -> dict[str, torch.Tensor]:
    engine = make_engine(model_dir, dtype, device, adapters, cuda_graphs=False,
                         max_num_batched_tokens=max(1024, len(prompt)))
    lm = engine.runner.model
    got: dict[str, torch.Tensor] = {}
    handles = []
    layer: Any
    for i, layer in enumerate(lm.model.layers):
        for key, mod, pick, pre in (
                ("input_norm", layer.input_layernorm, lambda o: o[0], False),
                ("qkv_proj+lora", layer.self_attn.qkv_proj, lambda o: o, False),
                ("attention", layer.self_attn.o_proj, lambda i: i[0], True),
                ("o_proj+lora", layer.self_attn.o_proj, lambda o: o, False),
                ("post_attn_norm", layer.post_attention_layernorm, lambda o: o[0], False),
                ("gate_up_proj+lora", layer.mlp.gate_up_proj, lambda o: o, False),
                ("silu_mul", layer.mlp.down_proj, lambda i: i[0], True),
                ("down_proj+lora", layer.mlp.down_proj, lambda o: o, False),
                ("residual_stream", layer, lambda o: o[0].float() + o[1].float(), False)):
            hook = _hook(got, f"{i}.{key}", pick, pre)
            handles.append(mod.register_forward_pre_hook(hook) if pre
                           else mod.register_forward_hook(hook))
    run = run_engine(engine, [("r", prompt, adapter)], new_tokens=1)
    for h in handles:
        h.remove()
    got["logits"] = run.logits["r"][0][None]
    return got


def _hf(model: Any, prompt: list[int], adapter: str | None) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    handles = []
    with hf_adapter(model, adapter) as m:
        base = m.get_base_model() if hasattr(m, "get_base_model") else m
        for i, layer in enumerate(base.model.layers):
            att, mlp = layer.self_attn, layer.mlp
            for key, mod, pick, pre in (
                    ("input_norm", layer.input_layernorm, lambda o: o, False),
                    ("q", att.q_proj, lambda o: o, False), ("k", att.k_proj, lambda o: o, False),
                    ("v", att.v_proj, lambda o: o, False),
                    ("attention", att.o_proj, lambda i: i[0], True),
                    ("o_proj+lora", att.o_proj, lambda o: o, False),
                    ("post_attn_norm", layer.post_attention_layernorm, lambda o: o, False),
                    ("gate", mlp.gate_proj, lambda o: o, False),
                    ("up", mlp.up_proj, lambda o: o, False),
                    ("silu_mul", mlp.down_proj, lambda i: i[0], True),
                    ("down_proj+lora", mlp.down_proj, lambda o: o, False),
                    ("residual_stream", layer, lambda o: o[0] if isinstance(o, tuple) else o,
                     False)):
                hook = _hook(got, f"{i}.{key}", pick, pre)
                handles.append(mod.register_forward_pre_hook(hook) if pre
                               else mod.register_forward_hook(hook))
        with torch.no_grad():
            logits = m(torch.tensor([prompt], device=m.device), logits_to_keep=1).logits
    for h in handles:
        h.remove()
    out = {k: v.reshape(-1, v.shape[-1]) for k, v in got.items()}
    for i in range(len(base.model.layers)):
        out[f"{i}.qkv_proj+lora"] = torch.cat([out.pop(f"{i}.{n}") for n in "qkv"], dim=-1)
        out[f"{i}.gate_up_proj+lora"] = torch.cat([out.pop(f"{i}.gate"), out.pop(f"{i}.up")],
                                                  dim=-1)
    out["logits"] = logits[0, -1:].float()
    return out


def _err(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Relative Frobenius error; None when `a` holds a non-finite value."""
    if not bool(torch.isfinite(a).all()):
        return None
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _first_nonfinite(got: dict[str, torch.Tensor], layers: int) -> str | None:
    for i in range(layers):
        for op in OPS:
            if not bool(torch.isfinite(got[f"{i}.{op}"]).all()):
                return f"layer {i} {op}"
    return None if bool(torch.isfinite(got["logits"]).all()) else "logits"


def compare_ops(model_dir: Path, adapters: dict[str, Path], dtype: str, device: str,
                refs: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """Per adapter (and the base model): each op's worst relative error over layers against
    HF float32, ours and HF's in `dtype`, and where each first goes non-finite."""
    out: dict[str, Any] = {"prompt_tokens": len(prompt), "fused_ops": fused_ops(dtype, device)}
    for adapter in [None, *adapters]:
        ref = _hf(refs["float32"], prompt, adapter)
        hf = _hf(refs[dtype], prompt, adapter)
        with adapters_rounded(refs[dtype], getattr(torch, dtype)):
            hf_rounded = _hf(refs[dtype], prompt, adapter)
        ours = _ours(model_dir, adapters, dtype, device, prompt, adapter)
        layers = sum(k.endswith(".residual_stream") for k in ref)
        first = first_op_worse(ours, hf, hf_rounded, ref, layers)
        table = {}
        for op in (*OPS, "logits"):
            keys = [f"{i}.{op}" for i in range(layers)] if op != "logits" else ["logits"]
            e_ours = [_err(ours[k], ref[k]) for k in keys]
            e_hf = [_err(hf[k], ref[k]) for k in keys]
            e_rounded = [_err(hf_rounded[k], ref[k]) for k in keys]
            table[op] = {"ours_vs_fp32": _worst(e_ours), "hf_vs_fp32": _worst(e_hf),
                         "hf_adapter_weights_in_dtype_vs_fp32": _worst(e_rounded),
                         "peak_abs_fp32": max(float(ref[k].abs().max()) for k in keys)}
        out[adapter or "base"] = {"ops": table, "first_op_worse_than_hf": first,
                                  "first_nonfinite_ours": _first_nonfinite(ours, layers),
                                  "first_nonfinite_hf": _first_nonfinite(hf, layers)}
    return out


def first_op_worse(ours: dict[str, torch.Tensor], hf: dict[str, torch.Tensor],
                   hf_rounded: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                   layers: int) -> dict[str, Any] | None:
    """The first op in forward order (layer by layer; the table above keeps each op's worst
    layer, which hides where a gap starts) whose error against float32 exceeds HF
    same-dtype's by more than 10%, with HF's error when its float32 adapter weights are
    rounded to the dtype as we store them: `explained_by_adapter_storage` when ours is within
    10% of that."""
    for key in [f"{i}.{op}" for i in range(layers) for op in OPS] + ["logits"]:
        e_ours, e_hf, e_rounded = (_err(t[key], ref[key]) for t in (ours, hf, hf_rounded))
        if e_ours is None or e_hf is None or e_ours > 1.1 * e_hf + 1e-6:
            return {"op": key, "ours_vs_fp32": e_ours, "hf_vs_fp32": e_hf,
                    "hf_adapter_weights_in_dtype_vs_fp32": e_rounded,
                    "explained_by_adapter_storage": e_ours is not None
                    and e_rounded is not None and e_ours <= 1.1 * e_rounded + 1e-6}
    return None


@contextmanager
def adapters_rounded(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """peft keeps adapter weights in float32 under a 16-bit base; we store them in the model
    dtype (arena pages). Inside this block peft's are rounded to `dtype` too, which tells the
    storage's share of any gap between our error and HF's."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in saved:
            params[n].copy_(params[n].to(dtype).to(params[n].dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in saved.items():
                params[n].copy_(p)


def _worst(errs: list[float | None]) -> float | str:
    return "non-finite" if any(e is None for e in errs) else max(e for e in errs if e is not None)


def fused_ops(dtype: str, device: str, tokens: int = 64, hidden: int = 1024) -> dict[str, Any]:
    """RMSNorm with residual add, rotary and SiLU*mul alone, ours and HF's torch code in
    `dtype`, on inputs with three channels at +-2e4, against the same math in float64."""
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen)
    x[:, [5, 77, 100]] = 2e4 * torch.sign(torch.randn(tokens, 3, generator=gen))
    res = torch.randn(tokens, hidden, generator=gen)
    w = 1 + 0.1 * torch.randn(hidden, generator=gen)
    x, res, w = (t.to(device) for t in (x, res, w))
    report: dict[str, Any] = {}
    # Residual add + RMSNorm. HF: hidden = residual + x (dtype), variance in float32.
    s64 = x.to(dt).double() + res.to(dt).double()
    ref = w.to(dt).double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5)
    r = res.to(dt).clone()
    ours, _ = ops.rms_norm(x.to(dt), w.to(dt), 1e-5, r)
    h = res.to(dt) + x.to(dt)
    hf = w.to(dt) * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5)
                     ).to(dt)
    report["rmsnorm_residual"] = {"ours": _err(ours, ref), "hf": _err(hf, ref)}
    # Rotary on q [T, H, D] with positions up to 4k.
    d, heads = 128, hidden // 128
    q = x.view(tokens, heads, d).to(dt)
    pos = torch.arange(tokens, device=device) * 61
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).double() / d))
    ang = torch.cat([pos[:, None] * inv[None]] * 2, dim=-1)
    q64 = q.double()
    rot = torch.cat((-q64[..., d // 2:], q64[..., : d // 2]), dim=-1)
    ref = q64 * ang.cos()[:, None] + rot * ang.sin()[:, None]
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    mine, k = q.clone(), q[:, :1].clone()
    ops.rotary(mine, k, cos, sin)
    theirs, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None],
                                     sin[None])
    report["rotary"] = {"ours": _err(mine, ref), "hf": _err(theirs[0].transpose(0, 1), ref)}
    # SiLU * mul on [T, 2I] with large gate and up values.
    gu = (x.repeat(1, 2) * 0.01).to(dt)
    g64, u64 = gu.double().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(g64) * u64
    g, u = gu.chunk(2, dim=-1)
    report["silu_mul"] = {"ours": _err(ops.silu_mul(gu), ref),
                          "hf": _err(torch.nn.functional.silu(g) * u, ref)}
    report["inputs_peak_abs"] = 2e4
    return {k: v for k, v in report.items() if not isinstance(v, float) or math.isfinite(v)}
