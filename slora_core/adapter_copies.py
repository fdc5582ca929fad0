"""Adapter weights into arena pages on a side stream, so loads overlap compute; each slot's
copy carries an event, and a step waits only for the slots it reads (or frees)."""

from __future__ import annotations

import contextlib

import torch

from slora_core.adapter_cache import HostAdapter
from slora_core.arena import PageArena


class AdapterCopier:
    def __init__(self, arena: PageArena) -> None:
        self.arena = arena
        dev = arena.pages.device
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._pending: dict[int, torch.cuda.Event] = {}
        # A launched step may still read or write pages and table rows that this copier is
        # about to overwrite: with asynchronous steps (freed by a request that finished on the
        # host meanwhile), and with synchronous ones too, since only a step that samples ends
        # with a host sync: after a step of prefill chunks alone, pages freed by an abort, a
        # failed request or a preemption can go to an adapter while that step still writes
        # their KV rows. So each write first waits for the compute stream's work: an event
        # wait on the GPU, no host sync, and after a sampling step nothing is left to wait for.
        self.after_compute = True

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        if self._stream is None:
            return contextlib.nullcontext()
        if self.after_compute:
            self._stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self._stream)

    def write(self, slot: int, pages: list[int], host: HostAdapter) -> None:
        """Start copying `host` into its pages and table rows (asynchronous on CUDA)."""
        with self._on_stream():
            self.arena.write_adapter(slot, pages, host.layout, host.matrices, host.image)
            if self._stream is not None:
                event = torch.cuda.Event()
                event.record(self._stream)
                self._pending[slot] = event

    def clear(self, slot: int) -> None:
        """Empty an evicted slot's table rows; its pages may be reused for KV by this step,
        so the compute stream first waits for any copy still writing them."""
        with self._on_stream():
            self.arena.clear_slot(slot)
        self.wait(slot)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait(self, slot: int) -> None:
        """Make the compute stream wait for the copy into `slot`, if one is pending."""
        if (event := self._pending.pop(slot, None)) is not None:
            torch.cuda.current_stream().wait_event(event)
