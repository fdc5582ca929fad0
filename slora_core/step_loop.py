"""One engine step: finished adapter reads, schedule, arena changes, forward, sample, stream.

With asynchronous steps a step is launched before the previous step's sampled ids are read
(the GPU works on it meanwhile), and the outputs a step returns are the previous step's.
Sequences that step sampled carry a placeholder last token: the scheduler counts it, and its
id reaches this step's inputs on the device (TokenPatch). A sequence found finished when the
ids arrive computed one token too many; it is dropped before sampling."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slora_core import step_checks
from slora_core.adapter_tiers import AdapterTiers, unloadable
from slora_core.admission import AdmissionPacer
from slora_core.host_copy import row_index
from slora_core.intake import Request, Requests
from slora_core.model_runner import ModelRunner
from slora_core.outputs import (
    ADAPTER_UNLOADABLE,
    DEADLINE,
    NONFINITE,
    RequestOutput,
    TokenLogprob,
    nonfinite_logits_error,
)
from slora_core.sampler import PendingSample, SampledToken, Sampler
from slora_core.scheduler import PLACEHOLDER, Scheduler, SchedulerOutput
from slora_core.sequence import Sequence
from slora_core.structured.requests import GRAMMAR_ERROR, GrammarRequests

GRAMMAR_WAIT_S = 0.01  # how long an idle step waits for a grammar to compile


@dataclass
class Inflight:
    """A step whose sampled ids are still on their way to the host (asynchronous steps): row i
    of `pending` belongs to seqs[i], whose last output token is a placeholder until then."""

    seqs: list[Sequence]
    pending: PendingSample
    # Late admission's timing (AdmissionPacer); None without.
    timing: StepTiming | None = None


@dataclass
class StepTiming:
    """CUDA events before a step's launches and after its sampling and its token count (the
    pacer times the step's GPU work with them), and for a paced step its predecessor's end
    event (the GPU's idle gap before it)."""

    started: torch.cuda.Event
    ended: torch.cuda.Event
    tokens: int
    after: torch.cuda.Event | None


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler,
                 requests: Requests, tiers: AdapterTiers, eos_token_ids: tuple[int, ...],
                 steps_async: bool, admission_lead_ms: float = 0.0) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.requests = requests
        self.tiers = tiers
        self.eos_token_ids = eos_token_ids
        self.steps_async = steps_async
        self.inflight: Inflight | None = None  # async steps: the sampled batch not yet read
        self.grammars: GrammarRequests | None = None  # structured output (engine sets it)
        # A serving loop's hook (the engine core sets it): a read step's outputs as soon as
        # they are known, before the next step's sampling is launched and booked, so that
        # they travel meanwhile; step() then returns only what came after them.
        self.early_outputs: Callable[[list[RequestOutput]], None] | None = None
        # Late admission (EngineConfig.admission_lead_ms): how long the serving loop may take
        # requests after a step returns (`admission_wait_s`). Asynchronous steps on CUDA only:
        # on the CPU nothing runs beside the host.
        self.pacer = (AdmissionPacer(admission_lead_ms / 1e3) if admission_lead_ms > 0
                      and steps_async and runner.device.type == "cuda" else None)

    def admission_wait_s(self) -> float:
        """How long a serving loop may still take new requests before calling `step()`; 0
        without late admission."""
        return self.pacer.wait_s(time.monotonic()) if self.pacer is not None else 0.0

    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; the outputs of requests that made progress."""
        inflight, self.inflight = self.inflight, None
        entered = time.monotonic()
        self.tiers.sweep()
        outputs = self._finish_reads() if self.tiers.reading else []
        if self.grammars is not None and self.grammars.active:
            outputs += self._grammar_changes()
        sched = self.scheduler.schedule()
        outputs += self.apply_memory_changes(sched)
        outputs += [self._expire(seq) for seq in sched.expired]
        if not sched.scheduled and inflight is None and self.tiers.reading and not outputs:
            self.tiers.wait_for_read()  # nothing to run until a read lands
        elif not sched.scheduled and inflight is None and not outputs and (
                self.grammars is not None and self.grammars.has_pending):
            self.grammars.wait(GRAMMAR_WAIT_S)  # nothing to run until a grammar compiles
        logits: torch.Tensor | None = None
        sampling: list[Sequence] = []
        started: torch.cuda.Event | None = None
        after: torch.cuda.Event | None = None  # a paced step's predecessor's end
        if sched.scheduled:
            self.tiers.wait_for_copies(sched)
            if step_checks.ENABLED:  # after the waits: it reads the slots' table rows
                step_checks.check_scheduled(sched.scheduled, self.tiers.pool, self.tiers.arena)
            patch = None if inflight is None else self.runner.token_patch(
                sched.scheduled, inflight.seqs, inflight.pending.tokens)
            started = self._record_event() if self.pacer is not None else None
            logits = self.runner.run(sched.scheduled, patch)
            if self.pacer is not None and self.pacer.launched(time.monotonic() - entered,
                                                              sched.num_tokens):
                after = inflight.timing.ended if inflight and inflight.timing else None
            sampling = [s.seq for s in sched.scheduled if s.samples]
        if inflight is not None:
            if self.pacer is not None:
                # Read as its tokens land, before streaming them (milliseconds at 256 rows:
                # counted after, the wait overran the step under way by as much and the GPU
                # idled; service-overhead-7b-gw4-admission-f770983-h100.json).
                inflight.pending.wait()
                self._paced(inflight, running=bool(sched.scheduled))
            outputs += self._complete(inflight)
            if self.early_outputs is not None:
                self.early_outputs(outputs)
                outputs = []
            logits, sampling = self._drop_finished(logits, sampling)
        if not self.steps_async:
            return outputs + self.sample(sched, logits, sampling)
        self.inflight = self._sample_async(sched, logits, sampling)
        if self.inflight is not None and started is not None:
            self.inflight.timing = StepTiming(started, self._record_event(), sched.num_tokens,
                                              after)
        return outputs

    @staticmethod
    def _record_event() -> torch.cuda.Event:
        """A timing event recorded on the current CUDA stream (late admission's)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _paced(self, inflight: Inflight, running: bool) -> None:
        """Tell the pacer the step `inflight` held is read (its events done with it)."""
        assert self.pacer is not None
        self.pacer.read(time.monotonic(), running)
        timing = inflight.timing
        if timing is not None:
            timing.ended.synchronize()  # recorded just after the sampled ids' copy, read
            self.pacer.step_done(timing.started.elapsed_time(timing.ended) / 1e3, timing.tokens)
            if timing.after is not None:
                self.pacer.idle(timing.after.elapsed_time(timing.started) / 1e3)

    # ---- adapters ------------------------------------------------------------------------
    def _finish_reads(self) -> list[RequestOutput]:
        """Requests whose adapter finished loading in the background become schedulable, or
        end with an error that says why (the file could not be parsed or validated, or the
        request does not fit the arena with it); the other requests go on."""
        outputs: list[RequestOutput] = []
        for digest, got in self.tiers.finished_reads():
            waiting = [r for r in self.requests.live.values()
                       if r.seq.adapter == digest and not r.seq.adapter_ready]
            if isinstance(got, Exception):
                outputs += [self._fail(r, unloadable(r.seq.adapter_name, got)) for r in waiting]
                continue
            pages = got.layout.num_pages
            for req in waiting:
                error = self.requests.fits_error(self.requests.pages_needed(req.seq, pages),
                                                 with_adapter=True)
                if error is not None:
                    outputs.append(self._fail(req, error))
                else:
                    req.seq.adapter_pages, req.seq.adapter_ready = pages, True
        return outputs

    def _fail(self, req: Request, error: str) -> RequestOutput:
        return self.requests.end(req, "error", error, ADAPTER_UNLOADABLE)

    def apply_memory_changes(self, sched: SchedulerOutput) -> list[RequestOutput]:
        return self.tiers.apply(sched,
                                lambda digest, error: self._fail_adapter(digest, sched, error))

    def _fail_adapter(self, digest: str, sched: SchedulerOutput, error: str
                      ) -> list[RequestOutput]:
        """An adapter that can no longer be loaded fails its requests; the rest go on."""
        victims = [r for r in self.requests.live.values() if r.seq.adapter == digest]
        sched.scheduled = [s for s in sched.scheduled if s.seq.adapter != digest]
        return [self._fail(req, unloadable(req.seq.adapter_name, error)) for req in victims]

    def _expire(self, seq: Sequence) -> RequestOutput:
        return self.requests.end(self.requests.live[seq.request_id], "abort",
                                 "deadline exceeded before the request was scheduled", DEADLINE)

    # ---- structured output -----------------------------------------------------------------
    def _grammar_changes(self) -> list[RequestOutput]:
        """Requests whose grammar compiled may be scheduled; refused ones end now."""
        assert self.grammars is not None
        live = self.requests.live
        self.grammars.retain(live)
        return [self.requests.end(live[rid], "error", error, GRAMMAR_ERROR)
                for rid, error in self.grammars.admit(live)]

    # ---- sampling ------------------------------------------------------------------------
    def _sampler_args(self, logits: torch.Tensor, sampling: list[Sequence]) -> tuple[Any, ...]:
        reqs = [self.requests.live[s.request_id] for s in sampling]
        return (logits, [s.params for s in sampling], [r.generator for r in reqs],
                # Only the penalties read the history: skip the O(context) copy otherwise.
                [s.token_ids() if s.params.needs_history else () for s in sampling],
                [len(s.output_token_ids) for s in sampling], self.eos_token_ids,
                # The constrained rows' allowed tokens (filled while the forward runs).
                self.grammars.mask([s.request_id for s in sampling])
                if self.grammars is not None and self.grammars.active else None)

    def sample(self, sched: SchedulerOutput, logits: torch.Tensor | None,
               sampling: list[Sequence]) -> list[RequestOutput]:
        """Sample the step's tokens, let the scheduler book the step, stream the tokens."""
        tokens = (self.sampler.sample(*self._sampler_args(logits, sampling))
                  if logits is not None and sampling else [])
        ids = [t.token_id if t.finite else None for t in tokens]
        reasons = self.scheduler.postprocess(sched.scheduled, list(zip(sampling, ids, strict=True)))
        return [self._append_token(self.requests.live[seq.request_id], tok, reason)
                for seq, tok, reason in zip(sampling, tokens, reasons, strict=True)]

    def _sample_async(self, sched: SchedulerOutput, logits: torch.Tensor | None,
                      sampling: list[Sequence]) -> Inflight | None:
        """Launch the step's sampling; the scheduler books the step with placeholder tokens."""
        pending = (self.sampler.sample_async(*self._sampler_args(logits, sampling))
                   if logits is not None and sampling else None)
        self.scheduler.postprocess(sched.scheduled, [(seq, PLACEHOLDER) for seq in sampling])
        return Inflight(sampling, pending) if pending is not None else None

    def _drop_finished(self, logits: torch.Tensor | None, sampling: list[Sequence]
                       ) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Sequences finished after the step was launched (it computed one token too many for
        them) are not sampled."""
        keep = [i for i, s in enumerate(sampling) if self.requests.is_live(s)]
        if len(keep) == len(sampling) or logits is None:
            return logits, sampling
        return logits[row_index(keep, logits.device)], [sampling[i] for i in keep]

    def _complete(self, inflight: Inflight) -> list[RequestOutput]:
        """Read a launched step's sampled ids: fill the placeholders, stream, finish."""
        outputs = []
        for seq, tok in zip(inflight.seqs, inflight.pending.result(), strict=True):
            if not self.requests.is_live(seq):
                continue  # aborted or failed while the step ran
            reason = self.scheduler.resolve(seq, tok.token_id if tok.finite else None)
            outputs.append(self._append_token(self.requests.live[seq.request_id], tok, reason))
        return outputs

    def _append_token(self, req: Request, tok: SampledToken, reason: str | None
                      ) -> RequestOutput:
        """Stream a token the scheduler has appended; `reason`: it finished the request. A
        stop string in the text finishes it too (as "stop", which wins over "length")."""
        if not tok.finite:
            # Logits with a NaN or inf end the request with an error: the id sampled from
            # them is the argmax of garbage, so no token is emitted. Other rows are untouched.
            return self.requests.end(req, "error",
                                     nonfinite_logits_error(len(req.seq.output_token_ids)),
                                     NONFINITE)
        seq = req.seq
        grammar = (self.grammars.after_token(seq.request_id, tok.token_id)
                   if self.grammars is not None and self.grammars.active else None)
        if grammar is not None and grammar != "stop":
            return self.requests.end(req, "error", grammar, GRAMMAR_ERROR)
        text = req.stream.append(tok.token_id)
        out = RequestOutput(
            request_id=seq.request_id, token_ids=[tok.token_id], text=text,
            logprobs=[TokenLogprob(tok.token_id, tok.logprob, tok.top_logprobs)],
            prompt_tokens=len(seq.prompt_token_ids), completion_tokens=len(seq.output_token_ids),
            cached_tokens=seq.num_cached_tokens,
        )
        if req.stream.stopped or grammar == "stop":  # stopped: after min_new_tokens only
            if reason is None:
                self.scheduler.finish(seq)
            reason = "stop"
        if reason is not None:
            del self.requests.live[seq.request_id]
            out.text += req.stream.flush()
            out.finished, out.finish_reason = True, reason
        return out
