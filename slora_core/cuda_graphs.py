"""CUDA graphs of engine steps: decode steps replay a graph captured per batch-size bucket,
steps that carry prefill tokens one captured per token-count bucket (`MixedGraphs`). A step's
metadata is copied into the graph's static buffers (two host-to-device copies), so a step costs
one launch; run eagerly, a Llama-2-7B step costs ~45 ms of host time (Python and kernel
launches) for 5-10 ms of GPU work at mixed-step sizes."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import numpy as np
import torch

from slora_core import step_checks
from slora_core.arena import PageArena
from slora_core.context import StepContext, step_context
from slora_core.graph_buffers import BufferLayout, GraphBuffers
from slora_core.lora_ride import SoleAdapterRide
from slora_core.model import LlamaForCausalLM
from slora_core.step_inputs import StepInputs, TokenPatch, apply_patch
from slora_kernels.lora_meta import (
    DECODE_BLOCK_M,
    PREFILL_BLOCK_M,
    ROW_BLOCK_M,
    LoraMeta,
    lora_tile_count,
    tile_rows,
)


class ModelRunner(Protocol):
    """What the graphs use of `slora_core.model_runner.ModelRunner`, which owns them (a Protocol,
    so this module does not import the runner back)."""

    model: LlamaForCausalLM
    arena: PageArena
    device: torch.device
    lora_row_kernels: bool
    lora_pdl: bool | None
    lora_fork_shrink: bool
    ride: SoleAdapterRide | None


# (bucket, LoRA module ids the graph runs, LoRA tile-list capacity; 0 without LoRA,
# ROW_GRAPH for a decode graph whose LoRA runs the row kernels and ride_tiles(rows) for one
# whose every row reads the sole adapter loaded in the ride's rows, `rows` a module:
# slora_core/lora_ride.py)
GraphKey = tuple[int, frozenset[int], int]
ROW_GRAPH = -1
RIDE_GRAPH = -2  # ride graphs' tiles are RIDE_GRAPH - rows: at most this


def ride_tiles(rows: int) -> int:
    """The tiles entry of a ride graph's key whose GEMMs read `rows` rows a module (a
    captured graph keeps its shapes: each row count has its own graphs)."""
    return RIDE_GRAPH - rows


def is_ride(tiles: int) -> bool:
    """Whether a key's tiles entry is a ride graph's (ride_tiles)."""
    return tiles <= RIDE_GRAPH


def ride_rows(tiles: int) -> int:
    """The row count a ride graph's tiles entry keys (the inverse of ride_tiles)."""
    return RIDE_GRAPH - tiles


# Decode buckets of at least this many rows also capture a middle tile list (decode_tile_caps).
MID_TILES_MIN_BUCKET = 64


