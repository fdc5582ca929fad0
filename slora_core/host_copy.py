"""Host values to the device without holding the host.

`torch.tensor(values, device=cuda)`, `cpu_tensor.to(cuda)` and indexing a CUDA tensor with a
Python list copy from pageable memory and then synchronize the stream. Called after a step's
launch (the sampler's per-row parameters, the rows of requests that finished meanwhile), that
held the host until the step's forward ended: the next step was launched only after it, and
the GPU idled through the host's launch, undoing asynchronous steps. In the hop traces of
service-overhead-7b-gw4-pacer-trace-c256-87cd49f-h100.json, `step()` returned a p50 11.5 ms
and a p90 22.8 ms after its read at 256 rows (in a stretch of steps that took new requests,
22.8-23.1 ms: at the end of the step it had launched). With sampled requests the engine ran
1.09-1.14x faster without it (serving-hostsync-26fafc7-h100.json,
serving-hostsync-57ee3f6-h100.json).
`host_values` copies through pinned memory, non-blocking: the copy is queued behind the work
already on the stream and the host goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def host_values(values: Sequence[float] | Sequence[int] | Sequence[bool] | np.ndarray,
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a 1-D (or, from an array, same-shaped) tensor of `dtype` on `device`; on
    CUDA through pinned memory, without blocking the host."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def row_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row numbers as an index tensor on `device` (indexing with the list itself would
    synchronize the stream)."""
    return host_values(rows, torch.long, device)
