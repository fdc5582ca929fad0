"""How an engine core starts, phase by phase, and what it reports of it.

    core:   engine, profile, cache = start_timed(model_dir, config, cache_root, spawned_at,
                                                 graphs_in_background=True)
            graphs = BackgroundGraphs.of(engine, profile.stats)   # captured while serving
    front:  report = StartupReport(registry, process_start_time())
            report.ready(core_ready, server_since); report.update(startup_update)

The compiled-kernel cache lives in the worker's cache directory (`<cache-dir>/.compiled`, a
name no adapter id can take) unless `--compile-cache-dir` names another (an image can bake one
in: `slora worker --warm-cache-only`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry, Gauge

from services.worker import core_protocol as m
from slora_core.compile_cache import CompileCache, CompileStats, warmup_digest
from slora_core.config import EngineConfig, ModelConfig
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams
from slora_core.startup_profile import PhaseRecord, StartupProfile
from slora_core.tokenizer import Tokenizer
from slora_core.weights import load_model

if TYPE_CHECKING:
    from slora_core.launch import AnyEngine

log = logging.getLogger(__name__)
COMPILED_SUBDIR = ".compiled"
# The warm-up request: a short prompt (a prefill step) and two new tokens (a decode step).
WARMUP_PROMPT_TOKENS = 8
WARMUP_NEW_TOKENS = 2
WARMUP_REQUEST_ID = "slora-startup-warmup"


def compile_cache_root(cache_dir: Path, compile_cache_dir: Path | None = None) -> Path:
    """Where the compiled-kernel cache lives: `compile_cache_dir`, or inside `cache_dir`."""
    return compile_cache_dir if compile_cache_dir is not None else cache_dir / COMPILED_SUBDIR


def open_compile_cache(root: Path, config: EngineConfig
                       ) -> tuple[CompileCache | None, CompileStats]:
    """Open and activate the compile cache of this process's device under `root`, and start
    counting the kernels Triton compiles or finds (CompileStats). A root this process cannot
    write (a read-only image layer, a file in the way) is no reason not to serve: the worker
    warns and Triton keeps its default cache (None)."""
    stats = CompileStats()
    stats.install()
    try:
        cache = CompileCache.open(root, config.device)
        cache.activate()
    except OSError as e:
        log.warning("compile cache %s unusable (%s): Triton's default cache instead", root, e)
        return None, stats
    log.info("compile cache %s (%s): %s", cache.path, cache.key.device, cache.state)
    return cache, stats


def _sync(config: EngineConfig) -> None:
    if config.device.startswith("cuda"):
        torch.cuda.synchronize()


def build_engine(model_dir: Path, config: EngineConfig, profile: StartupProfile) -> AnyEngine:
    """The engine of `model_dir`, its start timed as `weights` and `arena`. A tensor-parallel
    engine starts its ranks, which load their shards together: one `weights` phase."""
    if config.tensor_parallel_size > 1:
        from slora_core.launch import start_engine

        with profile.phase("weights"):
            return start_engine(model_dir, config, detokenize=False)
    model_config = ModelConfig.from_hf_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    with profile.phase("weights"):
        model = load_model(model_dir, config.torch_dtype, config.device)
        _sync(config)
    with profile.phase("arena"):
        engine = LLMEngine(model, model_config, tokenizer, config, detokenize=False)
        _sync(config)
    return engine


def start_timed(model_dir: Path, config: EngineConfig, compile_cache_dir: Path | None,
                spawned_at: float = 0.0, graphs_in_background: bool = False
                ) -> tuple[AnyEngine, StartupProfile, CompileCache | None]:
    """Build and warm up the engine, timing each phase (`spawned_at`: when the process was
    asked for, for `core_spawn`; `graphs_in_background`: see warm_up). With a compile cache
    root, Triton reads and writes its binaries in this device's folder there, and the manifest
    records what this start compiled and found."""
    profile = StartupProfile()
    if spawned_at:
        profile.add("core_spawn", max(0.0, time.time() - spawned_at))
    cache = None
    if compile_cache_dir is not None:
        cache, profile.stats = open_compile_cache(compile_cache_dir, config)
    engine = build_engine(model_dir, config, profile)
    model_config = ModelConfig.from_hf_dir(model_dir)
    warm_up(engine, profile, model_config.vocab_size, graphs_in_background, cache,
            warmup_digest(model_config, config))
    if cache is not None:
        compiled, hits, compile_s = profile.compile_totals()
        cache.record(compiled=compiled, cache_hits=hits, compile_s=round(compile_s, 3),
                     ready_s=round(profile.total_s(), 3))
    log.info("%s", profile.format())
    return engine, profile, cache


def warmup_request(engine: AnyEngine, vocab: int) -> float:
    """Serve one short request (prefill, then decode) to its end; seconds to its first token.
    `vocab`: the model's vocabulary size (the prompt's ids lie below it)."""
    prompt = [1 + i % max(1, vocab - 1) for i in range(WARMUP_PROMPT_TOKENS)]
    params = SamplingParams(temperature=0.0, max_new_tokens=WARMUP_NEW_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    first: float | None = None
    engine.add_request(WARMUP_REQUEST_ID, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"the start-up warm-up request failed: {out.error}")
            if first is None and out.token_ids:
                first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def warm_up(engine: AnyEngine, profile: StartupProfile, vocab: int,
            graphs_in_background: bool = False, cache: CompileCache | None = None,
            digest: str = "") -> None:
    """Make the engine ready to serve: the kernels its CUDA graphs launch compiled side by side
    (`precompile`), the graphs (CUDA only; base and LoRA, each bucket `max_num_seqs` and
    `max_num_batched_tokens` allow) captured one `graph_capture` record a graph, then a
    request served end to end (`warmup`: it compiles, or reads from the compile cache, the
    kernels its steps launch). With `graphs_in_background` the graphs are only
    queued (BackgroundGraphs captures them while the engine serves) and the warm-up request
    runs eagerly.

    `digest` (warmup_digest of the model's and the engine's configuration) names this
    warm-up in the compile `cache`: when an earlier start of the same digest captured every
    graph, the kernels are all on disk and the precompile is skipped (its dry forwards and
    threaded loads cost 6.6 s of a warm 7B start on the H200, worker-startup-h200.json, while
    the captures load the binaries themselves). Wrong only in speed: a kernel missing from
    the folder compiles in its capture."""
    if isinstance(engine, LLMEngine) and engine.runner.graphs is not None:
        engine.warmup(True, background=True)
        if not graphs_in_background:
            known = bool(digest) and cache is not None and cache.holds(digest)
            if not known:
                with profile.phase("precompile"):
                    engine.precompile_queued()
            graphs = BackgroundGraphs(engine, profile.stats)
            while graphs.pending:
                profile.records.append(graphs.capture_next(background=False))
            if digest and cache is not None and not graphs.failed and not known:
                cache.note_warmup(digest)
    with profile.phase("warmup"):
        warmup_request(engine, vocab)
        _sync(engine.config)


class BackgroundGraphs:
    """The engine's queued CUDA graphs (LLMEngine.warmup(background=True)), captured one at a
    time, each timed as a `graph_capture` record with the kernels it compiled."""

    def __init__(self, engine: LLMEngine, stats: CompileStats | None) -> None:
        self.engine = engine
        self.stats = stats
        self.failed = False  # a capture raised: the rest stay queued, their steps eager

    @classmethod
    def of(cls, engine: AnyEngine, stats: CompileStats | None) -> BackgroundGraphs | None:
        """The engine's queue, or None when it has none (CPU, tensor parallelism, or every
        graph captured before ready)."""
        if (isinstance(engine, LLMEngine) and engine.runner.graphs is not None
                and engine.graphs_pending()):
            return cls(engine, stats)
        return None

    @property
    def pending(self) -> int:
        """Graphs left to capture (0 once a capture failed: none is tried again)."""
        return 0 if self.failed else self.engine.graphs_pending()

    def capture_next(self, background: bool = True) -> PhaseRecord:
        """Capture the next queued graph now."""
        profile = StartupProfile(self.stats)
        with profile.phase("graph_capture", background=background) as label:
            captured = self.engine.capture_next_graph()
            _sync(self.engine.config)
            assert captured is not None, "no graph queued"
            label.graphs, label.bucket = captured
        return profile.records[-1]


def warm_cache_only(model_dir: Path, config: EngineConfig, compile_cache_dir: Path) -> int:
    """`slora worker --warm-cache-only`: start the engine as a worker would (every kernel the
    configuration launches compiled into the compile cache, every graph captured), then exit.
    Run it where the workers will run (same GPU model, driver and image): its folder is keyed
    by them."""
    engine, profile, cache = start_timed(model_dir, config, compile_cache_dir)
    engine.close()
    if cache is None:
        return 1  # the warning says why
    compiled, hits, _ = profile.compile_totals()
    log.info("compile cache %s filled: %d kernels compiled, %d found", cache.path, compiled, hits)
    return 0


class StartupMetrics:
    """The start-up profile as Prometheus gauges (seconds are those of the last start)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Gauge("slora_worker_startup_seconds",
                             "Seconds of each start-up phase of this worker (graph buckets "
                             "summed; `ready`: process start to serving)", ["phase"],
                             registry=registry)
        self.graph_seconds = Gauge("slora_worker_startup_graph_seconds",
                                   "Seconds to capture each CUDA-graph bucket at start-up",
                                   ["graphs", "bucket"], registry=registry)
        self.graphs_pending = Gauge("slora_worker_startup_graphs_pending",
                                    "CUDA graphs still to capture (captured between steps "
                                    "while serving; steps without theirs run eagerly)",
                                    registry=registry)
        self.kernels = Gauge("slora_worker_startup_kernels",
                             "Triton kernel binaries at start-up: compiled, or loaded from the "
                             "compiled-kernel cache", ["result"], registry=registry)
        self.compile_seconds = Gauge("slora_worker_startup_kernel_compile_seconds",
                                     "Seconds Triton spent compiling kernels at start-up",
                                     registry=registry)

    def publish(self, profile: StartupProfile, ready_s: float | None, graphs_pending: int
                ) -> None:
        for name, secs in profile.totals().items():
            self.seconds.labels(name).set(secs)
        if ready_s is not None:
            self.seconds.labels("ready").set(ready_s)
        per_graph: dict[tuple[str, str], float] = {}
        for r in profile.records:
            if r.name == "graph_capture" and r.bucket:
                key = (r.graphs, str(r.bucket))
                per_graph[key] = per_graph.get(key, 0.0) + r.seconds
        for (graphs, bucket), secs in per_graph.items():
            self.graph_seconds.labels(graphs, bucket).set(secs)
        self.graphs_pending.set(graphs_pending)
        compiled, hits, compile_s = profile.compile_totals()
        self.kernels.labels("compiled").set(compiled)
        self.kernels.labels("cache_hit").set(hits)
        self.compile_seconds.set(compile_s)


