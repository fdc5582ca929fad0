"""The engine: requests in, one batched step at a time, streaming deltas out.

    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(...))
    engine.register_adapter("support", "/adapters/support")
    engine.add_request("r1", "Hello", SamplingParams(temperature=0), adapter="support")
    while engine.has_unfinished():
        for out in engine.step(): ...

The parts, each in a module of its own: request intake and validation (`intake`), the adapters'
registration and tiers (`adapter_tiers`), the step loop (`step_loop`); the scheduler books each
step. A tensor-parallel engine (`slora_core.tp.engine.TPEngine`) wraps one of these;
`slora_core.launch.start_engine` picks which to build.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slora_core.adapter_cache import AdapterStore, UnknownAdapterError
from slora_core.adapter_tiers import AdapterTiers, ArenaListener
from slora_core.adapters import LoraAdapter
from slora_core.config import LORA_MODULES, ConfigError, EngineConfig, ModelConfig
from slora_core.intake import QueueFullError, RequestError, Requests
from slora_core.model import LlamaForCausalLM
from slora_core.model_runner import ModelRunner
from slora_core.outputs import RequestOutput
from slora_core.page_pool import PagePool
from slora_core.precompile import precompile_graphs
from slora_core.prompt_logprobs import PromptLogprob
from slora_core.sampler import Sampler
from slora_core.sampling_params import SamplingParams
from slora_core.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from slora_core.stats import EngineSnapshot, EngineStats
from slora_core.step_loop import StepLoop
from slora_core.structured.requests import grammars_for
from slora_core.structured.spec import StructuredOutput
from slora_core.tokenizer import Tokenizer
from slora_core.weights import load_model

if TYPE_CHECKING:
    from slora_core.cuda_graphs import DecodeGraphs, GraphKey, MixedGraphs


class LLMEngine:
    def __init__(
        self, model: LlamaForCausalLM, model_config: ModelConfig, tokenizer: Tokenizer | None,
        config: EngineConfig, *, detokenize: bool = True, runner: ModelRunner | None = None,
        adapter_store: AdapterStore | None = None, listener: ArenaListener | None = None,
    ) -> None:
        """`detokenize=False`: outputs carry token ids only, and stop strings are refused; an
        engine core whose front process detokenizes and matches stop strings runs so.
        `runner`, `adapter_store` and `listener` are a tensor-parallel rank's own (TPEngine)."""
        if config.tensor_parallel_size > 1 and runner is None:
            raise ConfigError("tensor_parallel_size > 1: build the engine with "
                              "slora_core.launch.start_engine, which starts the other ranks")
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = config.resolve_max_model_len(model_config)  # checks the model too
        # Resolved, so that readers of engine.config see the limit in force, never None.
        self.config = config = replace(config, max_model_len=self.max_model_len)
        block_size = config.resolve_block_size(model_config)
        self.runner = runner or ModelRunner.build(model, model_config, config, block_size,
                                                  self.max_model_len)
        self.arena = self.runner.arena
        self.pool = PagePool(config.num_pages, num_slots=config.num_pages)
        tok_eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        self.eos_token_ids = tok_eos or model_config.eos_token_ids
        self.stats = EngineStats()
        self.scheduler = Scheduler(
            SchedulerLimits(block_size, config.max_num_seqs, config.max_num_batched_tokens,
                            config.adapter_cap, max_model_len=config.max_model_len,
                            prefix_caching=config.prefix_caching),
            self.pool, self.eos_token_ids, self.stats,
        )
        self.adapters = adapter_store or AdapterStore(
            model_config, max_rank=config.max_rank, dtype=config.torch_dtype,
            page_numel=self.arena.page_numel, capacity_bytes=config.host_cache_bytes,
            pin_memory=self.arena.pages.device.type == "cuda",
        )
        self.tiers = AdapterTiers(self.adapters, self.pool, self.arena, self.stats, listener,
                                  in_use=self._in_use)
        self.copier = self.tiers.copier
        self.sampler = Sampler()
        self.requests = Requests(model_config, config, tokenizer,
                                 detokenize and tokenizer is not None, self.scheduler)
        self.detokenize = self.requests.detokenize
        # Graphs warmup(background=True) queued, in capture order (capture_next_graph).
        self._graph_queue: list[tuple[DecodeGraphs | MixedGraphs, GraphKey]] = []
        self.loop = StepLoop(self.scheduler, self.runner, self.sampler, self.requests,
                             self.tiers, self.eos_token_ids, config.steps_async,
                             config.admission_lead_ms)
        self.loop.grammars = grammars_for(tokenizer, model_config.vocab_size, self.eos_token_ids,
                                          config.grammar_compile_timeout_s,
                                          self.arena.pages.device.type == "cuda")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig, *,
                       detokenize: bool = True) -> LLMEngine:
        """A single-device engine over a Hugging Face directory (tensor parallelism:
        slora_core.launch.start_engine)."""
        model_config = ModelConfig.from_hf_dir(model_dir)
        model = load_model(model_dir, config.torch_dtype, config.device)
        return cls(model, model_config, Tokenizer.from_dir(model_dir), config,
                   detokenize=detokenize)

    def warmup(self, lora: bool | None = None, *, background: bool = False) -> None:
        """Capture the CUDA graphs of every decode batch bucket and every mixed-step token
        bucket (CUDA only; a no-op on CPU): the base-model graphs, and with `lora` (by default:
        when adapters are registered) the LoRA graphs for the modules the registered adapters
        target (all modules when none is parsed yet). A later adapter that targets other
        modules gets its graphs on first use. With `background` nothing is captured now: the
        graphs are queued, steps whose graph is queued run eagerly, and `capture_next_graph`
        captures them one at a time (between steps: a server's loop does so while serving)."""
        if self.runner.graphs is None:
            return
        sets: list[frozenset[int]] = [frozenset()]
        if lora if lora is not None else bool(self.adapters.names()):
            sets.append(self.adapters.target_module_ids()
                        or frozenset(range(len(LORA_MODULES))))
        for modules in sets:
            for graphs in (self.runner.graphs, self.runner.mixed):
                if graphs is not None:
                    self._graph_queue += [(graphs, key) for key in graphs.defer(modules)]
        if not background:
            self.precompile_queued()
            while self.capture_next_graph():
                pass

    def precompile_queued(self) -> float:
        """Compile the Triton kernels the queued graphs launch, side by side (seconds)."""
        return precompile_graphs(self._graph_queue)

    def graphs_pending(self) -> int:
        """CUDA graphs queued by warmup(background=True) and not captured yet."""
        return len(self._graph_queue)

    def capture_next_graph(self) -> tuple[str, int] | None:
        """Capture the next graph queued by warmup(background=True) now (call it between
        steps); its graph set (`label`) and bucket, or None when none is queued."""
        if not self._graph_queue:
            return None
        graphs, key = self._graph_queue[0]
        graphs.capture_deferred(key)
        self._graph_queue.pop(0)
        return graphs.label(key), key[0]

    # ---- adapters --------------------------------------------------------------------------
    def register_adapter(self, name: str, path: str | Path, sha256: str | None = None,
                         *, preload: bool = True) -> str:
        """Name the adapter in `path`; returns its content digest (`sha256`, checked against
        the files when they are read, or computed from them now). The adapter is known by
        that digest: registering a name again with other content serves the new content to
        new requests while requests already queued finish on the old. With `preload`, parse
        and validate it now (raising an AdapterError that names the problem, a digest
        mismatch among them, and keeping nothing) and keep it in host memory."""
        return self.tiers.register(name, path, sha256, preload)

    def add_adapter(self, name: str, adapter: LoraAdapter) -> str:
        """Register an adapter already parsed or built in memory (kept in host memory), known
        by its `sha256`."""
        return self.tiers.add(name, adapter)

    def register_adapter_tensors(self, name: str, state_dict: Mapping[str, torch.Tensor],
                                 config: Mapping[str, Any] | Any,
                                 sha256: str | None = None) -> str:
        """Register a PEFT LoRA state dict (`get_peft_model_state_dict`) and its config (a dict
        or peft LoraConfig) without a disk, e.g. a training loop's new weights every few
        steps; validated as a directory would be. Returns the content digest, the one
        `save_pretrained` files of the same tensors and config (sorted keys) would have."""
        return self.add_adapter(name, self.tiers.parse_tensors(name, state_dict, config, sha256))

    def load_adapter(self, name: str) -> None:
        """Parse and validate a registered adapter into host memory (or touch it in the host
        LRU). Thread-safe against steps: the host tier has its own lock, so a caller may run
        this beside the step loop. Raises an AdapterError naming the problem."""
        self.adapters.get(name)

    def unregister_adapter(self, name: str) -> None:
        """Forget an adapter's name, and its content's host copy and idle arena pages unless
        another name serves it; requests already using it finish on it."""
        self.tiers.unregister(name)

    def _in_use(self, digest: str) -> bool:
        return any(r.seq.adapter == digest for r in self.requests.live.values())

    def warm_adapters(self) -> list[str]:
        """Registered adapters held in host memory or in arena pages."""
        return self.tiers.warm()

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        adapter: str | None = None, tenant: str = "", deadline_s: float | None = None,
        structured: StructuredOutput | None = None,
    ) -> None:
        """Queue a request. `tenant`: waiting requests are admitted fairly across tenants (the
        one with the fewest running goes first). `deadline_s`: if it has not been scheduled
        within that many seconds it is dropped unrun (finish_reason "abort", error "deadline
        exceeded"); once scheduled it runs to the end, preempted or not. `structured`: the
        output follows that grammar; the request waits unscheduled while it compiles (off the
        step loop), and ends with an error (error_kind GRAMMAR_ERROR) if it is refused or too
        slow to compile. Raises
        RequestError, UnknownAdapterError, an AdapterError, or QueueFullError; a refused request
        leaves the engine unchanged."""
        ids = self.requests.tokenize(prompt)
        self.requests.check(request_id, ids, params)
        grammars = self.loop.grammars
        if structured is not None and grammars is None:
            raise RequestError("structured output needs an engine with a tokenizer")
        if structured is not None and params.min_new_tokens:
            # Its end-of-sequence mask could leave a complete grammar no token at all.
            raise RequestError("min_new_tokens cannot be combined with structured output: "
                               "the grammar decides where the output ends")
        # The content the name serves now is what this request runs on, to its end.
        digest, host, pages = self.tiers.resolve(adapter) if adapter else (None, None, 0)
        # An adapter in no tier yet: the request waits (adapter_ready False) while a thread
        # reads it, and its pages are checked then (StepLoop._finish_reads).
        ready = digest is None or host is not None
        seq = self.requests.add(request_id, ids, params, adapter=digest,
                                adapter_name=adapter or None, adapter_pages=pages,
                                adapter_ready=ready, tenant=tenant, deadline_s=deadline_s)
        if structured is not None and grammars is not None:
            seq.grammar_ready = False  # scheduled once its grammar compiled (StepLoop)
            grammars.submit(request_id, structured)
        if digest is not None and not ready:
            self.tiers.start_read(str(adapter), digest)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; None if it is unknown or already done."""
        req = self.requests.live.get(request_id)
        return None if req is None else self.requests.end(req, "abort")

    def request_ids(self) -> list[str]:
        """Requests queued or running."""
        return list(self.requests.live)

    def take_prompt_logprobs(self) -> dict[str, tuple[int, list[PromptLogprob]]]:
        """Prompt logprobs scored since the last call (requests with `prompt_logprobs`), by
        request id: (the first prompt position scored, its logprobs)."""
        return self.runner.take_prompt_scores()

    def request_started(self, request_id: str) -> bool:
        """The request was scheduled at least once (it left the waiting queue)."""
        req = self.requests.live.get(request_id)
        return req is None or req.seq.first_scheduled is not None

    def has_unfinished(self) -> bool:
        return bool(self.requests.live) or self.loop.inflight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- steps and state -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; returns the outputs of requests that made progress
        (with `async_steps`, the previous step's: see slora_core.step_loop)."""
        return self.loop.step()

    def _apply_memory_changes(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """The arena changes a schedule made (tests and profilers step by hand)."""
        return self.loop.apply_memory_changes(sched)

    def state_snapshot(self) -> EngineSnapshot:
        """Load and memory figures a server reports (cheap enough to take every step)."""
        pool, sched, merge = self.pool, self.scheduler, self.runner.merge
        return EngineSnapshot(
            running=len(sched.running), waiting=len(sched.waiting),
            kv_pages=pool.num_kv_pages, adapter_pages=pool.num_adapter_pages,
            free_pages=pool.num_free, adapter_loads=self.stats.adapter_loads,
            adapter_evictions=self.stats.adapter_evictions, steps=self.stats.steps,
            running_adapters=sorted({s.adapter_name for s in sched.running if s.adapter_name}),
            waiting_adapters=sorted({s.adapter_name for s in sched.waiting if s.adapter_name}),
            adapter_merges=merge.merges if merge is not None else 0,
            merged_steps=merge.merged_steps if merge is not None else 0,
        )

    def keepalive(self) -> None:
        """Call when idle for a while (a tensor-parallel engine pings its other ranks); a
        single-device engine does nothing."""

    def close(self) -> None:
        """Release what the engine holds beyond its own memory: its disk-reading and
        grammar-compiling threads."""
        self.tiers.close()
        if self.loop.grammars is not None:
            self.loop.grammars.close()


__all__ = ["ConfigError", "EngineSnapshot", "EngineStats", "LLMEngine", "QueueFullError",
           "RequestError", "UnknownAdapterError"]
