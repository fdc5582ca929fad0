"""How many Triton kernel variants this process has compiled, so benchmarks and the worker can
show that nothing compiles after warm-up (a compile stalls a step for seconds)."""

from __future__ import annotations

import sys

import triton


def compiled_kernel_variants() -> int:
    """Compiled variants held by the JIT functions of the `kernels` package (0 under the CPU
    interpreter, which compiles nothing)."""
    seen: set[int] = set()
    total = 0
    for name, module in list(sys.modules.items()):
        if name != "slora_kernels" and not name.startswith("slora_kernels."):
            continue
        for obj in list(vars(module).values()):
            if not isinstance(obj, triton.runtime.JITFunction) or id(obj) in seen:
                continue
            seen.add(id(obj))
            for entry in getattr(obj, "device_caches", {}).values():
                total += len(entry[0])  # (kernel_cache, ...) per device
    return total
