"""vLLM's own Triton LoRA kernels (shrink + expand), run beside ours on the same inputs.

vLLM is not on the GPU image and its wheel (~330 MB, compiled for one torch) cannot be carried
there, but its multi-LoRA kernels are plain Triton in five Python files. `fetch` downloads the
wheel once (pip, no dependencies) and extracts exactly those files unchanged; a handful of
small modules stand in for the parts of vLLM they import at load time (its environment flags
with vLLM's defaults, the platform query, the logger, `triton_utils`, and the custom-op
registration, which they fall back from to the plain Python function). The kernels, their
launch wrappers, their default configs and their metadata class are vLLM's.

    python -m bench.vllm_lora --fetch .vllm-lora      # here (needs the package index)
    python -m bench.kernels_lora_grid --vllm-src .vllm-lora ...   # on the GPU

`VllmLora` then calls them the way vLLM's punica wrapper does (`add_lora_linear`): a float32
buffer [slices, tokens, rank], `lora_shrink` with the scale (it zeroes the buffer itself),
`lora_expand` adding into y, with `LoRAKernelMeta` built for `max_loras` = the adapters in the
batch and vLLM's default `specialize_active_lora=False`.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VERSION = "0.33.0"
KERNEL_FILES = tuple(f"vllm/lora/ops/triton_ops/{name}.py" for name in (
    "kernel_utils", "lora_expand_op", "lora_kernel_metadata", "lora_shrink_op", "utils"))
OTHER_FILES = ("vllm/utils/math_utils.py",)
# Stand-ins for what the kernel files import from the rest of vLLM, and nothing more.
SHIMS: dict[str, str] = {
    "vllm/__init__.py": "",
    "vllm/lora/__init__.py": "",
    "vllm/lora/ops/__init__.py": "",
    "vllm/lora/ops/triton_ops/__init__.py": (
        "from vllm.lora.ops.triton_ops.lora_expand_op import lora_expand\n"
        "from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta\n"
        "from vllm.lora.ops.triton_ops.lora_shrink_op import lora_shrink\n"
        "__all__ = ['lora_expand', 'lora_shrink', 'LoRAKernelMeta']\n"),
    # vLLM's defaults for the flags the kernels read (vllm/envs.py), overridable the same way.
    "vllm/envs.py": (
        "import os\n"
        "VLLM_BATCH_INVARIANT = bool(int(os.getenv('VLLM_BATCH_INVARIANT', '0')))\n"
        "VLLM_TUNED_CONFIG_FOLDER = os.getenv('VLLM_TUNED_CONFIG_FOLDER', None)\n"
        "VLLM_LORA_DISABLE_PDL = bool(int(os.getenv('VLLM_LORA_DISABLE_PDL', '0')))\n"
        "VLLM_LORA_ENABLE_DUAL_STREAM = bool(int(os.getenv('VLLM_LORA_ENABLE_DUAL_STREAM', "
        "'0')))\n"),
    "vllm/platforms.py": (
        "import torch\n"
        "class _Cuda:\n"
        "    def is_cuda(self):\n"
        "        return torch.cuda.is_available() and torch.version.hip is None\n"
        "    def _cap(self):\n"
        "        major, minor = torch.cuda.get_device_capability()\n"
        "        return major * 10 + minor\n"
        "    def has_device_capability(self, cap):\n"
        "        return self.is_cuda() and self._cap() >= cap\n"
        "    def is_device_capability(self, cap):\n"
        "        return self.is_cuda() and self._cap() == cap\n"
        "current_platform = _Cuda()\n"),
    "vllm/logger.py": (
        "import logging\n"
        "class _Logger(logging.LoggerAdapter):\n"
        "    def warning_once(self, msg, *a):\n"
        "        self.warning(msg, *a)\n"
        "    def info_once(self, msg, *a):\n"
        "        self.info(msg, *a)\n"
        "def init_logger(name):\n"
        "    return _Logger(logging.getLogger(name), {})\n"),
    "vllm/triton_utils/__init__.py": "import triton\nimport triton.language as tl\n",
    "vllm/utils/__init__.py": "",
    # No torch.ops.vllm namespace is registered, so the kernel files take their own fallback
    # (`except AttributeError: lora_shrink = _lora_shrink`), the plain Python launcher.
    "vllm/utils/torch_utils.py": (
        "import torch\n"
        "def direct_register_custom_op(**kwargs):\n"
        "    pass\n"
        "def async_tensor_h2d(data, device=None, dtype=None, out=None):\n"
        "    t = torch.tensor(data, dtype=dtype, device='cpu')\n"
        "    if torch.cuda.is_available():\n"
        "        t = t.pin_memory()\n"
        "    if out is not None:\n"
        "        return out.copy_(t, non_blocking=True)\n"
        "    return t.to(device=device, dtype=dtype, non_blocking=True)\n"),
}


def fetch(dest: Path, version: str = VERSION, wheel: Path | None = None) -> Path:
    """vLLM `version`'s LoRA kernel files (unchanged) plus the stand-ins, under `dest`."""
    if wheel is None:  # the ~330 MB wheel is read, then deleted with its folder
        with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                            tmp, f"vllm=={version}"], check=True)
            return fetch(dest, version, next(Path(tmp).glob("vllm-*.whl")))
    with zipfile.ZipFile(wheel) as z:
        for name in (*KERNEL_FILES, *OTHER_FILES):
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
    for name, text in SHIMS.items():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    (dest / "VERSION").write_text(f"vllm {version} ({wheel.name})\n")
    return dest


