"""The engine loop: requests in, one batched step at a time, streaming deltas out.

    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(...))
    engine.register_adapter("support", "/adapters/support")
    engine.add_request("r1", "Hello", SamplingParams(temperature=0), adapter="support")
    while engine.has_unfinished():
        for out in engine.step(): ...
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from slora_core import step_checks
from slora_core.adapter_cache import AdapterStore, HostAdapter, UnknownAdapterError
from slora_core.adapter_copies import AdapterCopier
from slora_core.adapters import AdapterError, LoraAdapter
from slora_core.config import LORA_MODULES, ConfigError, EngineConfig, ModelConfig
from slora_core.detokenizer import TextStream
from slora_core.model import LlamaForCausalLM
from slora_core.model_runner import ModelRunner
from slora_core.outputs import (
    ADAPTER_UNLOADABLE,
    DEADLINE,
    NONFINITE,
    RequestOutput,
    TokenLogprob,
    nonfinite_logits_error,
)
from slora_core.page_pool import PagePool
from slora_core.sampler import PendingSample, SampledToken, Sampler, make_generator
from slora_core.sampling_params import SamplingParams
from slora_core.scheduler import PLACEHOLDER, Scheduler, SchedulerLimits, SchedulerOutput
from slora_core.sequence import Sequence
from slora_core.tokenizer import Tokenizer
from slora_core.weights import load_model

# Threads reading adapters from disk for waiting requests; how long an idle step waits for one.
DISK_LOAD_THREADS = 2
IDLE_WAIT_S = 0.01


def _unloadable(name: str, error: object) -> str:
    return f"adapter {name!r} could not be loaded: {error}"


class RequestError(ValueError):
    """A request that can never be served as asked (too long, bad ids, duplicate id)."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its limit; retry later."""


class _NoText:
    """Decoder for engines without a tokenizer: every token decodes to no text."""

    def decode(self, ids: object, skip_special_tokens: bool = True) -> str:
        return ""


@dataclass
class _Request:
    seq: Sequence
    stream: TextStream
    generator: torch.Generator | None


@dataclass
class _Inflight:
    """A step whose sampled ids are still on their way to the host (asynchronous steps): row i
    of `pending` belongs to seqs[i], whose last output token is a placeholder until then."""

    seqs: list[Sequence]
    pending: PendingSample


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    adapter_loads: int = 0  # adapters copied into arena pages
    adapter_evictions: int = 0
    # Where each of adapter_loads came from: the host tier, or a disk read in that step.
    adapter_host_hits: int = 0
    adapter_disk_loads: int = 0
    # Adapters read from disk in the background for requests that found them in no tier (their
    # arena loads then count as host hits).
    adapter_background_reads: int = 0
    last_distinct_adapters: int = 0
    # The last step's tokens, and those of its chunks longer than one token (prompt chunks):
    # 0 for a decode-only step.
    last_tokens: int = 0
    last_prefill_tokens: int = 0


@dataclass
class EngineSnapshot:
    running: int
    waiting: int
    kv_pages: int
    adapter_pages: int
    free_pages: int
    adapter_loads: int
    adapter_evictions: int
    steps: int
    running_adapters: list[str]
    waiting_adapters: list[str]
    # EngineConfig.merge_sole_adapter: adapters folded into the base weights, steps run so.
    adapter_merges: int = 0
    merged_steps: int = 0


