"""Host tiers of the adapter cache: registered adapters (files on disk) and an LRU of parsed,
validated adapters in (pinned) host memory, ready to be copied into arena pages."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from slora_core.adapters import LoraAdapter, load_adapter
from slora_core.arena import AdapterLayout, plan_adapter_layout
from slora_core.config import MODULE_INDEX, ModelConfig


class UnknownAdapterError(KeyError):
    """A request named an adapter that was never registered with the engine."""

    def __str__(self) -> str:
        return f"unknown adapter {self.args[0]!r}"


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    sha256: str | None = None


@dataclass(frozen=True)
class HostAdapter:
    """A validated adapter in host memory plus where its matrices go inside arena pages."""

    adapter: LoraAdapter
    layout: AdapterLayout
    matrices: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    # The adapter's pages as they will sit in the arena ([num_pages * page_numel], the
    # matrices are views into it), for adapters parsed from files: a load is then one copy per
    # run of consecutive arena pages instead of one per matrix (256-448 of them at Llama-2-7B
    # shapes, whose launch costs made a load 1.4-7x a plain copy of the same bytes). None for
    # adapters added in memory, whose matrices may be views shared with other adapters.
    image: torch.Tensor | None = None


class AdapterStore:
    """Registered adapters and the host-memory LRU tier (bounded by `capacity_bytes`)."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        max_rank: int,
        dtype: torch.dtype,
        page_numel: int,
        capacity_bytes: int,
        pin_memory: bool = False,
    ) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.dtype = dtype
        self.page_numel = page_numel
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self._specs: dict[str, AdapterSpec] = {}
        self._cache: OrderedDict[str, HostAdapter] = OrderedDict()
        self._in_memory: dict[str, HostAdapter] = {}  # no files behind them: never evicted
        self._bytes = 0
        self._lock = threading.Lock()
        # One lock per adapter being read: a second caller waits for the first's read instead
        # of parsing the same files again (the worker's load command and a request that came
        # meanwhile both ask for a new version).
        self._reading: dict[str, threading.Lock] = {}
        self.loads = 0

    def register(self, name: str, path: str | Path, sha256: str | None = None) -> None:
        if not name:
            raise ValueError("adapter name must be non-empty")
        self._specs[name] = AdapterSpec(name=name, path=str(path), sha256=sha256)

    def add_loaded(self, name: str, adapter: LoraAdapter) -> None:
        """Register an adapter built in memory (benchmarks, tests); kept in host memory."""
        if not name:
            raise ValueError("adapter name must be non-empty")
        self._in_memory[name] = self._prepare(adapter)

    def unregister(self, name: str) -> None:
        self._specs.pop(name, None)
        self._in_memory.pop(name, None)
        with self._lock:
            self._reading.pop(name, None)
            host = self._cache.pop(name, None)
            if host is not None:
                self._bytes -= host.nbytes

    def is_registered(self, name: str) -> bool:
        return name in self._specs or name in self._in_memory

    def is_cached(self, name: str) -> bool:
        return name in self._cache

    def peek(self, name: str) -> HostAdapter | None:
        """The adapter if it is in host memory (touched in the LRU), else None: never reads
        the disk."""
        if name in self._in_memory:
            return self._in_memory[name]
        with self._lock:
            host = self._cache.get(name)
            if host is not None:
                self._cache.move_to_end(name)
            return host

    def names(self) -> list[str]:
        return [*self._specs, *self._in_memory]

    def target_module_ids(self) -> frozenset[int]:
        """Module ids (config.MODULE_INDEX) targeted by the adapters parsed so far."""
        with self._lock:
            hosts = [*self._in_memory.values(), *self._cache.values()]
        return frozenset(MODULE_INDEX[module] for host in hosts
                         for (_, module), entry in host.layout.entries.items() if entry[0] > 0)

    def get(self, name: str) -> HostAdapter:
        """The adapter in host memory, loading and validating it from disk on a miss.
        Raises UnknownAdapterError or an AdapterError that names the problem."""
        host = self.peek(name)
        if host is not None:
            return host
        with self._lock:
            reading = self._reading.setdefault(name, threading.Lock())
        with reading:
            host = self.peek(name)  # read by the caller this one waited for
            if host is not None:
                return host
            spec = self._specs.get(name)
            if spec is None:
                raise UnknownAdapterError(name)
            host = self._load(spec)
            with self._lock:
                self._cache[name] = host
                self._bytes += host.nbytes
                while self._bytes > self.capacity_bytes and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._bytes -= old.nbytes
                self._reading.pop(name, None)
        return host

    def _load(self, spec: AdapterSpec) -> HostAdapter:
        adapter = load_adapter(
            spec.path, self.model_config, max_rank=self.max_rank, dtype=self.dtype,
            expected_sha256=spec.sha256,
        )
        self.loads += 1
        return self._prepare(adapter, image=True)

    def _prepare(self, adapter: LoraAdapter, image: bool = False) -> HostAdapter:
        shapes = {key: (w.a.shape[0], w.a.shape[1], w.b.shape[0], w.scale)
                  for key, w in adapter.weights.items()}
        layout = plan_adapter_layout(shapes, self.page_numel)
        if image:
            return self._as_image(adapter, layout)
        matrices = {key: (w.a.contiguous(), w.b.contiguous())
                    for key, w in adapter.weights.items()}
        if self.pin_memory and not all(t.is_pinned() for pair in matrices.values()
                                       for t in pair):
            matrices = packed_pairs(matrices, pin_memory=True)
        nbytes = sum(a.nbytes + b.nbytes for a, b in matrices.values())
        return HostAdapter(adapter=adapter, layout=layout, matrices=matrices, nbytes=nbytes)

    def _as_image(self, adapter: LoraAdapter, layout: AdapterLayout) -> HostAdapter:
        """The adapter's matrices written once into its page image (pinned when the tier is);
        the parsed tensors are dropped, the matrices become views of the image."""
        image = torch.zeros(layout.num_pages * self.page_numel, dtype=self.dtype,
                            pin_memory=self.pin_memory)
        matrices = {}
        for key, (_, _, (pa, oa), (pb, ob)) in layout.entries.items():
            w = adapter.weights[key]
            a = image[pa * self.page_numel + oa:][: w.a.numel()].view(w.a.shape)
            b = image[pb * self.page_numel + ob:][: w.b.numel()].view(w.b.shape)
            a.copy_(w.a)
            b.copy_(w.b)
            matrices[key] = (a, b)
        return HostAdapter(adapter=adapter, layout=layout, matrices=matrices,
                           nbytes=image.numel() * image.element_size(), image=image)


Pairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def packed_pairs(pairs: Pairs, *, pin_memory: bool) -> Pairs:
    """The same (A, B) matrices as views of one new buffer (pinned with `pin_memory`): an
    in-memory adapter then costs one page-locked allocation instead of two per module and
    layer (the store pinned each matrix it was given). On the H200s, with the other rank
    waiting in NCCL, rank 0 took ~11 s to add one 70B-shaped r16 weight set (640 matrices,
    tp-70b-h200.json at d36bbb6), ~17 ms a matrix: the page-locked allocations are the likely
    cost (not yet timed alone). Matrices of mixed dtypes are pinned one by one."""
    tensors = [t for pair in pairs.values() for t in pair]
    if len({t.dtype for t in tensors}) > 1:
        return {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in pairs.items()} \
            if pin_memory else pairs
    if not tensors:
        return pairs
    buf = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                      pin_memory=pin_memory)
    out: Pairs = {}
    offset = 0
    for key, pair in pairs.items():
        views = []
        for t in pair:
            view = buf[offset:offset + t.numel()].view(t.shape)
            view.copy_(t)
            views.append(view)
            offset += t.numel()
        out[key] = (views[0], views[1])
    return out