def load(src: Path) -> Any:
    """vLLM's `triton_ops` package from a folder `fetch` wrote."""
    if not (src / "VERSION").exists():
        raise SystemExit(f"{src} holds no vLLM kernels: run python -m bench.vllm_lora --fetch")
    sys.path.insert(0, str(src))
    return importlib.import_module("vllm.lora.ops.triton_ops")


def version(src: Path) -> str:
    return (src / "VERSION").read_text().strip()


class VllmLora:
    """One module's LoRA through vLLM's kernels: `call()` adds x @ A.T @ B.T * scale into y
    for every token, each with its adapter (`slots`), as `add_lora_linear` does."""

    def __init__(self, ops: Any, x: torch.Tensor, y: torch.Tensor, a_stack: torch.Tensor,
                 b_stack: torch.Tensor, slots: list[int], scale: float) -> None:
        self.ops, self.x, self.y, self.scale = ops, x, y, scale
        self.a, self.b = [a_stack], [b_stack]  # [adapters, rank, K], [adapters, N, rank]
        adapters = a_stack.shape[0]
        self.meta = ops.LoRAKernelMeta.make(max_loras=adapters, max_num_tokens=len(slots),
                                            device=x.device)
        self.meta.prepare_tensors(torch.tensor(slots, dtype=torch.int32, device=x.device))
        # add_lora_linear allocates it per call; inside a CUDA graph that is a pool address.
        self.buffer = torch.empty((1, x.shape[0], a_stack.shape[1]), dtype=torch.float32,
                                  device=x.device)

    def __call__(self) -> None:
        args = self.meta.meta_args(self.x.shape[0], False)
        self.ops.lora_shrink(self.x, self.a, self.buffer, *args, self.scale)
        self.ops.lora_expand(self.buffer, self.b, self.y, *args, offset_start=0,
                             add_inputs=True)


def calls(ops: Any, layers: list[Any], slots: list[int]) -> list[Callable[[], None]]:
    """One `VllmLora` per rotation layer of bench.kernels_lora (its scale: the layers')."""
    return [VllmLora(ops, lay.x, lay.y, lay.a_stack, lay.b_stack, slots,
                     float(lay.scales[0, 0])) for lay in layers]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fetch", required=True, type=Path, help="folder to write the kernels to")
    ap.add_argument("--version", default=VERSION)
    ap.add_argument("--wheel", type=Path, default=None, help="a vLLM wheel already downloaded")
    args = ap.parse_args()
    out = fetch(args.fetch, args.version, args.wheel)
    print(f"{version(out)} LoRA kernels in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