class LLMEngine:
    _is_tensor_parallel = False  # TPEngine (slora_core/tp) sets it

    def __init__(
        self, model: LlamaForCausalLM, model_config: ModelConfig, tokenizer: Tokenizer | None,
        config: EngineConfig, *, detokenize: bool = True,
    ) -> None:
        """`detokenize=False`: outputs carry token ids only, and stop strings are refused; an
        engine core whose front process detokenizes and matches stop strings runs so."""
        if config.tensor_parallel_size > 1 and not self._is_tensor_parallel:
            raise ConfigError("tensor_parallel_size > 1: build the engine with "
                              "LLMEngine.from_model_dir, which starts the other ranks")
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.detokenize = detokenize and tokenizer is not None
        self.max_model_len = config.resolve_max_model_len(model_config)  # checks the model too
        # Resolved, so that readers of engine.config see the limit in force, never None.
        self.config = config = replace(config, max_model_len=self.max_model_len)
        block_size = config.resolve_block_size(model_config)
        self.runner = ModelRunner.build(model, model_config, config, block_size,
                                        self.max_model_len)
        self.arena = self.runner.arena
        self.pool = PagePool(config.num_pages, num_slots=config.num_pages)
        tok_eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        self.eos_token_ids = tok_eos or model_config.eos_token_ids
        self.scheduler = Scheduler(
            SchedulerLimits(block_size, config.max_num_seqs, config.max_num_batched_tokens,
                            config.adapter_cap, max_model_len=config.max_model_len),
            self.pool, self.eos_token_ids,
        )
        self.adapters = AdapterStore(
            model_config, max_rank=config.max_rank, dtype=config.torch_dtype,
            page_numel=self.arena.page_numel, capacity_bytes=config.host_cache_bytes,
            pin_memory=self.arena.pages.device.type == "cuda",
        )
        self.sampler = Sampler()
        self._requests: dict[str, _Request] = {}
        self.stats = EngineStats()
        self.copier = AdapterCopier(self.arena)
        self._inflight: _Inflight | None = None  # async steps: the sampled batch not yet read
        # Adapters being read from disk for waiting requests, off the step loop (a read of a
        # 7B-shape adapter takes 0.1-1.2 s: on the loop it stalled every running request).
        self._loading: dict[str, Future[HostAdapter]] = {}
        self._loader: ThreadPoolExecutor | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig, *,
                       detokenize: bool = True) -> LLMEngine:
        if config.tensor_parallel_size > 1:
            from slora_core.tp.launch import start_tp_engine  # imports this module

            return start_tp_engine(model_dir, config, detokenize=detokenize)
        model_config = ModelConfig.from_hf_dir(model_dir)
        model = load_model(model_dir, config.torch_dtype, config.device)
        return cls(model, model_config, Tokenizer.from_dir(model_dir), config,
                   detokenize=detokenize)

    def warmup(self, lora: bool | None = None) -> None:
        """Capture the CUDA graphs of every decode batch bucket and every mixed-step token
        bucket (CUDA only; a no-op on CPU): the base-model graphs, and with `lora` (by default:
        when adapters are registered) the LoRA graphs for the modules the registered adapters
        target (all modules when none is parsed yet). A later adapter that targets other
        modules gets its graphs on first use."""
        if self.runner.graphs is None:
            return
        self._capture_graphs(self._graph_module_sets(lora))

    def _graph_module_sets(self, lora: bool | None) -> list[frozenset[int]]:
        """The LoRA module sets `warmup(lora)` captures graphs for (empty: base model)."""
        sets: list[frozenset[int]] = [frozenset()]
        if lora if lora is not None else bool(self.adapters.names()):
            sets.append(self.adapters.target_module_ids()
                        or frozenset(range(len(LORA_MODULES))))
        return sets

    def _capture_graphs(self, sets: list[frozenset[int]]) -> None:
        assert self.runner.graphs is not None
        for modules in sets:
            self.runner.graphs.capture_all(modules)
            if self.runner.mixed is not None:
                self.runner.mixed.capture_all(modules)

    # ---- adapters --------------------------------------------------------------------------
    def register_adapter(self, name: str, path: str | Path, sha256: str | None = None,
                         *, preload: bool = True) -> None:
        """Register an adapter by name. With `preload`, parse and validate it now (raising an
        AdapterError that names the problem) and keep it in host memory."""
        self.adapters.register(name, path, sha256)
        if preload:
            try:
                self.adapters.get(name)
            except AdapterError:
                self.adapters.unregister(name)
                raise

    def add_adapter(self, name: str, adapter: LoraAdapter) -> None:
        """Register an adapter already parsed or built in memory (kept in host memory)."""
        self.adapters.add_loaded(name, adapter)

    def load_adapter(self, name: str) -> None:
        """Parse and validate a registered adapter into host memory (or touch it in the host
        LRU). Thread-safe against steps: the host tier has its own lock, so a caller may run
        this beside the step loop. Raises an AdapterError naming the problem."""
        self.adapters.get(name)

    def unregister_adapter(self, name: str) -> None:
        """Forget an adapter's registration and host copy; requests already using it go on
        with the pages they hold."""
        self.adapters.unregister(name)

    def warm_adapters(self) -> list[str]:
        """Registered adapters held in host memory or in arena pages."""
        return [n for n in self.adapters.names()
                if self.adapters.is_cached(n) or self.pool.is_resident(n)]

    def request_ids(self) -> list[str]:
        """Requests queued or running."""
        return list(self._requests)

    def state_snapshot(self) -> EngineSnapshot:
        """Load and memory figures a server reports (cheap enough to take every step)."""
        pool, sched, merge = self.pool, self.scheduler, self.runner.merge
        return EngineSnapshot(
            running=len(sched.running), waiting=len(sched.waiting),
            kv_pages=pool.num_kv_pages, adapter_pages=pool.num_adapter_pages,
            free_pages=pool.num_free, adapter_loads=self.stats.adapter_loads,
            adapter_evictions=self.stats.adapter_evictions, steps=self.stats.steps,
            running_adapters=sorted({str(s.adapter) for s in sched.running if s.adapter}),
            waiting_adapters=sorted({str(s.adapter) for s in sched.waiting if s.adapter}),
            adapter_merges=merge.merges if merge is not None else 0,
            merged_steps=merge.merged_steps if merge is not None else 0,
        )

    def close(self) -> None:
        """Release what the engine holds beyond its own memory: its disk-reading threads (a
        tensor-parallel engine also stops its other ranks)."""
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)

    def keepalive(self) -> None:
        """Call when idle for a while: a tensor-parallel engine sends its other ranks an empty
        message, so their pending receive completes before the collective timeout; a plain
        engine does nothing."""

    def request_started(self, request_id: str) -> bool:
        """The request was scheduled at least once (it left the waiting queue)."""
        req = self._requests.get(request_id)
        return req is None or req.seq.first_scheduled is not None

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        adapter: str | None = None, tenant: str = "", deadline_s: float | None = None,
    ) -> None:
        """Queue a request. `tenant`: waiting requests are admitted fairly across tenants (the
        one with the fewest running goes first). `deadline_s`: if it has not been scheduled
        within that many seconds it is dropped unrun (finish_reason "abort", error "deadline
        exceeded"); once scheduled it runs to the end, preempted or not. Raises
        RequestError, UnknownAdapterError, an AdapterError, or QueueFullError; a refused request
        leaves the engine unchanged."""
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer: send token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        self._check_prompt(ids, params)
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests waiting")
        pages, host = 0, None
        if adapter:
            if not self.adapters.is_registered(adapter):
                raise UnknownAdapterError(adapter)
            host = self.adapters.peek(adapter)
            pages = host.layout.num_pages if host is not None else 0
        # An adapter in no tier yet: the request waits (adapter_ready False) while a thread
        # reads it, and its pages are checked then (_finish_loads).
        self._check_fits(len(ids) + params.max_new_tokens, pages)
        if not self.detokenize and params.stop:
            raise RequestError("stop strings need a detokenizing engine; this one is not")
        now = time.monotonic()
        seq = Sequence(request_id, ids, params, adapter=adapter or None, adapter_pages=pages,
                       adapter_ready=not adapter or host is not None, tenant=tenant,
                       arrival=now, deadline=None if deadline_s is None else now + deadline_s)
        if not seq.adapter_ready:
            self._start_load(str(adapter))
        decoder = self.tokenizer if self.detokenize and self.tokenizer is not None else _NoText()
        stream = TextStream(decoder, ids, params.stop,
                            min_tokens=params.min_new_tokens)
        self._requests[request_id] = _Request(seq, stream, make_generator(params, self.config.device))
        self.scheduler.add(seq)

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        total = len(ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the context length max_model_len={self.max_model_len}"
            )

    def _check_fits(self, total_tokens: int, adapter_pages: int) -> None:
        need = self.scheduler.blocks_for(total_tokens) + adapter_pages
        if need > self.config.num_pages:
            raise RequestError(
                f"the request needs {need} arena pages at its longest, the arena has "
                f"{self.config.num_pages}"
            )

    def _start_load(self, name: str) -> None:
        if name in self._loading:
            return
        if self._loader is None:
            self._loader = ThreadPoolExecutor(DISK_LOAD_THREADS, thread_name_prefix="adapter-disk")
        self._loading[name] = self._loader.submit(self.adapters.get, name)

    def _finish_loads(self) -> list[RequestOutput]:
        """Requests whose adapter finished loading in the background become schedulable, or
        end with an error that says why (the file could not be parsed or validated, or the
        request does not fit the arena with it); the other requests go on."""
        outputs: list[RequestOutput] = []
        for name, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[name]
            waiting = [r for r in self._requests.values()
                       if r.seq.adapter == name and not r.seq.adapter_ready]
            try:
                host = future.result()
            except Exception as e:  # noqa: BLE001 - any failure ends the requests, with it
                outputs += [self._fail_waiting(r, _unloadable(name, e)) for r in waiting]
                continue
            self.stats.adapter_background_reads += 1
            pages = host.layout.num_pages
            for req in waiting:
                seq = req.seq
                need = self.scheduler.blocks_for(len(seq.prompt_token_ids)
                                                 + seq.params.max_new_tokens) + pages
                if need > self.config.num_pages:
                    outputs.append(self._fail_waiting(
                        req, f"the request needs {need} arena pages at its longest with its "
                             f"adapter, the arena has {self.config.num_pages}"))
                else:
                    seq.adapter_pages, seq.adapter_ready = pages, True
        return outputs

    def _fail_waiting(self, req: _Request, error: str) -> RequestOutput:
        self.scheduler.finish(req.seq)
        del self._requests[req.seq.request_id]
        out = self._final(req, "error")
        out.error, out.error_kind = error, ADAPTER_UNLOADABLE
        return out

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; None if it is unknown or already done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req.seq)
        return self._final(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self._inflight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; returns the outputs of requests that made progress.

        With `async_steps` the step is launched before the previous step's sampled ids are read
        (the GPU works on it meanwhile), and the outputs returned are the previous step's.
        Sequences that step sampled carry a placeholder last token: the scheduler counts it,
        and its id reaches this step's inputs on the device (TokenPatch). A sequence found
        finished when the ids arrive computed one token too many; it is dropped before
        sampling."""
        inflight, self._inflight = self._inflight, None
        loaded = self._finish_loads() if self._loading else []
        sched = self.scheduler.schedule()
        outputs = loaded + self._apply_memory_changes(sched)
        outputs += [self._expire(seq) for seq in sched.expired]
        if not sched.scheduled and inflight is None and self._loading and not outputs:
            # Nothing to run until a read lands: wait for one (briefly) instead of spinning.
            wait(list(self._loading.values()), timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        logits, sampling = None, []
        if sched.scheduled:
            self.stats.steps += 1
            self.stats.last_tokens = sched.num_tokens
            self.stats.tokens += self.stats.last_tokens
            self.stats.last_distinct_adapters = sched.distinct_adapters()
            self.stats.last_prefill_tokens = sum(
                s.num_new_tokens for s in sched.scheduled if s.num_new_tokens > 1)
            self._wait_for_copies(sched)
            if step_checks.ENABLED:  # after the waits: it reads the slots' table rows
                step_checks.check_scheduled(sched.scheduled, self.pool, self.arena)
            patch = None if inflight is None else self.runner.token_patch(
                sched.scheduled, inflight.seqs, inflight.pending.tokens)
            logits = self.runner.run(sched.scheduled, patch)
            sampling = [s.seq for s in sched.scheduled if s.samples]
        if inflight is not None:
            outputs += self._complete(inflight)
            logits, sampling = self._drop_finished(logits, sampling)
        if not self.config.steps_async:
            return outputs + self._sample(sched, logits, sampling)
        self._inflight = self._sample_async(sched, logits, sampling)
        return outputs

    def _sampler_args(self, logits: torch.Tensor, sampling: list[Sequence]) -> tuple[Any, ...]:
        reqs = [self._requests[s.request_id] for s in sampling]
        return (logits, [s.params for s in sampling], [r.generator for r in reqs],
                # Only the repetition penalty reads the history: skip the O(context) copy.
                [s.token_ids() if s.params.repetition_penalty != 1.0 else () for s in sampling],
                [len(s.output_token_ids) for s in sampling], self.eos_token_ids)

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor | None,
                sampling: list[Sequence]) -> list[RequestOutput]:
        """Sample the step's tokens, let the scheduler book the step, stream the tokens."""
        tokens = (self.sampler.sample(*self._sampler_args(logits, sampling))
                  if logits is not None and sampling else [])
        ids = [t.token_id if t.finite else None for t in tokens]
        reasons = self.scheduler.postprocess(sched.scheduled, list(zip(sampling, ids, strict=True)))
        return [self._append_token(self._requests[seq.request_id], tok, reason)
                for seq, tok, reason in zip(sampling, tokens, reasons, strict=True)]

    def _sample_async(self, sched: SchedulerOutput, logits: torch.Tensor | None,
                      sampling: list[Sequence]) -> _Inflight | None:
        """Launch the step's sampling; the scheduler books the step with placeholder tokens."""
        pending = (self.sampler.sample_async(*self._sampler_args(logits, sampling))
                   if logits is not None and sampling else None)
        self.scheduler.postprocess(sched.scheduled, [(seq, PLACEHOLDER) for seq in sampling])
        return _Inflight(sampling, pending) if pending is not None else None

    def _drop_finished(self, logits: torch.Tensor | None, sampling: list[Sequence]
                       ) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Sequences finished after the step was launched (it computed one token too many for
        them) are not sampled."""
        keep = [i for i, s in enumerate(sampling) if self._is_live(s)]
        if len(keep) == len(sampling) or logits is None:
            return logits, sampling
        rows = torch.tensor(keep, dtype=torch.long, device=logits.device)
        return logits[rows], [sampling[i] for i in keep]

    def _is_live(self, seq: Sequence) -> bool:
        """The sequence's request is still being served (not finished, aborted or failed)."""
        req = self._requests.get(seq.request_id)
        return req is not None and req.seq is seq

    def _complete(self, inflight: _Inflight) -> list[RequestOutput]:
        """Read a launched step's sampled ids: fill the placeholders, stream, finish."""
        outputs = []
        for seq, tok in zip(inflight.seqs, inflight.pending.result(), strict=True):
            if not self._is_live(seq):
                continue  # aborted or failed while the step ran
            reason = self.scheduler.resolve(seq, tok.token_id if tok.finite else None)
            outputs.append(self._append_token(self._requests[seq.request_id], tok, reason))
        return outputs

    def _apply_memory_changes(self, sched: SchedulerOutput) -> list[RequestOutput]:
        self.stats.preemptions += len(sched.preempted)
        self.stats.adapter_evictions += len(sched.evicted)
        for rec in sched.evicted:
            self.copier.clear(rec.slot)
        failed: list[RequestOutput] = []
        for rec in sched.new_adapters:
            disk_reads = self.adapters.loads
            try:
                host = self.adapters.get(str(rec.key))
            except (AdapterError, UnknownAdapterError) as e:
                failed += self._fail_adapter(str(rec.key), sched, str(e))
                continue
            self.copier.write(rec.slot, rec.pages, host)
            self.stats.adapter_loads += 1
            if self.adapters.loads > disk_reads:
                self.stats.adapter_disk_loads += 1
            else:
                self.stats.adapter_host_hits += 1
        return failed

    def _wait_for_copies(self, sched: SchedulerOutput) -> None:
        """Make the compute stream wait for the adapter copies this step reads."""
        if not self.copier.has_pending:
            return
        for item in sched.scheduled:
            if item.adapter_slot >= 0:
                self.copier.wait(item.adapter_slot)

    def _expire(self, seq: Sequence) -> RequestOutput:
        req = self._requests.pop(seq.request_id)
        out = self._final(req, "abort")
        out.error = "deadline exceeded before the request was scheduled"
        out.error_kind = DEADLINE
        return out

    def _fail_adapter(self, name: str, sched: SchedulerOutput, error: str) -> list[RequestOutput]:
        """An adapter that can no longer be loaded fails its requests; the rest go on."""
        victims = [r for r in self._requests.values() if r.seq.adapter == name]
        sched.scheduled = [s for s in sched.scheduled if s.seq.adapter != name]
        outs = []
        for req in victims:
            self.scheduler.finish(req.seq)
            del self._requests[req.seq.request_id]
            out = self._final(req, "error")
            out.error = _unloadable(name, error)
            out.error_kind = ADAPTER_UNLOADABLE
            outs.append(out)
        if self.pool.is_resident(name):
            self.arena.clear_slot(self.pool.evict_adapter(name).slot)
        return outs

    def _append_token(self, req: _Request, tok: SampledToken, reason: str | None
                      ) -> RequestOutput:
        """Stream a token the scheduler has appended; `reason`: it finished the request. A
        stop string in the text finishes it too (as "stop", which wins over "length")."""
        if not tok.finite:
            return self._fail_nonfinite(req)
        seq = req.seq
        text = req.stream.append(tok.token_id)
        out = RequestOutput(
            request_id=seq.request_id, token_ids=[tok.token_id], text=text,
            logprobs=[TokenLogprob(tok.token_id, tok.logprob, tok.top_logprobs)],
            prompt_tokens=len(seq.prompt_token_ids), completion_tokens=len(seq.output_token_ids),
        )
        if req.stream.stopped:  # only ever set once min_new_tokens were produced
            if reason is None:
                self.scheduler.finish(seq)
            reason = "stop"
        if reason is not None:
            del self._requests[seq.request_id]
            out.text += req.stream.flush()
            out.finished, out.finish_reason = True, reason
        return out

    def _fail_nonfinite(self, req: _Request) -> RequestOutput:
        """Logits with a NaN or inf end the request with an error: the id sampled from them is
        the argmax of garbage, so no token is emitted. Other rows of the batch are untouched."""
        self.scheduler.finish(req.seq)
        del self._requests[req.seq.request_id]
        out = self._final(req, "error")
        out.error = nonfinite_logits_error(len(req.seq.output_token_ids))
        out.error_kind = NONFINITE
        return out

    def _final(self, req: _Request, reason: str) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=seq.request_id, text=req.stream.flush() if reason != "error" else "",
            finished=True, finish_reason=reason, prompt_tokens=len(seq.prompt_token_ids),
            completion_tokens=len(seq.output_token_ids),
        )


__all__ = ["ConfigError", "LLMEngine", "QueueFullError", "RequestError"]
