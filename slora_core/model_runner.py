"""Turns a scheduled step into tensors (one StepContext), runs the model, returns the logits of
the sequences that sample this step. The only engine part that touches the device.

On CUDA, decode-only steps replay a CUDA graph captured per batch-size bucket, and steps that
carry prefill tokens replay one captured per token-count bucket (`MixedGraphs`); the step's
metadata is copied into the graph's static buffers, so a step costs one launch. Run eagerly, a
Llama-2-7B step costs ~45 ms of host time (Python and kernel launches) for 5-10 ms of GPU work
at mixed-step sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels.lora_meta import (
    DECODE_BLOCK_M,
    PREFILL_BLOCK_M,
    LoraMeta,
    lora_segments,
    lora_tiles,
    tile_rows,
)
from slora_core.arena import PageArena
from slora_core.context import StepContext, step_context
from slora_core.model import LlamaForCausalLM
from slora_core.page_pool import PagePool
from slora_core.scheduler import ScheduledSeq
from slora_core.step_inputs import StepInputs, build_step_inputs, to_device


@dataclass(frozen=True)
class TokenPatch:
    """Input ids the host does not know yet: token `dst[i]` of the step is `src[rows[i]]`, an id
    the previous step sampled that is still on the device (asynchronous steps)."""

    dst: np.ndarray  # [n] int64 token indices within the step
    rows: np.ndarray  # [n] int64 rows of src
    src: torch.Tensor  # [B_prev] int64, on the device


def apply_patch(input_ids: torch.Tensor, patch: TokenPatch | None) -> None:
    """input_ids[dst] = src[rows], on the device (the indices travel pinned and non-blocking:
    a pageable copy would wait for the previous step's work)."""
    if patch is None or patch.dst.size == 0:
        return
    dst, rows = to_device([patch.dst, patch.rows], input_ids.device)
    input_ids[dst] = patch.src[rows]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, arena: PageArena, pool: PagePool, *,
                 max_num_seqs: int = 64, max_model_len: int = 2048,
                 max_num_batched_tokens: int = 512, use_cuda_graphs: bool = True,
                 mixed_graphs: bool = True, graph_lora_split_k: int | None = None) -> None:
        self.model = model
        self.arena = arena
        self.pool = pool
        self.graph_lora_split_k = graph_lora_split_k
        self.device = arena.pages.device
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None
        if use_cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)
            if mixed_graphs:
                self.mixed = MixedGraphs(self, max_num_seqs, max_num_batched_tokens,
                                         max_model_len, self.graphs)

    def build_context(self, inputs: StepInputs) -> tuple[torch.Tensor, StepContext]:
        has_lora = bool((inputs.token_slots >= 0).any())
        seg = lora_segments(inputs.token_slots) if has_lora else None
        arrays = [inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices,
                  inputs.seq_lens, inputs.query_starts, inputs.block_tables]
        block_m = tile_rows(int(seg[1].max())) if seg is not None else 0
        if seg is not None:
            arrays += [inputs.token_slots, *seg, *lora_tiles(seg[1], block_m)]
        dev = to_device(arrays, self.device)
        i32 = [t.to(torch.int32) for t in dev[4:]]
        lora = None
        if seg is not None:
            lora = LoraMeta(seg_starts=i32[4], seg_lens=i32[5], seg_slots=i32[6],
                            token_slots=i32[3], max_seg_len=int(seg[1].max()),
                            num_segments=int(seg[0].size), tile_segs=i32[7], tile_m0=i32[8],
                            num_tiles=int(i32[7].shape[0]), block_m=block_m)
        ctx = StepContext(
            positions=dev[1], slot_mapping=dev[2], block_tables=i32[2], seq_lens=i32[0],
            query_starts=i32[1], max_query_len=inputs.max_query_len,
            max_seq_len=int(inputs.seq_lens.max()), logits_indices=dev[3],
            kv_caches=self.arena.kv_caches, lora=lora,
            lora_tables=self.arena.tables if lora is not None else None,
            lora_modules=self.arena.active_lora_modules,
        )
        return dev[0], ctx

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], patch: TokenPatch | None = None
            ) -> torch.Tensor:
        """Forward the step; float32 logits [num_sampling_seqs, vocab] in scheduled order.
        `patch` supplies input ids still on the device (see TokenPatch)."""
        inputs = build_step_inputs(scheduled, self.pool, self.arena.block_size)
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs, patch)
        if self.mixed is not None and self.mixed.can_run(inputs):
            return self.mixed.run(inputs, patch)
        input_ids, ctx = self.build_context(inputs)
        apply_patch(input_ids, patch)
        with step_context(ctx):
            hidden = self.model(input_ids, ctx.positions)
            return self.model.compute_logits(hidden[ctx.logits_indices])


