"""Host-side arrays of one step, built with numpy (no per-token Python loop), then moved to the
device in one pinned, non-blocking copy; and the input ids still on the device (TokenPatch)
when the previous step's sampled ids have not reached the host (asynchronous steps)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TypeVar

import numpy as np
import torch

from slora_core.host_copy import host_values
from slora_core.scheduler import ScheduledSeq
from slora_core.sequence import Sequence
from slora_kernels.lora_meta import lora_segments, lora_tiles, tile_rows


@dataclass(frozen=True)
class StepInputs:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    token_slots: np.ndarray  # [T] int64: adapter slot per token, -1 = base model
    seq_lens: np.ndarray  # [B] int64
    query_starts: np.ndarray  # [B + 1] int64
    block_tables: np.ndarray  # [B, max_blocks] int64
    logits_indices: np.ndarray  # [n] int64
    max_query_len: int
    # LoRA segments (maximal runs of tokens on one adapter slot; base-model runs left out)
    seg_starts: np.ndarray  # [S] int64
    seg_lens: np.ndarray  # [S] int64
    seg_slots: np.ndarray  # [S] int64
    # Every token reads the adapter loaded in the ride's rows (slora_core/lora_ride.py).
    ride: bool = False

    @property
    def has_lora(self) -> bool:
        return self.seg_starts.size > 0

    def lora_tiles(self, block_m: int) -> tuple[np.ndarray, np.ndarray]:
        """The segments' tile list for `block_m`-row tiles: (segment, first row) per tile."""
        return lora_tiles(self.seg_lens, block_m)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def build_step_inputs(scheduled: list[ScheduledSeq], block_size: int) -> StepInputs:
    """Per-sequence values are read once each (a C-level iteration where possible); every
    per-token array is derived from them with vectorized numpy, so a 256-sequence decode step
    spends no Python loop per token."""
    nseq = len(scheduled)
    seqs = [item.seq for item in scheduled]
    counts = np.fromiter((item.num_new_tokens for item in scheduled), np.int64, nseq)
    computed = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, nseq)
    samples = np.fromiter((item.samples for item in scheduled), bool, nseq)
    table_lens = np.fromiter((len(s.block_table) for s in seqs), np.int64, nseq)
    tables = np.zeros((nseq, int(table_lens.max())), dtype=np.int64)
    tables[np.repeat(np.arange(nseq), table_lens), _ranks_within(table_lens)] = np.fromiter(
        chain.from_iterable(s.block_table for s in seqs), np.int64, int(table_lens.sum()))
    starts = np.zeros(nseq + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    num_tokens = int(starts[-1])
    seq_of_token = np.repeat(np.arange(nseq), counts)
    positions = computed[seq_of_token] + _ranks_within(counts)
    slot_mapping = (tables[seq_of_token, positions // block_size] * block_size
                    + positions % block_size)
    if num_tokens == nseq:  # decode: one token per sequence
        ids = np.fromiter((s.token_at(s.num_computed_tokens) for s in seqs), np.int64, nseq)
    else:
        ids = np.fromiter(chain.from_iterable(
            s.token_slice(s.num_computed_tokens, s.num_computed_tokens + item.num_new_tokens)
            for s, item in zip(seqs, scheduled, strict=True)), np.int64, num_tokens)
    seq_slots = np.fromiter((item.adapter_slot for item in scheduled), np.int64, nseq)
    token_slots = seq_slots[seq_of_token]
    seg_starts, seg_lens, seg_slots = lora_segments(token_slots)
    return StepInputs(
        input_ids=ids, positions=positions, slot_mapping=slot_mapping,
        token_slots=token_slots, seq_lens=computed + counts, query_starts=starts,
        block_tables=tables, logits_indices=starts[1:][samples] - 1,
        max_query_len=int(counts.max()), seg_starts=seg_starts, seg_lens=seg_lens,
        seg_slots=seg_slots,
    )


def _ranks_within(sizes: np.ndarray) -> np.ndarray:
    """0..n-1 for each group of `sizes`, concatenated: [2, 3] -> [0, 1, 0, 1, 2]."""
    total = int(sizes.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Pack several 1-D/2-D integer arrays into one int64 host buffer, copy it once (pinned,
    non-blocking on CUDA), and return int64 device views shaped like the inputs."""
    return unpack(pack_to_device(arrays, device), [a.shape for a in arrays])


def pack_to_device(arrays: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """The arrays concatenated (flattened) in one int64 device tensor, one pinned non-blocking
    copy on CUDA."""
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    return host_values(np.ascontiguousarray(flat, dtype=np.int64), torch.int64, device)


Flat = TypeVar("Flat", torch.Tensor, np.ndarray)


def unpack(flat: Flat, shapes: list[tuple[int, ...]]) -> list[Flat]:
    """Views of `flat` (a device tensor or a host array) shaped `shapes`, in order (the inverse
    of `pack_to_device`)."""
    out, offset = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(flat[offset : offset + size].reshape(shape))
        offset += size
    return out


@dataclass(frozen=True)
class StepShape:
    """The host-side sizes of one step's device arrays (`step_arrays`), enough to cut them out
    of one flat buffer: what a tensor-parallel rank receives ahead of the buffer itself."""

    num_tokens: int
    num_seqs: int
    max_blocks: int
    num_logits: int
    max_query_len: int
    max_seq_len: int
    num_segments: int = 0  # 0: no LoRA this step
    num_tiles: int = 0
    block_m: int = 0
    max_seg_len: int = 0

    def array_shapes(self) -> list[tuple[int, ...]]:
        t, b, s, k = self.num_tokens, self.num_seqs, self.num_segments, self.num_tiles
        shapes = [(t,), (t,), (t,), (self.num_logits,), (b,), (b + 1,), (b, self.max_blocks)]
        if s:
            shapes += [(t,), (s,), (s,), (s,), (k,), (k,)]
        return shapes


def step_arrays(inputs: StepInputs) -> tuple[list[np.ndarray], StepShape]:
    """The step's device arrays in `StepShape.array_shapes` order: input ids, positions, KV
    slots, logits rows, sequence lengths, query starts, block tables, then with LoRA the token
    slots, segments and tiles."""
    arrays = [inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices,
              inputs.seq_lens, inputs.query_starts, inputs.block_tables]
    lora: dict[str, int] = {}
    if inputs.has_lora:
        max_seg_len = int(inputs.seg_lens.max())
        block_m = tile_rows(max_seg_len, inputs.num_tokens)
        tiles = inputs.lora_tiles(block_m)
        arrays += [inputs.token_slots, inputs.seg_starts, inputs.seg_lens, inputs.seg_slots,
                   *tiles]
        lora = dict(num_segments=int(inputs.seg_starts.size), num_tiles=int(tiles[0].size),
                    block_m=block_m, max_seg_len=max_seg_len)
    shape = StepShape(num_tokens=inputs.num_tokens, num_seqs=inputs.num_seqs,
                      max_blocks=int(inputs.block_tables.shape[1]),
                      num_logits=int(inputs.logits_indices.size),
                      max_query_len=inputs.max_query_len,
                      max_seq_len=int(inputs.seq_lens.max()), **lora)
    return arrays, shape


@dataclass(frozen=True)
class TokenPatch:
    """Input ids the host does not know yet: token `dst[i]` of the step is `src[rows[i]]`, an id
    the previous step sampled that is still on the device (asynchronous steps)."""

    dst: np.ndarray  # [n] int64 token indices within the step
    rows: np.ndarray  # [n] int64 rows of src
    src: torch.Tensor  # [B_prev] int64, on the device


def token_patch(scheduled: list[ScheduledSeq], prev_seqs: list[Sequence],
                prev_tokens: torch.Tensor) -> TokenPatch | None:
    """Where a step's inputs are the placeholders of the previous step, which sampled
    `prev_tokens[i]` for `prev_seqs[i]` (still on the device)."""
    row_of = {id(s): i for i, s in enumerate(prev_seqs)}
    dst, rows = [], []
    start = 0
    for item in scheduled:
        seq, n = item.seq, item.num_new_tokens
        row = row_of.get(id(seq))
        # The placeholder is the sequence's last token; a decode step's only one.
        if row is not None and seq.num_computed_tokens + n == seq.num_tokens:
            dst.append(start + n - 1)
            rows.append(row)
        start += n
    if not dst:
        return None
    return TokenPatch(np.asarray(dst, dtype=np.int64), np.asarray(rows, dtype=np.int64),
                      prev_tokens)


def apply_patch(input_ids: torch.Tensor, patch: TokenPatch | None) -> None:
    """input_ids[dst] = src[rows], on the device (the indices travel pinned and non-blocking:
    a pageable copy would wait for the previous step's work)."""
    if patch is None or patch.dst.size == 0:
        return
    dst, rows = to_device([patch.dst, patch.rows], input_ids.device)
    input_ids[dst] = patch.src[rows]
