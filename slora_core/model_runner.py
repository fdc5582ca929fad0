"""Turns a scheduled step into tensors (one StepContext), runs the model, returns the logits of
the sequences that sample this step. The only engine part that touches the device; on CUDA it
replays CUDA graphs (cuda_graphs.py) where a step fits one."""

from __future__ import annotations

from dataclasses import replace

import torch

from slora_core import step_checks
from slora_core.arena import PageArena
from slora_core.config import EngineConfig, ModelConfig
from slora_core.context import StepContext, step_context
from slora_core.cuda_graphs import DecodeGraphs, MixedGraphs
from slora_core.lora import wrap_lora
from slora_core.lora_merge import SoleAdapterMerge
from slora_core.lora_ride import SoleAdapterRide, attach_ride_rows
from slora_core.model import LlamaForCausalLM
from slora_core.prompt_logprobs import PromptLogprob, score_step, wants_prompt_logprobs
from slora_core.scheduler import ScheduledSeq
from slora_core.sequence import Sequence
from slora_core.step_inputs import (
    StepInputs,
    StepShape,
    TokenPatch,
    apply_patch,
    build_step_inputs,
    pack_to_device,
    step_arrays,
    token_patch,
    unpack,
)
from slora_kernels.lora_meta import LoraMeta


class ModelRunner:
    """Runs the model on scheduled steps over a page arena (KV blocks and adapter pages)."""

    def __init__(self, model: LlamaForCausalLM, arena: PageArena, *,
                 max_num_seqs: int = 64, max_model_len: int = 2048,
                 max_num_batched_tokens: int = 512, use_cuda_graphs: bool = True,
                 mixed_graphs: bool = True, merge_sole_adapter: bool = False,
                 ride_sole_adapter: bool = False, lora_row_kernels: bool = False,
                 lora_pdl: bool | None = None, lora_fork_shrink: bool = False) -> None:
        self.model = model
        self.arena = arena
        # EngineConfig.lora_row_kernels: decode graphs' full LoRA list runs the row kernels.
        self.lora_row_kernels = lora_row_kernels
        # EngineConfig.lora_pdl: LoRA expands as programmatic dependents of their shrinks.
        self.lora_pdl = lora_pdl
        # EngineConfig.lora_fork_shrink: decode graphs' many-adapter shrinks beside the GEMMs.
        self.lora_fork_shrink = lora_fork_shrink
        # EngineConfig.merge_sole_adapter: steps on one adapter run as the base model.
        self.merge = SoleAdapterMerge(model, arena) if merge_sole_adapter else None
        # EngineConfig.ride_sole_adapter: unmerged steps on one adapter ride the base GEMMs.
        self.ride = SoleAdapterRide(model, arena) if ride_sole_adapter else None
        self.device = arena.pages.device
        # Prompt logprobs scored by the steps since the last take (prompt_logprobs.score_step).
        self.prompt_scores: dict[str, tuple[int, list[PromptLogprob]]] = {}
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None
        if use_cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)
            if mixed_graphs:
                self.mixed = MixedGraphs(self, max_num_seqs, max_num_batched_tokens,
                                         max_model_len, self.graphs)

    @classmethod
    def build(cls, model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig,
              block_size: int, max_model_len: int) -> ModelRunner:
        """The runner of an engine: its page arena, and the model's linear layers wrapped for
        LoRA."""
        wrap_lora(model, model_config)
        if config.ride_sole_adapter:
            # Before the arena: the wider weights replace the loaded ones while the device
            # still has room for both of one projection.
            attach_ride_rows(model, config.max_rank)
        # One spare table row beyond the pool's slots stays empty (rank 0): CUDA-graph decode
        # steps point base-model and padding rows at it.
        arena = PageArena(model_config, config.num_pages, block_size, config.num_pages + 1,
                          config.torch_dtype, torch.device(config.device),
                          max_rank=config.max_rank)
        return cls(model, arena, max_num_seqs=config.max_num_seqs,
                   # Graph block tables need no more columns than the arena has pages,
                   # whatever the model's context length.
                   max_model_len=min(max_model_len, config.num_pages * block_size),
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   use_cuda_graphs=config.cuda_graphs, mixed_graphs=config.mixed_graphs,
                   merge_sole_adapter=config.merges_sole_adapter,
                   ride_sole_adapter=config.ride_sole_adapter,
                   lora_row_kernels=config.lora_row_kernels, lora_pdl=config.lora_pdl,
                   lora_fork_shrink=config.lora_fork_shrink)

    def build_context(self, inputs: StepInputs) -> tuple[torch.Tensor, StepContext]:
        """The step's input ids and context on the device (one copy for every array)."""
        arrays, shape = step_arrays(inputs)
        return self.context_from(pack_to_device(arrays, self.device), shape)

    def context_from(self, flat: torch.Tensor, shape: StepShape
                     ) -> tuple[torch.Tensor, StepContext]:
        """The input ids and context of a step whose arrays (`step_arrays`) are packed in the
        int64 device tensor `flat`."""
        input_ids, positions, slot_mapping, logits_indices, *meta = unpack(
            flat, shape.array_shapes())
        seq_lens, query_starts, block_tables, *lora_meta = [t.to(torch.int32) for t in meta]
        lora = None
        if shape.num_segments:
            token_slots, seg_starts, seg_lens, seg_slots, tile_segs, tile_m0 = lora_meta
            lora = LoraMeta(seg_starts=seg_starts, seg_lens=seg_lens, seg_slots=seg_slots,
                            token_slots=token_slots, max_seg_len=shape.max_seg_len,
                            num_segments=shape.num_segments, tile_segs=tile_segs,
                            tile_m0=tile_m0, num_tiles=shape.num_tiles, block_m=shape.block_m)
        ctx = StepContext(
            positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
            seq_lens=seq_lens, query_starts=query_starts, max_query_len=shape.max_query_len,
            max_seq_len=shape.max_seq_len, logits_indices=logits_indices,
            kv_caches=self.arena.kv_caches, lora=lora,
            lora_tables=self.arena.tables if lora is not None else None,
            lora_modules=self.arena.active_lora_modules, lora_pdl=self.lora_pdl,
        )
        return input_ids, ctx

    @staticmethod
    def token_patch(scheduled: list[ScheduledSeq], prev_seqs: list[Sequence],
                    prev_tokens: torch.Tensor) -> TokenPatch | None:
        """The patch `run` needs when the previous step's ids are still on the device."""
        return token_patch(scheduled, prev_seqs, prev_tokens)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], patch: TokenPatch | None = None
            ) -> torch.Tensor:
        """Forward the step; float32 logits [num_sampling_seqs, vocab] in scheduled order.
        `patch` supplies input ids still on the device (see TokenPatch)."""
        inputs = build_step_inputs(scheduled, self.arena.block_size)
        if self.merge is not None:
            inputs = self.merge.route(inputs)
        if self.ride is not None:
            inputs = self.ride.route(inputs)
        # A step that scores prompt tokens needs every row's hidden state: eager.
        scoring = wants_prompt_logprobs(scheduled)
        if self.graphs is not None and not scoring and self.graphs.can_run(inputs):
            return self.graphs.run(inputs, patch)
        if self.mixed is not None and not scoring and self.mixed.can_run(inputs):
            return self.mixed.run(inputs, patch)
        input_ids, ctx = self.build_context(inputs)
        if inputs.ride:
            ctx = replace(ctx, lora_ride=True)
        if step_checks.ENABLED:
            step_checks.check_context(ctx, int(input_ids.shape[0]), self.arena, "eager step")
        apply_patch(input_ids, patch)
        with step_context(ctx):
            hidden = self.model(input_ids, ctx.positions)
            if scoring:
                self.prompt_scores.update(score_step(
                    scheduled, inputs.query_starts.tolist(), hidden, self.model.compute_logits))
            return self.model.compute_logits(hidden[ctx.logits_indices])

    def take_prompt_scores(self) -> dict[str, tuple[int, list[PromptLogprob]]]:
        """Prompt logprobs scored since the last call, by request id: (first position, ...)."""
        scores, self.prompt_scores = self.prompt_scores, {}
        return scores