GraphKey = tuple[int, frozenset[int]]  # (bucket, LoRA module ids the graph runs)


class _StepGraphs:
    """What decode and mixed-step graphs share: one CUDA graph per (bucket, LoRA module set)
    captured into one memory pool, and replayed after `prepare` has copied the step's padded
    inputs into the static buffers (`i64`, `i32`: two host-to-device copies a step).
    `run_padded_eager` runs the same padded step without a graph (on any device: CPU tests
    check it against the unpadded step). Subclasses define `buckets`, the buffers, `_context`
    and `prepare`."""

    buckets: list[int]
    input_ids: torch.Tensor
    i64: torch.Tensor
    i32: torch.Tensor

    # `pool`: a torch.cuda.graph_pool_handle() (a private torch type) or None off CUDA.
    def __init__(self, runner: ModelRunner, pool: Any) -> None:
        self.runner = runner
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.logits: dict[GraphKey, torch.Tensor] = {}
        self.contexts: dict[GraphKey, StepContext] = {}  # captured graphs read these
        self.pool = pool

    def _context(self, bucket: int, modules: frozenset[int]) -> StepContext:
        raise NotImplementedError

    def prepare(self, inputs: StepInputs, patch: TokenPatch | None = None) -> GraphKey:
        """Copy the step's padded inputs into the static buffers; the graph key to run."""
        raise NotImplementedError

    def _forward(self, bucket: int, ctx: StepContext) -> torch.Tensor:
        model = self.runner.model
        with step_context(ctx):
            hidden = model(self.input_ids[:bucket], ctx.positions)
            return model.compute_logits(hidden[ctx.logits_indices])

    def capture_all(self, modules: frozenset[int]) -> None:
        """Capture every bucket for one LoRA module set now (start-up), so no request waits for
        a capture later. An empty set captures the base-model (no LoRA) graphs."""
        with torch.inference_mode():
            for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its pool
                if (bucket, modules) not in self.graphs:
                    self._capture(bucket, modules)

    def _capture(self, bucket: int, modules: frozenset[int]) -> None:
        key = (bucket, modules)
        ctx = self.contexts[key] = self._context(bucket, modules)
        for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
            self._forward(bucket, ctx)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[key] = self._forward(bucket, ctx)
        self.graphs[key] = graph

    def run(self, inputs: StepInputs, patch: TokenPatch | None = None) -> torch.Tensor:
        key = self.prepare(inputs, patch)
        if key not in self.graphs:
            # A bucket or module set not captured at start-up: capture it now. Its warm-up runs
            # read this step's inputs (already in the buffers), so the KV rows they write are
            # the ones the replay writes; stale inputs could overwrite pages reused since.
            self._capture(*key)
        self.graphs[key].replay()
        return self.logits[key][: inputs.logits_indices.size]

    def run_padded_eager(self, inputs: StepInputs) -> torch.Tensor:
        """The padded step a graph replays, run without a graph."""
        key = self.prepare(inputs)
        return self._forward(key[0], self._context(*key))[: inputs.logits_indices.size]

    def _key(self, bucket: int, inputs: StepInputs) -> GraphKey:
        has_lora = bool((inputs.token_slots >= 0).any())
        return (bucket, self.runner.arena.active_lora_modules if has_lora else frozenset())

    def _upload(self, i64: np.ndarray, i32: np.ndarray, patch: TokenPatch | None) -> None:
        for static, host in ((self.i64, i64), (self.i32, i32)):
            src = torch.from_numpy(host.reshape(-1))
            if static.is_cuda:
                src = src.pin_memory()
            static.copy_(src, non_blocking=static.is_cuda)
        apply_patch(self.input_ids, patch)


def _fill_lora(token_slots: np.ndarray, block_m: int, starts: np.ndarray, lens: np.ndarray,
               slots: np.ndarray, tile_segs: np.ndarray, tile_m0: np.ndarray) -> None:
    """Write the step's LoRA segments and tile list into the front of padded host arrays."""
    seg = lora_segments(token_slots)
    for dst, src in zip((starts, lens, slots, tile_segs, tile_m0),
                        (*seg, *lora_tiles(seg[1], block_m)), strict=True):
        dst[: src.size] = src


