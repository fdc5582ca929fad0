"""`TPEngine`: an `LLMEngine` over one rank's shard. On rank 0 it is the engine (same
add_request/step API): it schedules, samples, and records every arena and adapter-store change
so the other ranks apply the same ones before the step that needs them. On the other ranks
`serve()` applies rank 0's messages until it says stop."""

from __future__ import annotations

import faulthandler
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from slora_core.adapter_cache import AdapterStore, HostAdapter
from slora_core.adapters import LoraAdapter
from slora_core.config import ConfigError, EngineConfig
from slora_core.engine import LLMEngine
from slora_core.model import LlamaForCausalLM
from slora_core.outputs import RequestOutput
from slora_core.scheduler import SchedulerOutput
from slora_core.tokenizer import Tokenizer
from slora_core.tp.group import TPGroup
from slora_core.tp.layers import parallelize_rows
from slora_core.tp.runner import ArenaOp, TPModelRunner
from slora_core.tp.shard import TPShard

log = logging.getLogger(__name__)


class ShardedAdapterStore(AdapterStore):
    """Adapters validated against the full model, then cut to this rank's shard before they
    are laid out in pages."""

    def __init__(self, shard: TPShard, **kwargs: Any) -> None:
        super().__init__(shard.full, **kwargs)
        self.shard = shard
        # In-memory adapters that share one weight set (a benchmark's thousand views of a few
        # random adapters) share one shard: id(weights) -> (weights, its host shard).
        self._shared: dict[int, tuple[Any, HostAdapter]] = {}

    def add_loaded(self, name: str, adapter: LoraAdapter) -> None:
        hit = self._shared.get(id(adapter.weights))
        if hit is None or hit[0] is not adapter.weights:
            super().add_loaded(name, adapter)
            self._shared[id(adapter.weights)] = (adapter.weights, self._in_memory[name])
        else:
            self._in_memory[name] = replace(hit[1], adapter=adapter)

    def _prepare(self, adapter: LoraAdapter, image: bool = False) -> HostAdapter:
        weights = {}
        for (layer, module), w in adapter.weights.items():
            a, b = self.shard.shard_lora(module, w.a, w.b)
            weights[(layer, module)] = replace(w, a=a, b=b)
        return super()._prepare(replace(adapter, weights=weights), image=image)


