"""`TPEngine`: an `LLMEngine` over one rank's shard, which it wraps. On rank 0 it is the engine
(same add_request/step API): it schedules, samples, and records every arena and adapter-store
change so the other ranks apply the same ones before the step that needs them. On the other
ranks `serve()` applies rank 0's messages until it says stop. Every rank runs its steps
eagerly: decode graphs with NCCL collectives inside them were measured once (faithful to HF,
1.26x TP=1 at 26e3540, tp-correctness-h200.json) but not since the decode graphs changed, so
they were taken out rather than turned on untested."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from slora_core.adapter_cache import AdapterStore, HostAdapter
from slora_core.adapters import LoraAdapter
from slora_core.arena import PageArena
from slora_core.config import ConfigError, EngineConfig
from slora_core.engine import LLMEngine
from slora_core.model import LlamaForCausalLM
from slora_core.model_runner import ModelRunner
from slora_core.outputs import RequestOutput
from slora_core.page_pool import PagePool
from slora_core.sampling_params import SamplingParams
from slora_core.scheduler import Scheduler, SchedulerOutput
from slora_core.stats import EngineSnapshot, EngineStats
from slora_core.step_loop import StepLoop
from slora_core.structured.spec import StructuredOutput
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

    def add_loaded(self, name: str, adapter: LoraAdapter) -> str:
        hit = self._shared.get(id(adapter.weights))
        if hit is None or hit[0] is not adapter.weights:
            digest = super().add_loaded(name, adapter)
            self._shared[id(adapter.weights)] = (adapter.weights, self._in_memory[digest])
            return digest
        with self._lock:
            self._drop_name(name)
            self._in_memory[adapter.sha256] = replace(hit[1], adapter=adapter)
            self._names[name] = adapter.sha256
        return adapter.sha256

    def _prepare(self, adapter: LoraAdapter, image: bool = False) -> HostAdapter:
        weights = {}
        for (layer, module), w in adapter.weights.items():
            a, b = self.shard.shard_lora(module, w.a, w.b)
            weights[(layer, module)] = replace(w, a=a, b=b)
        return super()._prepare(replace(adapter, weights=weights), image=image)


class TPEngine:
    def __init__(self, model: LlamaForCausalLM, shard: TPShard, group: TPGroup,
                 tokenizer: Tokenizer | None, config: EngineConfig, *,
                 detokenize: bool = True) -> None:
        """`model`: this rank's shard (`load_model_shard`)."""
        if config.async_steps:
            raise ConfigError("async_steps is not supported with tensor_parallel_size > 1")
        config = replace(config, cuda_graphs=False, mixed_graphs=False)
        model_config = shard.engine_config()
        max_len = config.resolve_max_model_len(model_config)
        runner = ModelRunner.build(model, model_config, config,
                                   config.resolve_block_size(model_config), max_len)
        parallelize_rows(model, group)  # after the LoRA wrap: LoRA deltas join the sums
        self.tp_runner = TPModelRunner(runner, group)
        store = ShardedAdapterStore(
            shard, max_rank=config.max_rank, dtype=config.torch_dtype,
            page_numel=runner.arena.page_numel, capacity_bytes=config.host_cache_bytes,
            pin_memory=runner.arena.pages.device.type == "cuda")
        self.engine = LLMEngine(model, model_config, tokenizer, config, detokenize=detokenize,
                                runner=self.tp_runner, adapter_store=store, listener=self)
        self.shard, self.group = shard, group
        self.worker_processes: list[Any] = []  # rank 0: the other ranks (see launch.py)
        self._closed = False

    # ---- the engine's API, rank 0 --------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    @property
    def runner(self) -> ModelRunner:
        return self.engine.runner

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def pool(self) -> PagePool:
        return self.engine.pool

    @property
    def adapters(self) -> AdapterStore:
        return self.engine.adapters

    @property
    def arena(self) -> PageArena:
        return self.engine.arena

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    adapter: str | None = None, tenant: str = "",
                    deadline_s: float | None = None,
                    structured: StructuredOutput | None = None) -> None:
        self.engine.add_request(request_id, prompt, params, adapter, tenant, deadline_s,
                                structured)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.engine.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    @property
    def loop(self) -> StepLoop:
        return self.engine.loop

    def request_ids(self) -> list[str]:
        return self.engine.request_ids()

    def request_started(self, request_id: str) -> bool:
        return self.engine.request_started(request_id)

    def state_snapshot(self) -> EngineSnapshot:
        return self.engine.state_snapshot()

    def warm_adapters(self) -> list[str]:
        return self.engine.warm_adapters()

    def load_adapter(self, name: str) -> None:
        self.engine.load_adapter(name)

    def warmup(self, lora: bool | None = None) -> None:
        """Nothing to capture: the ranks run eagerly."""

    # ---- rank 0: record what the other ranks must repeat ----------------------------------
    def register_adapter(self, name: str, path: str | Path, sha256: str | None = None,
                         *, preload: bool = True) -> str:
        with self.tp_runner.ops_lock:
            digest = self.engine.register_adapter(name, path, sha256, preload=preload)
            self.tp_runner.record(("register", name, str(path), digest))
        return digest

    def add_adapter(self, name: str, adapter: LoraAdapter) -> str:
        with self.tp_runner.ops_lock:
            digest = self.engine.add_adapter(name, adapter)
            self.tp_runner.record(("add", name, adapter))
        return digest

    def register_adapter_tensors(self, name: str, state_dict: Mapping[str, torch.Tensor],
                                 config: Mapping[str, Any] | Any,
                                 sha256: str | None = None) -> str:
        """See LLMEngine.register_adapter_tensors; the other ranks get the parsed adapter."""
        return self.add_adapter(
            name, self.engine.tiers.parse_tensors(name, state_dict, config, sha256))

    def unregister_adapter(self, name: str) -> None:
        with self.tp_runner.ops_lock:
            self.engine.unregister_adapter(name)
            self.tp_runner.record(("unregister", name))

    def changing(self) -> contextlib.AbstractContextManager[object]:
        """ArenaListener: a step's arena changes and their records happen under the lock that
        adapter-store changes from other threads take, so records keep their order."""
        return self.tp_runner.ops_lock

    def forgot(self, digest: str) -> None:
        """ArenaListener: content no name serves and no request reads; the ranks drop it."""
        self.tp_runner.record(("forget", digest))

    def changed(self, sched: SchedulerOutput) -> None:
        for rec in sched.evicted:
            self.tp_runner.record(("clear", rec.slot))
        for rec in sched.new_adapters:
            live = self.engine.pool.resident(rec.key)
            if live is not None and live.slot == rec.slot:
                self.tp_runner.record(("write", rec.slot, list(rec.pages), str(rec.key)))
            else:  # failed to load: rank 0 cleared the slot
                self.tp_runner.record(("clear", rec.slot))

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
        self.engine.close()
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
                    self.engine.copier.wait(op[1])
            if msg.shape is not None and msg.flat is not None:
                self.tp_runner.forward(msg.flat, msg.shape)

    def apply_op(self, op: ArenaOp) -> None:
        kind, copier, store = op[0], self.engine.copier, self.engine.adapters
        if kind == "clear":
            copier.clear(op[1])
        elif kind == "write":
            _, slot, pages, digest = op
            host = store.get_digest(digest)
            if host.layout.num_pages != len(pages):
                raise RuntimeError(f"adapter {digest!r} takes {host.layout.num_pages} pages on "
                                   f"rank {self.group.rank}, {len(pages)} on rank 0")
            copier.write(slot, pages, host)
        elif kind == "register":
            store.register(op[1], op[2], op[3])
        elif kind == "add":
            store.add_loaded(op[1], op[2])
        elif kind == "unregister":
            store.unregister(op[1])
        elif kind == "forget":
            store.forget(op[1])
        else:
            raise ValueError(f"unknown arena op {kind!r}")