def _buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs(_StepGraphs):
    """CUDA graphs of the decode step (one token per sequence), one per batch-size bucket and
    LoRA module set (the module ids some resident adapter targets; empty for steps with no
    adapter token). LoRA runs over a tile list of up to one tile per row; base-model and
    padding rows point at the arena's spare table row, whose ranks are always 0."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> None:
        dev = runner.device
        super().__init__(runner, torch.cuda.graph_pool_handle() if dev.type == "cuda" else None)
        arena = runner.arena
        self.buckets = _buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // arena.block_size)
        self.empty_slot = arena.num_slots - 1
        n = self.n = self.buckets[-1]
        self.i64 = torch.zeros(3 * n, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self.i64.view(3, n)
        self.i32 = torch.zeros(7 * n + n * self.max_blocks, dtype=torch.int32, device=dev)
        rows = self.i32[: 7 * n].view(7, n)
        (self.seq_lens, self.token_slots, self.seg_starts, self.seg_lens, self.seg_slots,
         self.tile_segs, self.tile_m0) = rows
        self.block_tables = self.i32[7 * n :].view(n, self.max_blocks)
        # Start-up captures run the model on these: write no KV (slot -1), read no adapter.
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.token_slots.fill_(self.empty_slot)
        self.tile_segs.fill_(-1)
        self.arange = torch.arange(n + 1, dtype=torch.int32, device=dev)

    def can_run(self, inputs: StepInputs) -> bool:
        return (inputs.max_query_len == 1 and inputs.logits_indices.size == inputs.num_seqs
                and inputs.num_seqs <= self.buckets[-1]
                and inputs.block_tables.shape[1] <= self.max_blocks)

    def _context(self, bucket: int, modules: frozenset[int]) -> StepContext:
        r, b = self.runner, bucket
        # Up to b segments and b tiles; prepare() fills them and marks unused tiles -1.
        lora = LoraMeta(seg_starts=self.seg_starts[:b], seg_lens=self.seg_lens[:b],
                        seg_slots=self.seg_slots[:b], token_slots=self.token_slots[:b],
                        max_seg_len=DECODE_BLOCK_M, num_segments=b,
                        tile_segs=self.tile_segs[:b], tile_m0=self.tile_m0[:b], num_tiles=b,
                        block_m=DECODE_BLOCK_M, padded_tiles=True) if modules else None
        return StepContext(
            positions=self.positions[:b], slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b], seq_lens=self.seq_lens[:b],
            query_starts=self.arange[: b + 1], max_query_len=1,
            max_seq_len=self.max_blocks * r.arena.block_size,
            logits_indices=self.arange[:b].long(), kv_caches=r.arena.kv_caches, lora=lora,
            lora_tables=r.arena.tables if modules else None, lora_modules=modules,
            lora_split_k=r.graph_lora_split_k,
        )

    def _forward(self, bucket: int, ctx: StepContext) -> torch.Tensor:
        model = self.runner.model  # every row samples: no gather of the hidden states
        with step_context(ctx):
            return model.compute_logits(model(self.input_ids[:bucket], ctx.positions))

    def prepare(self, inputs: StepInputs, patch: TokenPatch | None = None) -> GraphKey:
        n, n_all, nb = inputs.num_seqs, self.n, inputs.block_tables.shape[1]
        key = self._key(next(s for s in self.buckets if s >= n), inputs)
        i64 = np.zeros((3, n_all), dtype=np.int64)
        i64[0, :n] = inputs.input_ids
        i64[1, :n] = inputs.positions
        i64[2, :] = -1
        i64[2, :n] = inputs.slot_mapping
        i32 = np.zeros(self.i32.numel(), dtype=np.int32)
        rows = i32[: 7 * n_all].reshape(7, n_all)
        rows[0, :] = 1
        rows[0, :n] = inputs.seq_lens
        rows[1, :] = self.empty_slot
        rows[1, :n] = np.where(inputs.token_slots >= 0, inputs.token_slots, self.empty_slot)
        rows[5, :] = -1
        if key[1]:
            _fill_lora(inputs.token_slots, DECODE_BLOCK_M, *rows[2:7])
        i32[7 * n_all :].reshape(n_all, self.max_blocks)[:n, :nb] = inputs.block_tables
        self._upload(i64, i32, patch)
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
    queries. Attention runs the general (prefill) kernel and LoRA 64-row tiles, whose grids are
    sized for the bucket's worst case; unused programs exit at once."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, decode_graphs: DecodeGraphs | None = None) -> None:
        # One memory pool with the decode graphs: only one graph runs at a time.
        super().__init__(runner, decode_graphs.pool if decode_graphs is not None else None)
        self.buckets = _token_buckets(max_num_batched_tokens)
        self.t_max, self.b_max = self.buckets[-1], max_num_seqs
        self.max_blocks = -(-max_model_len // runner.arena.block_size)
        t, b, nb = self.t_max, self.b_max, self.max_blocks
        tile_cap = -(-t // PREFILL_BLOCK_M) + b
        dev = runner.device
        self.i64 = torch.zeros(3 * t + b, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self.i64[: 3 * t].view(3, t)
        self.logits_indices = self.i64[3 * t :]
        # seq_lens [b], query_starts [b+1], token_slots [t], segment starts/lens/slots [b each]
        # (a segment is a run of one sequence or more), tile segs/first rows, block tables.
        sizes = (b, b + 1, t, b, b, b, tile_cap, tile_cap, b * nb)
        self.i32 = torch.zeros(sum(sizes), dtype=torch.int32, device=dev)
        self._offsets = np.cumsum((0, *sizes))
        views = [self.i32[lo:hi] for lo, hi in zip(self._offsets[:-1], self._offsets[1:],
                                                  strict=True)]
        (self.seq_lens, self.query_starts, self.token_slots, self.seg_starts, self.seg_lens,
         self.seg_slots, self.tile_segs, self.tile_m0) = views[:8]
        self.block_tables = views[8].view(b, nb)
        self.slot_mapping.fill_(-1)
        self.tile_segs.fill_(-1)

    def can_run(self, inputs: StepInputs) -> bool:
        return (inputs.input_ids.size <= self.t_max and inputs.num_seqs <= self.b_max
                and inputs.logits_indices.size <= self.b_max
                and inputs.block_tables.shape[1] <= self.max_blocks)

    def _context(self, bucket: int, modules: frozenset[int]) -> StepContext:
        r, t = self.runner, bucket
        # Tiles: at most one partial tile per segment plus t / 64 full ones.
        tiles = -(-t // PREFILL_BLOCK_M) + min(self.b_max, t)
        lora = LoraMeta(seg_starts=self.seg_starts, seg_lens=self.seg_lens,
                        seg_slots=self.seg_slots, token_slots=self.token_slots[:t],
                        max_seg_len=t, num_segments=self.b_max,
                        tile_segs=self.tile_segs[:tiles], tile_m0=self.tile_m0[:tiles],
                        num_tiles=tiles, block_m=PREFILL_BLOCK_M,
                        padded_tiles=True) if modules else None
        return StepContext(
            positions=self.positions[:t], slot_mapping=self.slot_mapping[:t],
            block_tables=self.block_tables, seq_lens=self.seq_lens,
            query_starts=self.query_starts, max_query_len=t,
            max_seq_len=self.max_blocks * r.arena.block_size,
            logits_indices=self.logits_indices, kv_caches=r.arena.kv_caches, lora=lora,
            lora_tables=r.arena.tables if modules else None, lora_modules=modules,
            lora_split_k=r.graph_lora_split_k,
        )

    def prepare(self, inputs: StepInputs, patch: TokenPatch | None = None) -> GraphKey:
        n_tok, n_seq = int(inputs.input_ids.size), inputs.num_seqs
        key = self._key(next(s for s in self.buckets if s >= n_tok), inputs)
        tm = self.t_max
        i64 = np.zeros(self.i64.numel(), dtype=np.int64)
        i64[:n_tok] = inputs.input_ids
        i64[tm : tm + n_tok] = inputs.positions
        i64[2 * tm : 3 * tm] = -1
        i64[2 * tm : 2 * tm + n_tok] = inputs.slot_mapping
        i64[3 * tm : 3 * tm + inputs.logits_indices.size] = inputs.logits_indices
        i32 = np.zeros(self.i32.numel(), dtype=np.int32)
        part = [i32[lo:hi] for lo, hi in zip(self._offsets[:-1], self._offsets[1:],
                                            strict=True)]
        part[0][:] = 1
        part[0][:n_seq] = inputs.seq_lens
        part[1][:] = n_tok
        part[1][: n_seq + 1] = inputs.query_starts
        part[2][:] = -1
        part[2][:n_tok] = inputs.token_slots
        part[6][:] = -1
        if key[1]:
            _fill_lora(inputs.token_slots, PREFILL_BLOCK_M, *part[3:8])
        nb = inputs.block_tables.shape[1]
        part[8].reshape(self.b_max, self.max_blocks)[:n_seq, :nb] = inputs.block_tables
        self._upload(i64, i32, patch)
        return key