def tile_steps_max_tiles(bucket: int, row_kernels_max_rows: int | None) -> int:
    """The most 16-row tiles a decode step of at most `bucket` rows can take to the tile
    kernels: one a row without the row kernels (None); with them, only steps of more than
    `row_kernels_max_rows` rows an adapter do, so S segments hold n > m * S rows, and their
    tiles, one plus one per further 16 rows of each segment, are at most S + (n - S) // 16."""
    if not row_kernels_max_rows:  # None (no row kernels) or 0 (they take no step)
        return bucket
    segments = (bucket - 1) // row_kernels_max_rows
    return max(-(-bucket // DECODE_BLOCK_M),
               min(bucket, segments + (bucket - segments) // DECODE_BLOCK_M))


def decode_tile_caps(bucket: int, row_kernels_max_rows: int | None) -> list[int]:
    """The tile-list capacities a decode bucket's LoRA graphs are captured with, largest first:
    the most tiles a step can take to the tile kernels (tile_steps_max_tiles:
    `row_kernels_max_rows` None without the row kernels); from MID_TILES_MIN_BUCKET rows on,
    four times the short list's; the short list, cdiv(bucket, 16) tiles (one adapter on every
    row). A step replays the shortest list its real tiles fit (decode_lora_graph): every entry
    past them is a program along each launch's tile axis that exits at once, and the list's
    length sets its K split (decode_split_tiles). At 64 rows, 16 adapters of 4 rows each (16
    real tiles) take 87.6 us a 7B layer on the 64-entry list and 85.4 on their own 16 (H100,
    lora-distinct-layer-expand-c337f04-h100.json: tiles vs tiles_unpadded)."""
    few = -(-bucket // DECODE_BLOCK_M)
    full = tile_steps_max_tiles(bucket, row_kernels_max_rows)
    caps = [full]
    if bucket >= MID_TILES_MIN_BUCKET and few < 4 * few < full:
        caps.append(4 * few)
    if few < full:
        caps.append(few)
    return caps


def decode_lora_graph(bucket: int, real: int, rows: int, segments: int,
                      row_kernels_max_rows: int | None, use_mid_tiles: bool = True) -> int:
    """The LoRA graph a decode step of `real` 16-row tiles, on `rows` rows in `segments`
    segments, replays (its key's tiles entry): the short tile list when the real tiles fit
    it, else the row kernels' (ROW_GRAPH) when its adapters own at most
    `row_kernels_max_rows` rows each, else the shortest tile list that holds them (without
    the middle one when not `use_mid_tiles`)."""
    caps = decode_tile_caps(bucket, row_kernels_max_rows)
    if real <= caps[-1]:
        return caps[-1]
    if row_kernels_max_rows is not None and rows <= row_kernels_max_rows * segments:
        return ROW_GRAPH
    fits = [cap for cap in caps[: len(caps) if use_mid_tiles else 1] if cap >= real]
    if not fits:  # tile_steps_max_tiles says no tile step has more
        raise RuntimeError(f"{real} tiles on {rows} rows in {segments} segments: more than "
                           f"the decode graphs' lists {caps}")
    return min(fits)


# Decode tile lists longer than this many tiles pick their K split for at least
# SPLIT_MIN_TILES tiles and for the longest list a tile step can need (decode_split_tiles).
SPLIT_OWN_MAX_TILES = 16
SPLIT_MIN_TILES = 64


def decode_split_tiles(bucket: int, length: int, row_kernels_max_rows: int | None) -> int:
    """The tile count a decode graph's list of `length` tiles picks its K split for
    (LoraMeta.split_tiles): its own up to SPLIT_OWN_MAX_TILES (the short lists, and the
    middle one at 64 rows, take `LoraTiles.wave_split`'s rule); past that at least the
    bucket's rows up to SPLIT_MIN_TILES and the longest list's (tile_steps_max_tiles): as a
    list of a tile a row split before the lists were shortened. A padded list's real tiles
    are fewer than its length, and their best split is one for more tiles than that: fewer
    splits, so each expand re-reads fewer partial sums. One 7B layer on an H100
    (lora-distinct-layer-split-2775b17-h100.json, tiles@L/S), 64 rows on the 33-tile list:
    20, 24, 28 adapters 94.1, 101.4, 115.0 us with the split for 64 tiles against 102.6,
    109.6, 124.0 with its own; 256 rows on the 64-tile list: 32 and 64 adapters 141.7 and
    216.0 with the split for 135 against 144.2 and 228.0."""
    if length <= SPLIT_OWN_MAX_TILES:
        return length
    return max(length, min(SPLIT_MIN_TILES, bucket),
               tile_steps_max_tiles(bucket, row_kernels_max_rows))


# The pipeline stages of the shrinks and expands on every decode graph's tile list
# (LoraMeta.tile_overrides; the 16-row tiles' own is 2, which mixed and eager steps keep; their
# 64-row tiles take PREFILL_STAGES). Not for shared memory: compiled as launched, a shrink
# program holds 40 KB at rank bound 64 (16 KB at 16) on one stage or two, and only the two-stage
# loop copies its x and A tiles asynchronously (cp.async); the expand compiles to the same code
# either way (kernel-compile-cost-9ee23b4-cpu.json). For registers: ptxas allocates the rank-16
# shrink 78 a thread on one stage and 175 on two (six 4-warp programs a multiprocessor against
# two), the rank-64 shrink 253 and 255 with 176 bytes spilled (two programs either way)
# (kernel-compile-cost-21de10f-cpu.json, Triton 3.9's ptxas on the CPU). One 7B decode
# layer's four GEMMs and LoRA on an H100, graph replay, in line
# (lora-distinct-layer-fork-smem{,-b256}-b4b1c89-h100.json): 16 adapters at 64 rows (the
# middle list) 251.6 -> 244.2 us; at 256 rows 32 adapters 346.4 -> 336.4 and 64 adapters
# 421.1 -> 408.7; forked beside the GEMMs 250.7 -> 244.2, 337.9 -> 336.0, 415.6 -> 407.5.
# Shrink K tiles of 128 instead gained less (248.7, 342.1, 419.0 in line), of 64 lost (255.4,
# 373.8, 436.8). In the engine (python -m bench issue37-stages, H100, 752466d):
# 16 distinct adapters 0.818x of base against 0.804x on two stages, 64 in a batch of 256 0.735x
# against 0.732x (distinct-adapters-stages{,-b256}-752466d-h100.json). The short (one-adapter)
# list gained as well in one layer at 64 rows (lora-distinct-layer-stages-short-752466d-h100.json:
# one r16 adapter 204.2 -> 200.3 us, one r64 218.9 -> 215.3, four adapters 213.4 -> 207.9) and
# at 256 rows (lora-distinct-layer-stages-short-b256-1732685-h100.json: 268.0 -> 256.4, 296.8 ->
# 288.1, 283.6 -> 274.4), so since 6638066 every list takes one stage. In the engine (python -m
# bench issue37-stages-short, H100, 002a98c) one rank-8 adapter on the LoRA kernels (the short
# list, no ride) kept 0.895x of base against 0.885x on two stages, every repeat ahead
# (distinct-adapters-stages-one-002a98c-h100.json).
GRAPH_TILE_STAGES = 1
# The tile lists past the short one (many adapters; the lists the fork takes) launch their
# expands with four 128-column tiles a program, loaded through the compiler's two-stage
# pipeline (LoraTiles.expand_cols): a program walks its tile entry's chain of dependent loads
# and sums the K splits once for 512 columns, instead of once for 256 in each of two to four
# waves of programs (at rank bound 64 a multiprocessor held three expands of 162 registers a
# thread; these take 114 and it holds four). One 7B decode layer on an H100,
# 64 rows, 16 adapters of ranks 8-64 on the middle list
# (lora-distinct-layer-regs-51483c3-h100.json): LoRA alone 82.4 -> 77.3 us, with the GEMMs and
# the shrinks forked 234.2 -> 228.9 (in line 237.9 -> 235.2); by hand into registers instead
# (216 registers, two programs) 114.6, two 256-column tiles 102.8 (255) lost, as did capping
# registers at 128 (115.7) and a shrink K tile of 128 (82.5; a cap of 168: 77.5 alone, 236.5
# forked). On the short list (4 adapters of 16 rows, in line) it lost: 44.6 -> 55.7 us alone
# (its 192 programs fit one wave), so that list keeps one tile a program. In the engine
# (python -m bench issue37-tiles-engine, H100, a1de8ba, 3 repeats:
# distinct-adapters-tiles-a1de8ba-h100.json) 16 distinct adapters keep 0.828x of base against
# 0.818x. At 256 rows on the middle list (lora-distinct-layer-regs-b256-a1de8ba-h100.json)
# 32 adapters 141.2 -> 130.2 us alone, 333.8 -> 321.8 with the GEMMs forked; 64 adapters
# 214.9 -> 186.0 and 404.7 -> 380.8. 16-bit models only.
MANY_TILE_OVERRIDES: tuple[tuple[str, int], ...] = (("expand_block_n", 128), ("expand_cols", 4))
# The tiles' pipeline stages before GRAPH_TILE_STAGES and PREFILL_STAGES (a benchmark's arms).
TWO_STAGES = 2


# Decode steps whose adapters own at most this many rows each on average run the row kernels
# (with lora_row_kernels): every row then reads its own adapter. Past it the 16-row tiles,
# which read an adapter once for all its rows, hold their own (H200, lora-grid-h200.json at
# c5e33ed, rows vs tiles: one row an adapter, r16 B64 12.6 vs 20.4 us, B256 28.4 vs 44.8;
# four rows an adapter, B64 U16 10.5 vs 11.6, B256 U64 22.6 vs 21.3).
ROW_KERNELS_MAX_ROWS_PER_ADAPTER = 2


class _StepGraphs:
    """What decode and mixed-step graphs share: one CUDA graph per (bucket, LoRA module set,
    LoRA tile capacity) captured into one memory pool, and replayed after `prepare` has copied the step's padded
    inputs into the static buffers (`buf`, laid out by `layout`: two host-to-device copies a
    step). `run_padded_eager` runs the same padded step without a graph (on any device: CPU
    tests check it against the unpadded step). Subclasses define `buckets`, the layout and
    buffers, `_context` and `prepare`."""

    buckets: list[int]
    layout: BufferLayout
    buf: GraphBuffers[torch.Tensor]
    kind = "graphs"  # the graph set's name in reports (label)

    # `pool`: a torch.cuda.graph_pool_handle() (a private torch type) or None off CUDA.
    def __init__(self, runner: ModelRunner, pool: Any) -> None:
        self.runner = runner
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.logits: dict[GraphKey, torch.Tensor] = {}
        self.contexts: dict[GraphKey, StepContext] = {}  # captured graphs read these
        self.pool = pool
        self.deferred: list[GraphKey] = []  # queued by defer, for capture_deferred

    def _context(self, bucket: int, modules: frozenset[int], tiles: int) -> StepContext:
        raise NotImplementedError

    def reset_buffers(self) -> None:
        """Put the static buffers in their inert state: no KV write (slot -1), no LoRA tile,
        every sequence and logits row inside the smallest bucket."""
        raise NotImplementedError

    def _tile_caps(self, bucket: int) -> list[int]:
        """The LoRA tile-list capacities captured for a bucket (the largest first)."""
        raise NotImplementedError

    def prepare(self, inputs: StepInputs, patch: TokenPatch | None = None) -> GraphKey:
        """Copy the step's padded inputs into the static buffers; the graph key to run."""
        raise NotImplementedError

    def _forward(self, bucket: int, ctx: StepContext) -> torch.Tensor:
        model = self.runner.model
        with step_context(ctx):
            hidden = model(self.buf.input_ids[:bucket], ctx.positions)
            return model.compute_logits(hidden[ctx.logits_indices])

    def missing(self, modules: frozenset[int]) -> list[GraphKey]:
        """The graphs of one LoRA module set not captured yet, largest bucket first (smaller
        ones reuse its memory pool). An empty set: the base-model (no LoRA) graphs."""
        return [(bucket, modules, tiles) for bucket in reversed(self.buckets)
                for tiles in (self._tile_caps(bucket) if modules else [0])
                if (bucket, modules, tiles) not in self.graphs]

    def defer(self, modules: frozenset[int]) -> list[GraphKey]:
        """Queue the graphs of one LoRA module set not captured yet (an empty set: the
        base-model graphs), largest bucket first, for `capture_deferred` to take one at a time
        (all at start-up: LLMEngine.warmup; between steps when serving); meanwhile a step whose
        graph is queued runs the padded step eagerly (the inputs the replay would read, as
        `run_padded_eager`) instead of capturing it on the spot. Returns the keys queued."""
        keys = [k for k in self.missing(modules) if k not in self.deferred]
        self.deferred += keys
        return keys

    def capture_deferred(self, key: GraphKey) -> None:
        """Capture a queued graph now (between steps) and take it off the queue."""
        if key not in self.graphs:
            with torch.inference_mode():
                # The warm-up forwards before the capture really run, on whatever the buffers
                # hold. After steps have run (warmup() called on a serving engine, as bench.churn
                # and the worker do to add LoRA graphs), that is the last step's inputs: query
                # starts, logits rows and LoRA tiles up to its token count, past a smaller
                # bucket's rows, and KV slots of pages reused since. Issue 15's illegal memory
                # access.
                self.reset_buffers()
                self._capture(*key)
        self.deferred.remove(key)  # after the capture: should it fail, its steps stay eager

    def take_ride(self) -> dict[GraphKey, tuple[Any, torch.Tensor, StepContext]]:
        """Remove the captured ride graphs (every row count's) with their logits and
        contexts, and return them for `put` to restore: a benchmark switching the launches
        those graphs hold (SoleAdapterRide.fused_consumers) keeps each variant's."""
        return self._take(is_ride)

    def take_tile_graphs(self) -> dict[GraphKey, tuple[Any, torch.Tensor, StepContext]]:
        """`take_ride` for the LoRA graphs on tile lists (DecodeGraphs.own_split)."""
        return self._take(lambda tiles: tiles > 0)

    def take_lora_graphs(self) -> dict[GraphKey, tuple[Any, torch.Tensor, StepContext]]:
        """`take_ride` for every LoRA graph but the ride's (DecodeGraphs.fork_shrink)."""
        return self._take(lambda tiles: tiles > 0 or tiles == ROW_GRAPH)

    def _take(self, which: Callable[[int], bool],
              ) -> dict[GraphKey, tuple[Any, torch.Tensor, StepContext]]:
        keys = [k for k in self.graphs if k[1] and which(k[2])]
        return {k: (self.graphs.pop(k), self.logits.pop(k), self.contexts.pop(k)) for k in keys}

    def put(self, taken: dict[GraphKey, tuple[Any, torch.Tensor, StepContext]]) -> None:
        """Restore graphs `take` removed."""
        for k, (graph, logits, ctx) in taken.items():
            self.graphs[k], self.logits[k], self.contexts[k] = graph, logits, ctx

    def dry_forward(self, key: GraphKey) -> None:
        """Run a graph's forward once from inert buffers without capturing it (for
        slora_core.precompile, which records and skips the kernels not compiled yet)."""
        with torch.inference_mode(), self._ride_rows(key[2]):
            self.reset_buffers()
            self._forward(key[0], self._context(*key))

    def _ride_rows(self, tiles: int) -> AbstractContextManager[None]:
        """For a ride graph's key: its row count in the ride's projections while the graph is
        captured or dry-run (it may not be the loaded adapter's); otherwise nothing."""
        ride = self.runner.ride
        if ride is None or not is_ride(tiles):
            return nullcontext()
        return ride.using_rows(ride_rows(tiles))

    def label(self, key: GraphKey) -> str:
        """The graph set a key belongs to, for reports: "decode" or "mixed", "+lora" with the
        LoRA tile list ("rows" for the row kernels', else its capacity)."""
        if not key[1]:
            return self.kind
        tiles = (f"ride{ride_rows(key[2])}" if is_ride(key[2])
                 else "rows" if key[2] == ROW_GRAPH else key[2])
        return f"{self.kind}+lora:{tiles}"

    def _capture(self, bucket: int, modules: frozenset[int], tiles: int) -> None:
        key = (bucket, modules, tiles)
        ctx = self.contexts[key] = self._context(bucket, modules, tiles)
        if step_checks.ENABLED:
            step_checks.check_context(ctx, bucket, self.runner.arena, f"capture of {key[:1]}")
        graph = torch.cuda.CUDAGraph()
        with self._ride_rows(tiles):
            for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                self._forward(bucket, ctx)
            torch.cuda.synchronize()
            # "thread_local": only this thread's capture-unsafe CUDA calls break the capture.
            # In "global" mode (torch's default) any thread's do: the engine core loads
            # adapters on a thread pool beside the steps, and pin_memory (cudaHostAlloc,
            # cudaEventQuery) there would invalidate a graph captured mid-serving. That thread
            # launches nothing on the capture stream, so nothing of it belongs in the graph.
            with _gc_paused(), torch.cuda.graph(graph, pool=self.pool,
                                                 capture_error_mode="thread_local"):
                self.logits[key] = self._forward(bucket, ctx)
        self.graphs[key] = graph

    def run(self, inputs: StepInputs, patch: TokenPatch | None = None) -> torch.Tensor:
        key = self.prepare(inputs, patch)
        if key not in self.graphs:
            if key in self.deferred:  # captured between steps later: run it eagerly now
                return self._forward(key[0], self._context(*key))[: inputs.logits_indices.size]
            # A bucket or module set not captured at start-up: capture it now. Its warm-up runs
            # read this step's inputs (already in the buffers), so the KV rows they write are
            # the ones the replay writes; stale inputs could overwrite pages reused since.
            self._capture(*key)
        if step_checks.ENABLED:
            step_checks.check_context(self.contexts[key], key[0], self.runner.arena,
                                      f"replay of {type(self).__name__} {key[0]}")
        self.graphs[key].replay()
        return self.logits[key][: inputs.logits_indices.size]

    def run_padded_eager(self, inputs: StepInputs) -> torch.Tensor:
        """The padded step a graph replays, run without a graph."""
        key = self.prepare(inputs)
        return self._forward(key[0], self._context(*key))[: inputs.logits_indices.size]

    def _key(self, bucket: int, inputs: StepInputs, tiles: int) -> GraphKey:
        if not inputs.has_lora:
            return (bucket, frozenset(), 0)
        return (bucket, self.runner.arena.active_lora_modules, tiles)

    def _upload(self, host: GraphBuffers[np.ndarray], patch: TokenPatch | None) -> None:
        for static, flat in ((self.buf.i64, host.i64), (self.buf.i32, host.i32)):
            src = torch.from_numpy(flat)
            if static.is_cuda:
                src = src.pin_memory()
            static.copy_(src, non_blocking=static.is_cuda)
        apply_patch(self.buf.input_ids, patch)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No automatic Python garbage collection inside the block. A collection during a capture
    can free CUDA graphs held by dead reference cycles (an engine dropped by its owner), and
    their destructor's cudaGraphExecDestroy is illegal while this thread captures: the capture
    is invalidated and the next launch fails with cudaErrorStreamCaptureInvalidated (H200,
    gpu_numerics bf16 asynchronous steps, a bucket first met mid-serving; pytorch#161037).
    torch.cuda.graph no longer collects before a capture (only under
    torch.compiler.config.force_cudagraph_gc), and a pause costs nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _fill(dst: np.ndarray, values: np.ndarray, pad: int) -> None:
    """`values` at the front of `dst`, `pad` after them."""
    dst[: values.size] = values
    dst[values.size :] = pad


def _fill_lora(inputs: StepInputs, block_m: int, host: GraphBuffers[np.ndarray]) -> None:
    """Write the step's LoRA segments and tile list into the front of the padded host arrays."""
    tile_segs, tile_m0 = inputs.lora_tiles(block_m)
    for dst, src in ((host.seg_starts, inputs.seg_starts), (host.seg_lens, inputs.seg_lens),
                     (host.seg_slots, inputs.seg_slots), (host.tile_segs, tile_segs),
                     (host.tile_m0, tile_m0)):
        dst[: src.size] = src


def _buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs(_StepGraphs):
    """CUDA graphs of the decode step (one token per sequence), one per batch-size bucket and
    LoRA module set (the module ids some resident adapter targets; empty for steps with no
    adapter token). LoRA runs over a tile list of up to one tile per row; base-model and
    padding rows point at the arena's spare table row, whose ranks are always 0.

    Each LoRA bucket b is captured with b tiles (with the row kernels, the most a step left to
    the tiles can take, about b / 2), with the cdiv(b, 16) tiles of one adapter on every
    row, whose K split is chosen for that few tiles, and from 64 rows on with four times
    those (decode_tile_caps). A step replays the shortest list its real tiles fit: one
    adapter on 256 rows runs 16 tiles split 11 ways instead of 256 tile slots split 3 ways
    (H200 kernel grid, lora-grid-h200.json: r16 B256 U1 15.8 -> 10.8 us a launch,
    `graph_capture_split` vs `exact`). With
    `lora_row_kernels` a third graph runs the row kernels, for steps whose adapters own few
    rows each (ROW_KERNELS_MAX_ROWS_PER_ADAPTER): every row reads its own adapter through its
    slot, base and padding rows the spare row's rank 0."""

    kind = "decode"

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> None:
        dev = runner.device
        super().__init__(runner, torch.cuda.graph_pool_handle() if dev.type == "cuda" else None)
        arena = runner.arena
        self.buckets = _buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // arena.block_size)
        self.empty_slot = arena.num_slots - 1
        # Steps whose adapters own at most this many rows each (on average) run the row
        # kernels' graph; an attribute so a benchmark can compare the two graphs on one step.
        self.row_kernels_max_rows = ROW_KERNELS_MAX_ROWS_PER_ADAPTER
        # Steps replay the middle tile list when theirs fits it (decode_tile_caps); off, they
        # take the longest list instead (a benchmark's side-by-side switch).
        self.use_mid_tiles = True
        # On, every tile list picks its K split for its own length (decode_split_tiles off):
        # a benchmark's switch, which swaps the graphs captured either way (take_tile_graphs).
        self.own_split = False
        # EngineConfig.lora_fork_shrink: the LoRA graphs on the middle and full tile lists
        # and the row kernels' graph run each projection's shrinks on a second stream beside
        # its base GEMM, the expands after both (StepContext.lora_side); a benchmark may
        # switch it, swapping the graphs captured either way (take_lora_graphs).
        self.fork_shrink = runner.lora_fork_shrink
        # Every tile list launches with GRAPH_TILE_STAGES pipeline stages
        # (LoraMeta.tile_overrides); off, with their tiles' two (a benchmark's switch, which
        # swaps the graphs captured either way: take_tile_graphs).
        self.one_stage = True
        # LoraTiles fields every tile list launches with instead of its tiles' (name, value;
        # LoraMeta.tile_overrides): a benchmark's switch, which swaps the graphs captured
        # either way (take_tile_graphs). Empty: the lists past the short one take
        # `many_tile_overrides`, the short one its tiles' own.
        self.tile_overrides: tuple[tuple[str, int], ...] = ()
        # The lists past the short one: MANY_TILE_OVERRIDES; () launches them as the short one
        # (a benchmark's switch too). Float32 models keep their own tiles (DECODE_TILES_F32,
        # sized for their compile times; not measured with these).
        self.many_tile_overrides = (MANY_TILE_OVERRIDES if runner.arena.pages.dtype
                                    != torch.float32 else ())
        self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        n = self.buckets[-1]
        # One row per sequence, token, segment and tile alike.
        self.layout = BufferLayout(tokens=n, seqs=n, segments=n, tiles=n,
                                   max_blocks=self.max_blocks)
        self.buf = self.layout.device(dev)
        self.reset_buffers()
        # Every row is one query token and samples: query starts and logits rows are 0..n.
        self.arange = torch.arange(n + 1, dtype=torch.int32, device=dev)

    def reset_buffers(self) -> None:
        # Captures run the model on these: write no KV (slot -1), read no adapter, one
        # context token (page 0) per row.
        buf = self.buf
        buf.i64.zero_()
        buf.i32.zero_()
        buf.slot_mapping.fill_(-1)
        buf.seq_lens.fill_(1)
        buf.token_slots.fill_(self.empty_slot)
        buf.tile_segs.fill_(-1)

    def can_run(self, inputs: StepInputs) -> bool:
        return (inputs.max_query_len == 1 and inputs.logits_indices.size == inputs.num_seqs
                and inputs.num_seqs <= self.buckets[-1]
                and inputs.block_tables.shape[1] <= self.max_blocks)

    def _row_kernels_max_rows(self) -> int | None:
        return self.row_kernels_max_rows if self.runner.lora_row_kernels else None

    def _tile_caps(self, bucket: int) -> list[int]:
        caps = decode_tile_caps(bucket, self._row_kernels_max_rows())
        if self.runner.lora_row_kernels:
            caps.append(ROW_GRAPH)
        if self.runner.ride is not None:
            caps += [ride_tiles(rows) for rows in self.runner.ride.row_counts]
        return caps

    def _lora_graph(self, bucket: int, inputs: StepInputs) -> int:
        """The LoRA graph a step replays (decode_lora_graph)."""
        return decode_lora_graph(bucket, lora_tile_count(inputs.seg_lens, DECODE_BLOCK_M),
                                 int(inputs.seg_lens.sum()), inputs.seg_lens.size,
                                 self._row_kernels_max_rows(), self.use_mid_tiles)

    def _context(self, bucket: int, modules: frozenset[int], tiles: int) -> StepContext:
        r, b, buf = self.runner, bucket, self.buf
        ride = is_ride(tiles)  # the ride's rows, no kernel: no segments or tiles read
        # Up to b segments and `tiles` tiles; prepare() fills them and marks unused tiles -1.
        # The row kernels read token_slots only; their meta keeps the full tile list's
        # buffers (filled, unread).
        cap = b if tiles == ROW_GRAPH else tiles
        short = -(-b // DECODE_BLOCK_M)  # the one-adapter list: past it, many adapters
        lora = LoraMeta(seg_starts=buf.seg_starts[:b], seg_lens=buf.seg_lens[:b],
                        seg_slots=buf.seg_slots[:b], token_slots=buf.token_slots[:b],
                        max_seg_len=DECODE_BLOCK_M, num_segments=b,
                        tile_segs=buf.tile_segs[:cap], tile_m0=buf.tile_m0[:cap],
                        num_tiles=cap, block_m=ROW_BLOCK_M if tiles == ROW_GRAPH
                        else DECODE_BLOCK_M,
                        split_tiles=None if tiles == ROW_GRAPH or self.own_split
                        else decode_split_tiles(b, cap, self._row_kernels_max_rows()),
                        tile_overrides=() if tiles == ROW_GRAPH else (
                            (("num_stages", GRAPH_TILE_STAGES),) if self.one_stage else ())
                        + (self.tile_overrides or (
                            self.many_tile_overrides if tiles > short else ())),
                        ) if modules and not ride else None
        return StepContext(
            positions=buf.positions[:b], slot_mapping=buf.slot_mapping[:b],
            block_tables=buf.block_tables[:b], seq_lens=buf.seq_lens[:b],
            query_starts=self.arange[: b + 1], max_query_len=1,
            max_seq_len=self.max_blocks * r.arena.block_size,
            logits_indices=self.arange[:b].long(), kv_caches=r.arena.kv_caches, lora=lora,
            lora_tables=r.arena.tables if lora is not None else None, lora_modules=modules,
            lora_pdl=r.lora_pdl, lora_ride=ride,
            lora_side=self.side if self.fork_shrink and lora is not None and (
                tiles == ROW_GRAPH or tiles > short) else None,
        )

    def _forward(self, bucket: int, ctx: StepContext) -> torch.Tensor:
        model = self.runner.model  # every row samples: no gather of the hidden states
        with step_context(ctx):
            return model.compute_logits(model(self.buf.input_ids[:bucket], ctx.positions))

    def prepare(self, inputs: StepInputs, patch: TokenPatch | None = None) -> GraphKey:
        n, nb = inputs.num_seqs, inputs.block_tables.shape[1]
        bucket = next(s for s in self.buckets if s >= n)
        ride = self.runner.ride
        tiles = (ride_tiles(ride.rows) if inputs.ride and ride is not None
                 else self._lora_graph(bucket, inputs) if inputs.has_lora else 0)
        key = self._key(bucket, inputs, tiles)
        host = self.layout.host()
        host.input_ids[:n] = inputs.input_ids
        host.positions[:n] = inputs.positions
        _fill(host.slot_mapping, inputs.slot_mapping, -1)
        _fill(host.seq_lens, inputs.seq_lens, 1)
        _fill(host.token_slots, np.where(inputs.token_slots >= 0, inputs.token_slots,
                                         self.empty_slot), self.empty_slot)
        host.tile_segs[:] = -1
        if key[1]:
            _fill_lora(inputs, DECODE_BLOCK_M, host)
        host.block_tables[:n, :nb] = inputs.block_tables
        self._upload(host, patch)
        return key


def _token_buckets(max_tokens: int) -> list[int]:
    sizes = [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    return [t for t in sizes if t < max_tokens] + [max_tokens]


class MixedGraphs(_StepGraphs):
    """Steps with prefill tokens (mixed prefill + decode, or prefill alone) as CUDA graphs, one
    per token-count bucket and LoRA module set.

    Inputs are padded to the bucket: padding tokens belong to no sequence (KV slot -1, so they
    write no KV; no attention tile and no LoRA tile covers them; their rows of the activations
    are garbage that nothing reads) and sequences are padded to `max_num_seqs` with zero
    queries. Attention runs the general (prefill) kernel and LoRA 16-row tiles (64-row ones in
    buckets over `slora_kernels.lora_meta.SHORT_TILES_MAX_TOKENS`), whose grids are sized for
    the bucket's worst case; unused programs exit at once."""

    kind = "mixed"

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, decode_graphs: DecodeGraphs | None = None) -> None:
        # One memory pool with the decode graphs: only one graph runs at a time.
        super().__init__(runner, decode_graphs.pool if decode_graphs is not None else None)
        self.buckets = _token_buckets(max_num_batched_tokens)
        self.t_max, self.b_max = self.buckets[-1], max_num_seqs
        self.max_blocks = -(-max_model_len // runner.arena.block_size)
        t, b = self.t_max, self.b_max
        # A segment is a run of one sequence or more: at most b.
        self.layout = BufferLayout(tokens=t, seqs=b, segments=b,
                                   tiles=max(self._tile_cap(s) for s in self.buckets),
                                   max_blocks=self.max_blocks, sampled=b, query_starts=b + 1)
        self.buf = self.layout.device(runner.device)
        self.reset_buffers()
        # 64-row tile lists launch with their tiles' stages (PREFILL_STAGES); off, with two, as
        # before it (a benchmark's switch, which swaps the graphs captured either way:
        # take_tile_graphs).
        self.own_stages = True
        # LoraTiles fields the 64-row tile lists launch with instead of PREFILL_TILES' (name,
        # value; LoraMeta.tile_overrides): a benchmark's switch, which swaps the graphs
        # captured either way (take_tile_graphs). The 16-row lists keep their tiles' own.
        self.tile_overrides: tuple[tuple[str, int], ...] = ()

    def reset_buffers(self) -> None:
        # Every sequence has no query (query_starts all 0) and logits rows are row 0: the
        # attention and LoRA programs exit at once, in any bucket.
        buf = self.buf
        buf.i64.zero_()
        buf.i32.zero_()
        buf.slot_mapping.fill_(-1)
        buf.token_slots.fill_(-1)
        buf.tile_segs.fill_(-1)

    def can_run(self, inputs: StepInputs) -> bool:
        return (inputs.input_ids.size <= self.t_max and inputs.num_seqs <= self.b_max
                and inputs.logits_indices.size <= self.b_max
                and inputs.block_tables.shape[1] <= self.max_blocks)

    @staticmethod
    def _tile_rows(bucket: int) -> int:
        """Rows of the bucket's LoRA tiles (`slora_kernels.lora_meta.tile_rows`, segments of up
        to the bucket's tokens)."""
        return tile_rows(bucket, bucket)

    def _tile_cap(self, bucket: int) -> int:
        """At most one partial tile per segment plus bucket / tile rows full ones."""
        return -(-bucket // self._tile_rows(bucket)) + min(self.b_max, bucket)

    def _tile_caps(self, bucket: int) -> list[int]:
        caps = [self._tile_cap(bucket)]
        ride = self.runner.ride
        return caps + [ride_tiles(rows) for rows in ride.row_counts] if ride is not None else caps

    def _context(self, bucket: int, modules: frozenset[int], tiles: int) -> StepContext:
        r, t, buf = self.runner, bucket, self.buf
        ride = is_ride(tiles)  # the ride's rows, no kernel: no segments or tiles read
        block_m = self._tile_rows(bucket)
        lora = (LoraMeta(seg_starts=buf.seg_starts, seg_lens=buf.seg_lens,
                        seg_slots=buf.seg_slots, token_slots=buf.token_slots[:t],
                        max_seg_len=t, num_segments=self.b_max,
                        tile_segs=buf.tile_segs[:tiles], tile_m0=buf.tile_m0[:tiles],
                        num_tiles=tiles, block_m=block_m,
                        tile_overrides=(() if self.own_stages else (("num_stages", TWO_STAGES),))
                        + (self.tile_overrides if block_m == PREFILL_BLOCK_M else ()))
                if modules and not ride else None)
        return StepContext(
            positions=buf.positions[:t], slot_mapping=buf.slot_mapping[:t],
            block_tables=buf.block_tables, seq_lens=buf.seq_lens,
            query_starts=buf.query_starts, max_query_len=t,
            max_seq_len=self.max_blocks * r.arena.block_size,
            logits_indices=buf.logits_indices, kv_caches=r.arena.kv_caches, lora=lora,
            lora_tables=r.arena.tables if lora is not None else None, lora_modules=modules,
            lora_pdl=r.lora_pdl, lora_ride=ride,
        )

    def prepare(self, inputs: StepInputs, patch: TokenPatch | None = None) -> GraphKey:
        n_tok, n_seq = int(inputs.input_ids.size), inputs.num_seqs
        bucket = next(s for s in self.buckets if s >= n_tok)
        ride = self.runner.ride
        key = self._key(bucket, inputs, ride_tiles(ride.rows) if inputs.ride and ride is not None
                        else self._tile_cap(bucket))
        host = self.layout.host()
        host.input_ids[:n_tok] = inputs.input_ids
        host.positions[:n_tok] = inputs.positions
        _fill(host.slot_mapping, inputs.slot_mapping, -1)
        host.logits_indices[: inputs.logits_indices.size] = inputs.logits_indices
        _fill(host.seq_lens, inputs.seq_lens, 1)
        _fill(host.query_starts, inputs.query_starts, n_tok)
        _fill(host.token_slots, inputs.token_slots, -1)
        host.tile_segs[:] = -1
        if key[1]:
            _fill_lora(inputs, self._tile_rows(bucket), host)
        nb = inputs.block_tables.shape[1]
        host.block_tables[:n_seq, :nb] = inputs.block_tables
        self._upload(host, patch)
        return key