class StartupReport:
    """The front's view of its worker's start: its own phases around its core's, logged and
    exported (StartupMetrics), graphs captured after ready included as they come."""

    def __init__(self, registry: CollectorRegistry, started: float) -> None:
        self.metrics = StartupMetrics(registry)
        self.profile = StartupProfile()
        self.started = started  # time.time() of the process's creation
        self.ready_s: float | None = None
        self.graphs_pending = 0

    def phase_done(self, name: str, since: float) -> None:
        """A front phase that began at `since` (time.time()) ends now."""
        self.profile.add(name, time.time() - since)

    def ready(self, core_ready: m.Ready, server_since: float) -> None:
        """The worker serves now: log its profile and export it."""
        self.profile.records += core_ready.startup
        self.phase_done("server", server_since)
        self.ready_s = time.time() - self.started
        self.graphs_pending = core_ready.graphs_pending
        self.metrics.publish(self.profile, self.ready_s, self.graphs_pending)
        where = f"; compile cache {core_ready.compile_cache}" if core_ready.compile_cache else ""
        later = (f"; {self.graphs_pending} CUDA graphs to capture while serving"
                 if self.graphs_pending else "")
        log.info("ready %.2f s after the process started%s%s\n%s", self.ready_s, where, later,
                 self.profile.format())

    def update(self, upd: m.StartupUpdate) -> None:
        """Graphs the core captured while serving."""
        self.profile.records += upd.records
        self.graphs_pending = upd.graphs_pending
        self.metrics.publish(self.profile, self.ready_s, self.graphs_pending)
        if not upd.graphs_pending:
            done = [r for r in self.profile.records if r.background]
            log.info("every CUDA graph captured, %.2f s after the process started (%d graphs "
                     "in the background, %.2f s)", time.time() - self.started, len(done),
                     sum(r.seconds for r in done))
