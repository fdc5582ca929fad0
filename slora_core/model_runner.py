"""Turns a scheduled step into tensors (one StepContext), runs the model, returns the logits of
the sequences that sample this step. The only engine part that touches the device.

On CUDA, decode-only steps replay a CUDA graph captured per batch-size bucket; the step's
metadata is copied into the graph's static buffers, so a decode step costs one launch."""

from __future__ import annotations

import numpy as np
import torch

from kernels.lora_reference import DECODE_BLOCK_M, LoraMeta, lora_segments, lora_tiles, tile_rows
from slora_core.arena import PageArena
from slora_core.context import StepContext, step_context
from slora_core.model import LlamaForCausalLM
from slora_core.page_pool import PagePool
from slora_core.scheduler import ScheduledSeq
from slora_core.step_inputs import StepInputs, build_step_inputs, to_device


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, arena: PageArena, pool: PagePool, *,
                 max_num_seqs: int = 64, max_model_len: int = 2048,
                 use_cuda_graphs: bool = True) -> None:
        self.model = model
        self.arena = arena
        self.pool = pool
        self.device = arena.pages.device
        self.graphs: DecodeGraphs | None = None
        if use_cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)

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
    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Forward the step; float32 logits [num_sampling_seqs, vocab] in scheduled order."""
        inputs = build_step_inputs(scheduled, self.pool, self.arena.block_size)
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs)
        input_ids, ctx = self.build_context(inputs)
        with step_context(ctx):
            hidden = self.model(input_ids, ctx.positions)
            return self.model.compute_logits(hidden[ctx.logits_indices])


GraphKey = tuple[int, frozenset[int]]  # (batch bucket, LoRA module ids the graph runs)


def _buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    """CUDA graphs of the decode step (one token per sequence), one per batch-size bucket.

    A graph is keyed by (bucket, LoRA modules): the module ids whose LoRA kernels it runs
    (those some resident adapter targets; empty for steps with no adapter token). LoRA runs
    over one-token segments; base-model and padding rows point at the arena's spare table row,
    whose ranks are always 0."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> None:
        self.runner = runner
        arena = runner.arena
        self.buckets = _buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // arena.block_size)
        self.empty_slot = arena.num_slots - 1
        n, dev = self.buckets[-1], runner.device
        self.n = n
        # Static inputs in two packed buffers, each filled by one host-to-device copy a step.
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
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.logits: dict[GraphKey, torch.Tensor] = {}
        self.contexts: dict[GraphKey, StepContext] = {}  # captured graphs read these
        self.pool = torch.cuda.graph_pool_handle()

    def capture_all(self, modules: frozenset[int]) -> None:
        """Capture every bucket for one LoRA module set now (start-up), so no request waits for
        a capture later. An empty set captures the base-model (no LoRA) graphs."""
        with torch.inference_mode():
            for b in reversed(self.buckets):  # largest first: smaller graphs reuse its pool
                if (b, modules) not in self.graphs:
                    self._capture(b, modules)

    def can_run(self, inputs: StepInputs) -> bool:
        return (inputs.max_query_len == 1 and inputs.logits_indices.size == inputs.num_seqs
                and inputs.num_seqs <= self.buckets[-1]
                and inputs.block_tables.shape[1] <= self.max_blocks)

    def _context(self, b: int, modules: frozenset[int]) -> StepContext:
        r = self.runner
        with_lora = bool(modules)
        # Up to b segments and b tiles; run() fills them and marks unused tiles -1.
        lora = LoraMeta(seg_starts=self.seg_starts[:b], seg_lens=self.seg_lens[:b],
                        seg_slots=self.seg_slots[:b], token_slots=self.token_slots[:b],
                        max_seg_len=DECODE_BLOCK_M, num_segments=b,
                        tile_segs=self.tile_segs[:b], tile_m0=self.tile_m0[:b], num_tiles=b,
                        block_m=DECODE_BLOCK_M) if with_lora else None
        return StepContext(
            positions=self.positions[:b], slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b], seq_lens=self.seq_lens[:b],
            query_starts=self.arange[: b + 1], max_query_len=1,
            max_seq_len=self.max_blocks * r.arena.block_size,
            logits_indices=self.arange[:b].long(), kv_caches=r.arena.kv_caches, lora=lora,
            lora_tables=r.arena.tables if with_lora else None, lora_modules=modules,
        )

    def _capture(self, b: int, modules: frozenset[int]) -> None:
        key = (b, modules)
        ctx = self.contexts[key] = self._context(b, modules)
        model = self.runner.model
        with step_context(ctx):
            for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                model.compute_logits(model(self.input_ids[:b], ctx.positions))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[key] = model.compute_logits(model(self.input_ids[:b], ctx.positions))
        self.graphs[key] = graph

    def run(self, inputs: StepInputs) -> torch.Tensor:
        n = inputs.num_seqs
        b = next(s for s in self.buckets if s >= n)
        has_lora = bool((inputs.token_slots >= 0).any())
        key = (b, self.runner.arena.active_lora_modules if has_lora else frozenset())
        n_all, nb = self.n, inputs.block_tables.shape[1]
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
        if has_lora:
            starts, lens, seg_slots = lora_segments(inputs.token_slots)
            tile_segs, tile_m0 = lora_tiles(lens, DECODE_BLOCK_M)
            rows[2, : starts.size] = starts
            rows[3, : lens.size] = lens
            rows[4, : seg_slots.size] = seg_slots
            rows[5, : tile_segs.size] = tile_segs
            rows[6, : tile_m0.size] = tile_m0
        i32[7 * n_all :].reshape(n_all, self.max_blocks)[:n, :nb] = inputs.block_tables
        for static, host in ((self.i64, i64), (self.i32, i32)):
            src = torch.from_numpy(host.reshape(-1))
            static.copy_(src.pin_memory(), non_blocking=True)
        if key not in self.graphs:
            # A bucket or module set not captured at start-up: capture it now. Its warm-up runs
            # read this step's inputs (already in the buffers), so the KV rows they write are
            # the ones the replay writes; stale inputs could overwrite pages reused since.
            self._capture(*key)
        self.graphs[key].replay()
        return self.logits[key][:n]
