"""Adapter cold-load latency at Llama-2-7B shapes (issue 15): milliseconds to make one adapter
resident in arena pages from the pinned host tier and from local disk, beside a plain pinned
host->device copy of the same bytes on the same GPU.

The engine's own pieces do the work (AdapterStore.get, PagePool.acquire_adapter,
AdapterCopier.write), as a step does for a newly scheduled adapter; each time runs until the
copy has landed (device synchronized). Disk loads first drop the adapter's files from the OS
page cache (fsync + POSIX_FADV_DONTNEED), so they read the disk; `disk_cached` keeps them.

    python -m bench.cold_load --out bench/results/cold-load-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.run_record import run_record
from slora_core.adapter_cache import AdapterStore
from slora_core.adapter_copies import AdapterCopier
from slora_core.adapters import load_adapter
from slora_core.arena import PageArena
from slora_core.config import LORA_MODULES, ModelConfig
from slora_core.page_pool import PagePool

LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
MODULE_SETS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "all7": LORA_MODULES}
RANKS = (8, 16, 64)
DTYPE = torch.float16


def write_peft_dir(path: Path, cfg: ModelConfig, rank: int, modules: tuple[str, ...],
                   seed: int) -> Path:
    """A PEFT LoRA directory (fp16 safetensors, N(0, 0.02) A and B) for `cfg`'s layers."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in modules:
            fan_in, fan_out = cfg.module_shape(module)
            block = "self_attn" if module in MODULE_SETS["attention"] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=gen) * 0.02).to(DTYPE)
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=gen) * 0.02).to(DTYPE)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
              "lora_alpha": 2 * rank, "target_modules": list(modules), "bias": "none",
              "lora_dropout": 0.0, "use_rslora": False}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def drop_file_cache(path: Path) -> None:
    """Evict the directory's files from the OS page cache, so the next read hits the disk."""
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Tiers:
    """An arena and the engine's host tier and copier for one model shape."""

    def __init__(self, cfg: ModelConfig, num_pages: int, device: torch.device) -> None:
        self.device = device
        self.arena = PageArena(cfg, num_pages, 16, num_pages + 1, DTYPE, device, max_rank=64)
        self.pool = PagePool(num_pages, num_slots=num_pages)
        self.store = AdapterStore(cfg, max_rank=64, dtype=DTYPE,
                                  page_numel=self.arena.page_numel, capacity_bytes=1 << 36,
                                  pin_memory=device.type == "cuda")
        self.copier = AdapterCopier(self.arena)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def make_resident_ms(self, name: str) -> float:
        """get -> pages -> copy -> landed, as a step does it; then evict again (untimed)."""
        self.sync()
        t0 = time.perf_counter()
        host = self.store.get(name)
        rec, _, evicted = self.pool.acquire_adapter(name, host.layout.num_pages)
        for old in evicted:
            self.copier.clear(old.slot)
        self.copier.write(rec.slot, rec.pages, host)
        self.copier.wait(rec.slot)
        self.sync()
        ms = (time.perf_counter() - t0) * 1e3
        self.pool.release_adapter(name)
        self.copier.clear(self.pool.evict_adapter(name).slot)
        return ms


def median_ms(fn: Callable[[], float], reps: int, warm_up: bool = True) -> float:
    if warm_up:
        fn()  # allocator, pinned pools, CUDA streams
    return statistics.median(fn() for _ in range(reps))


def plain_copy_ms(nbytes: int, device: torch.device, reps: int) -> float:
    """One pinned host buffer -> device copy of `nbytes`, host-timed to the landed copy."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory() if device.type == "cuda" \
        else torch.empty(nbytes, dtype=torch.uint8)
    src.random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3

    return median_ms(once, reps)


def measure(t: Tiers, cfg: ModelConfig, root: Path, rank: int, modules: str,
            reps: int) -> dict[str, object]:
    path = write_peft_dir(root / f"r{rank}-{modules}", cfg, rank, MODULE_SETS[modules], rank)
    t.store.register("host", path)
    host = t.store.get("host")  # parsed, validated and pinned: the host tier
    row: dict[str, object] = {"rank": rank, "modules": modules, "bytes": host.nbytes,
                              "pages": host.layout.num_pages,
                              "matrices": 2 * len(host.matrices)}
    row["host_ms"] = median_ms(lambda: t.make_resident_ms("host"), reps)
    row["plain_copy_ms"] = plain_copy_ms(host.nbytes, t.device, reps)
    row["host_over_plain_copy"] = row["host_ms"] / row["plain_copy_ms"]  # type: ignore[operator]

    def from_disk(drop: bool) -> float:
        t.store.unregister("disk")
        t.store.register("disk", path)
        if drop:
            drop_file_cache(path)
        return t.make_resident_ms("disk")

    def parse_only() -> float:
        drop_file_cache(path)
        t0 = time.perf_counter()
        load_adapter(path, cfg, max_rank=64, dtype=DTYPE)
        return (time.perf_counter() - t0) * 1e3

    # Disk loads of a 320 MB adapter take seconds: fewer repeats, the host path warmed them.
    disk_reps = max(1, min(reps, 3))
    row["disk_ms"] = median_ms(lambda: from_disk(True), disk_reps, warm_up=False)
    row["disk_cached_ms"] = median_ms(lambda: from_disk(False), disk_reps, warm_up=False)
    row["disk_read_parse_validate_ms"] = median_ms(parse_only, disk_reps, warm_up=False)
    row["file_bytes"] = sum(f.stat().st_size for f in path.iterdir())
    t.store.unregister("host")
    t.store.unregister("disk")
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32, help="fewer for a CPU smoke run")
    ap.add_argument("--tmp", default=None, help="directory on the local disk for the files")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_dict({"model_type": "llama", "max_position_embeddings": 4096,
                                 "rms_norm_eps": 1e-5, **LLAMA2_7B,
                                 "num_hidden_layers": args.layers})
    device = torch.device(args.device)
    tiers = Tiers(cfg, num_pages=72, device=device)  # room for r64 on all seven modules
    rows: list[dict[str, object]] = []
    result = {**run_record(["bench.cold_load", *(argv or sys.argv[1:])]), "shape": "llama2-7b",
              "layers": args.layers, "dtype": "float16", "reps": args.reps,
              "method": "median of reps (disk: at most 3), host clock to a synchronized "
                        "device; host path after one warm-up",
              "target": {"host_over_plain_copy": 1.5}, "rows": rows}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for modules in MODULE_SETS:
            for rank in RANKS:
                row = measure(tiers, cfg, Path(tmp), rank, modules, args.reps)
                rows.append(row)
                print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)
                if args.out:  # after every row: a run cut short keeps what finished
                    with open(args.out, "w") as f:
                        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