class TPEngine(LLMEngine):
    _is_tensor_parallel = True

    def __init__(self, model: LlamaForCausalLM, shard: TPShard, group: TPGroup,
                 tokenizer: Tokenizer | None, config: EngineConfig, *,
                 detokenize: bool = True) -> None:
        """`model`: this rank's shard (`load_model_shard`)."""
        if config.async_steps:
            raise ConfigError("async_steps is not supported with tensor_parallel_size > 1")
        # Decode graphs only (TPModelRunner): mixed-step graphs are not shared by the ranks yet.
        config = replace(config, mixed_graphs=False)
        super().__init__(model, shard.engine_config(), tokenizer, config, detokenize=detokenize)
        self.shard, self.group = shard, group
        parallelize_rows(model, group)  # after the LoRA wrap: LoRA deltas join the sums
        self.runner = self.tp_runner = TPModelRunner(self.runner, group)
        self.adapters = ShardedAdapterStore(
            shard, max_rank=config.max_rank, dtype=config.torch_dtype,
            page_numel=self.arena.page_numel, capacity_bytes=config.host_cache_bytes,
            pin_memory=self.arena.pages.device.type == "cuda")
        self.worker_processes: list[Any] = []  # rank 0: the other ranks (see launch.py)
        self._closed = False

    def _record(self, op: ArenaOp) -> None:
        self.tp_runner.record(op)

    def warmup(self, lora: bool | None = None) -> None:
        """Rank 0: every rank captures the same graphs, in the same order (their warm-up
        forwards and captures run collectives)."""
        if self.runner.graphs is None:
            return
        sets = self._graph_module_sets(lora)
        with self.tp_runner.ops_lock:
            ops, self.tp_runner.pending_ops = self.tp_runner.pending_ops, []
        self.tp_runner.send([*ops, ("capture", sets)])
        self._capture_graphs(sets)

    # ---- rank 0: record what the other ranks must repeat ----------------------------------
    def register_adapter(self, name: str, path: str | Path, sha256: str | None = None,
                         *, preload: bool = True) -> None:
        super().register_adapter(name, path, sha256, preload=preload)
        self._record(("register", name, str(path), sha256))

    def add_adapter(self, name: str, adapter: LoraAdapter) -> None:
        super().add_adapter(name, adapter)
        self._record(("add", name, adapter))

    def unregister_adapter(self, name: str) -> None:
        with self.tp_runner.ops_lock:
            super().unregister_adapter(name)
            self._record(("unregister", name))

    def _apply_memory_changes(self, sched: SchedulerOutput) -> list[RequestOutput]:
        with self.tp_runner.ops_lock:
            return self._apply_and_record(sched)

    def _apply_and_record(self, sched: SchedulerOutput) -> list[RequestOutput]:
        failed = super()._apply_memory_changes(sched)
        for rec in sched.evicted:
            self._record(("clear", rec.slot))
        for rec in sched.new_adapters:
            live = self.pool.resident(rec.key)
            if live is not None and live.slot == rec.slot:
                self._record(("write", rec.slot, list(rec.pages), str(rec.key)))
            else:  # failed to load: rank 0 cleared the slot
                self._record(("clear", rec.slot))
        return failed

    def keepalive(self) -> None:
        """Rank 0, idle: an empty message. Ranks > 0 always have a receive posted for rank 0's
        next message, and NCCL's watchdog ends a collective that waits past the group timeout
        (600 s), so an idle worker would lose its ranks without this."""
        if self.group.size > 1:
            self.tp_runner.send([])

    def close(self, timeout_s: float = 30.0) -> None:
        """Rank 0: stop the other ranks and leave the group, in bounded time: a rank that has
        not exited `timeout_s` after leaving is killed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        super().close()
        procs = self.worker_processes
        if self.group.size > 1 and all(p.is_alive() for p in procs):
            try:
                self.tp_runner.send([], stop=True)
            except Exception:  # noqa: BLE001 (the group failed: the ranks are killed below)
                log.exception("could not send stop to the other ranks")
        else:  # a rank died: its peers could wait for it until the collective timeout
            for proc in procs:
                proc.kill()
        # The other ranks leave as soon as they read the stop; NCCL's destroy waits for all
        # ranks' destroy, so rank 0 leaves now, before waiting for their exit.
        self.group.leave(timeout_s)
        for proc in procs:
            proc.join(timeout=timeout_s)
            if proc.is_alive():
                log.error("rank process %s did not exit: killed", proc.pid)
                proc.kill()
                proc.join(timeout=5)

    # ---- other ranks --------------------------------------------------------------------
    def serve(self, stall_dump_s: float | None = None) -> None:
        """Rank > 0: apply rank 0's changes and run its steps until it says stop. With
        `stall_dump_s`, every thread's Python stack goes to stderr every `stall_dump_s` seconds
        that one message (waiting for it, applying it, running its step) takes: where a hang
        is, on this rank."""
        try:
            self._serve(stall_dump_s)
        finally:
            if stall_dump_s:
                faulthandler.cancel_dump_traceback_later()

    def _serve(self, stall_dump_s: float | None) -> None:
        rank = self.group.rank
        armed_at = -float("inf")
        while True:
            # Re-arming starts a thread: at most once a second (a dump may come a second early).
            if stall_dump_s and time.monotonic() - armed_at > min(1.0, stall_dump_s / 4):
                faulthandler.dump_traceback_later(stall_dump_s, repeat=True)
                armed_at = time.monotonic()
            msg = self.tp_runner.receive()
            if msg.stop:
                return
            if msg.ops:
                log.debug("rank %d: %d ops %s", rank, len(msg.ops),
                          [op[0] for op in msg.ops][:16])
            for op in msg.ops:
                self.apply_op(op)
            # Rank 0 waits for the copies of the slots its step reads; here every copy this
            # message started is waited for (on the compute stream, not the host).
            for op in msg.ops:
                if op[0] == "write":
                    self.copier.wait(op[1])
            if msg.shape is not None and msg.flat is not None:
                self.tp_runner.follow(msg.flat, msg.shape)

    def apply_op(self, op: ArenaOp) -> None:
        kind = op[0]
        if kind == "clear":
            self.copier.clear(op[1])
        elif kind == "write":
            _, slot, pages, name = op
            host = self.adapters.get(name)
            if host.layout.num_pages != len(pages):
                raise RuntimeError(f"adapter {name!r} takes {host.layout.num_pages} pages on "
                                   f"rank {self.group.rank}, {len(pages)} on rank 0")
            self.copier.write(slot, pages, host)
        elif kind == "register":
            self.adapters.register(op[1], op[2], op[3])
        elif kind == "add":
            self.adapters.add_loaded(op[1], op[2])
        elif kind == "unregister":
            self.adapters.unregister(op[1])
        elif kind == "capture":
            self._capture_graphs(op[1])
        else:
            raise ValueError(f"unknown arena op {kind!r}")
