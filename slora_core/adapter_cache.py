"""Host tiers of the adapter cache: registered adapters (files on disk) and an LRU of parsed,
validated adapters in (pinned) host memory, ready to be copied into arena pages."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from slora_core.adapters import LoraAdapter, digest_adapter_dir, load_adapter
from slora_core.arena import AdapterLayout, plan_adapter_layout
from slora_core.config import MODULE_INDEX, ModelConfig


class UnknownAdapterError(KeyError):
    """A request named an adapter that was never registered with the engine."""

    def __str__(self) -> str:
        return f"unknown adapter {self.args[0]!r}"


@dataclass(frozen=True)
class AdapterSpec:
    """A registration: a name for the adapter whose content digest is `sha256`, and where its
    files are."""

    name: str
    path: str
    sha256: str


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
    """Registered adapters and the host-memory LRU tier (bounded by `capacity_bytes`).

    An adapter is identified by its content digest (sha256 of its config and weights, as
    `digest_adapter_dir` computes it), never by its name: a name maps to a digest, and host
    copies are kept by digest, so a name registered again with other content can never reach
    the old content's host copy, arena pages or cached KV (all keyed by the digest). A name's
    files are read and checked against its digest before anything is served under it."""

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
        self._specs: dict[str, AdapterSpec] = {}  # name -> its registration (files)
        self._names: dict[str, str] = {}  # name -> digest, files and in-memory alike
        self._files: dict[str, AdapterSpec] = {}  # digest -> a registration to read it from
        self._verified: set[str] = set()  # names whose files were read and matched
        self._cache: OrderedDict[str, HostAdapter] = OrderedDict()  # digest -> host copy
        self._in_memory: dict[str, HostAdapter] = {}  # digest -> no files: never evicted
        self._bytes = 0
        self._lock = threading.Lock()
        # One lock per digest being read: a second caller waits for the first's read instead
        # of parsing the same files again (the worker's load command and a request that came
        # meanwhile both ask for a new version).
        self._reading: dict[str, threading.Lock] = {}
        self.loads = 0

    def register(self, name: str, path: str | Path, sha256: str | None = None) -> str:
        """Name the adapter in `path`; returns its digest: `sha256` as given (checked when the
        files are read: a mismatch is refused then, nothing kept), or computed from the files
        now. Raises AdapterFormatError when the files cannot be read."""
        if not name:
            raise ValueError("adapter name must be non-empty")
        digest = sha256.strip().lower() if sha256 else digest_adapter_dir(path)
        spec = AdapterSpec(name=name, path=str(path), sha256=digest)
        with self._lock:
            self._drop_name(name)
            self._specs[name], self._names[name] = spec, digest
            self._files.setdefault(digest, spec)
        return digest

    def add_loaded(self, name: str, adapter: LoraAdapter) -> str:
        """Register an adapter built in memory (benchmarks, tests, tensors pushed by a
        training loop), kept in host memory under its `sha256`; returns it."""
        if not name:
            raise ValueError("adapter name must be non-empty")
        host = self._prepare(adapter)
        with self._lock:
            self._drop_name(name)
            self._in_memory[adapter.sha256] = host
            self._names[name] = adapter.sha256
        return adapter.sha256

    def unregister(self, name: str) -> str | None:
        """Forget a name; returns the digest it named (its content stays until `forget`)."""
        with self._lock:
            return self._drop_name(name)

    def _drop_name(self, name: str) -> str | None:
        self._specs.pop(name, None)
        self._verified.discard(name)
        return self._names.pop(name, None)

    def forget(self, digest: str) -> None:
        """Drop everything kept for content no name serves any more: its host copy and where
        its files were."""
        with self._lock:
            if digest in self._names.values():
                return
            self._in_memory.pop(digest, None)
            self._files.pop(digest, None)
            self._reading.pop(digest, None)
            host = self._cache.pop(digest, None)
            if host is not None:
                self._bytes -= host.nbytes

    def digest_of(self, name: str) -> str:
        """The digest a registered name serves now. Raises UnknownAdapterError."""
        try:
            return self._names[name]
        except KeyError:
            raise UnknownAdapterError(name) from None

    def is_registered(self, name: str) -> bool:
        return name in self._names

    def is_cached(self, name: str) -> bool:
        """The name's content is in host memory, checked against the name's files."""
        digest = self._names.get(name)
        return digest is not None and (digest in self._in_memory or (
            name in self._verified and digest in self._cache))

    def peek(self, name: str) -> HostAdapter | None:
        """The adapter if it is in host memory (touched in the LRU) and checked against the
        name's files, else None: never reads the disk."""
        digest = self._names.get(name)
        if digest is None:
            return None
        if digest in self._in_memory:
            return self._in_memory[digest]
        if name not in self._verified:
            return None
        return self._peek_digest(digest)

    def _peek_digest(self, digest: str) -> HostAdapter | None:
        if digest in self._in_memory:
            return self._in_memory[digest]
        with self._lock:
            host = self._cache.get(digest)
            if host is not None:
                self._cache.move_to_end(digest)
            return host

    def names(self) -> list[str]:
        return list(self._names)

    def names_digests(self) -> set[str]:
        """The digests some name serves now."""
        return set(self._names.values())

    def target_module_ids(self) -> frozenset[int]:
        """Module ids (config.MODULE_INDEX) targeted by the adapters parsed so far."""
        with self._lock:
            hosts = [*self._in_memory.values(), *self._cache.values()]
        return frozenset(MODULE_INDEX[module] for host in hosts
                         for (_, module), entry in host.layout.entries.items() if entry[0] > 0)

    def get(self, name: str) -> HostAdapter:
        """The adapter a name serves, in host memory: read from the name's files and checked
        against its digest the first time, from the host tier after. Raises
        UnknownAdapterError or an AdapterError that names the problem (a digest mismatch
        among them)."""
        host = self.peek(name)
        if host is not None:
            return host
        spec = self._specs.get(name)
        if spec is None:
            raise UnknownAdapterError(name)
        return self._read(spec, name)

    def get_for(self, name: str, digest: str) -> HostAdapter:
        """`get(name)` while the name still serves `digest`, else `get_digest(digest)`: a
        request keeps the content it was queued with."""
        if self._names.get(name) == digest:
            return self.get(name)
        return self.get_digest(digest)

    def get_digest(self, digest: str) -> HostAdapter:
        """The adapter with this content, in host memory, read from a registration's files on
        a miss (a running request's adapter after its name moved on, a rank > 0's copy).
        Raises UnknownAdapterError or an AdapterError."""
        host = self._peek_digest(digest)
        if host is not None:
            return host
        spec = self._files.get(digest)
        if spec is None:
            raise UnknownAdapterError(digest)
        return self._read(spec, None)

    def _read(self, spec: AdapterSpec, name: str | None) -> HostAdapter:
        """Read `spec`'s files (checked against its digest) into the host tier; with `name`,
        the name counts as checked after."""
        digest = spec.sha256
        with self._lock:
            reading = self._reading.setdefault(digest, threading.Lock())
        with reading:
            # Read by the caller this one waited for?
            host = self.peek(name) if name is not None else self._peek_digest(digest)
            if host is not None:
                return host
            host = self._load(spec)
            with self._lock:
                self._reading.pop(digest, None)
                if name is not None and self._specs.get(name) is spec:
                    self._verified.add(name)
                kept = self._cache.get(digest)
                if kept is not None:  # the content is in already (another name's read)
                    self._cache.move_to_end(digest)
                    return kept
                self._cache[digest] = host
                self._bytes += host.nbytes
                while self._bytes > self.capacity_bytes and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._bytes -= old.nbytes
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
