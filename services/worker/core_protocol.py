"""Messages between a worker's front process and its engine-core process (msgpack via msgspec).

    front --(PUSH/PULL: AddRequest, Abort, Call, Shutdown)--> engine core
    front <--(PUSH/PULL: Ready, StepOutput, CallResult)------ engine core

The hot path is `StepOutput`: one message per engine step carrying every request's new token ids
as flat parallel arrays (no per-request or per-token messages). Structs are encoded as arrays
(`array_like`), so a 64-request step is a few hundred bytes. Requests are numbered by the front
(`rid`); the engine core never sees client request ids.
"""

from __future__ import annotations

from typing import Any

import msgspec

from slora_core.sampling_params import SamplingParams
from slora_core.startup_profile import PhaseRecord


class SamplingMsg(msgspec.Struct, array_like=True, frozen=True):
    """SamplingParams without what only the front uses (stop strings, which it matches on the
    text, and the text options)."""

    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int | None
    max_new_tokens: int
    min_new_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    top_logprobs: int
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None

    @classmethod
    def of(cls, p: SamplingParams) -> SamplingMsg:
        return cls(*(getattr(p, name) for name in cls.__struct_fields__))

    def params(self) -> SamplingParams:
        """The engine's SamplingParams (validated again: ValueError on a bad field)."""
        return SamplingParams(**{name: getattr(self, name) for name in self.__struct_fields__})


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    rid: int
    prompt_token_ids: list[int]
    sampling: SamplingMsg
    adapter: str | None = None
    tenant: str = ""
    deadline_s: float | None = None
    # Constrained decoding: (kind, value) of a slora_core StructuredOutput; None: none.
    structured: tuple[str, str] | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    rids: list[int]


class Call(msgspec.Struct, tag=True, array_like=True):
    """A command for the engine core (adapter loading, residency); answered by a CallResult
    with the same `cid`. `method` names a method of `engine_core.Commands`."""

    cid: int
    method: str
    args: list[Any]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Finish(msgspec.Struct, array_like=True):
    """A request ends. `code` is a gRPC status name when it ended in an error the client should
    see as such (empty for "stop", "length", "abort")."""

    rid: int
    reason: str
    error: str = ""
    code: str = ""
    adapter_error: bool = False
    kind: str = ""  # RequestOutput.error_kind (the worker counts NONFINITE in evidence)


class EngineState(msgspec.Struct, array_like=True):
    running: int = 0
    waiting: int = 0
    kv_pages: int = 0
    adapter_pages: int = 0
    free_pages: int = 0
    adapter_loads: int = 0
    adapter_evictions: int = 0
    steps: int = 0
    adapter_merges: int = 0  # EngineConfig.merge_sole_adapter
    merged_steps: int = 0
    # Adapters running or waiting in the engine now (the Gateway API Inference Extension's
    # running/waiting LoRA adapters).
    running_adapters: list[str] = []
    waiting_adapters: list[str] = []
    # Adapters warm in host memory or arena pages; taken at most every WARM_EVERY_S (None in
    # between: unchanged), so heartbeats never wait for the core.
    warm_adapters: list[str] | None = None
    # Prefix caching since the core started, in prompt tokens (vLLM's vllm:prefix_cache_queries
    # and _hits): tokens looked up when requests were admitted, and those found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Late admission since the core started (EngineConfig.admission_lead_ms; all 0 without a
    # pacer): the serving loop's waits for new requests, their time in all, the requests taken
    # inside them, the steps launched after one, and the GPU's idle time before those steps.
    admission_waits: int = 0
    admission_wait_s: float = 0.0
    admission_taken: int = 0
    admission_paced_steps: int = 0
    admission_gpu_idle_s: float = 0.0


class PromptScores(msgspec.Struct, array_like=True):
    """The logprobs of one request's prompt tokens at positions start, start + 1, ... (with
    their top alternatives), as a prefill chunk computed them."""

    rid: int
    start: int
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


class StepOutput(msgspec.Struct, tag=True, array_like=True):
    """Everything one engine step produced. Token i belongs to request `rids[i]` (a request
    appears once per new token, in order); `logprobs[i]` is its log-probability; `top[i]` its
    top alternatives as [id, logprob] pairs, present only when some request asked for them.
    `started` lists requests that were scheduled for the first time (queue time ends).
    `cached` gives (rid, prompt tokens served from the prefix cache) with each request's first
    tokens, when some were cached (RequestOutput.cached_tokens; fixed at first scheduling)."""

    rids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    finished: list[Finish]
    started: list[int]
    state: EngineState
    prompt: list[PromptScores] = []  # prompt logprobs this step computed (prefill chunks)
    cached: list[tuple[int, int]] = []


class Ready(msgspec.Struct, tag=True, array_like=True):
    max_num_seqs: int
    max_model_len: int
    eos_token_ids: list[int]
    # The core's start-up profile (services/worker/startup.py) and its compile cache's folder
    # and state ("" without one).
    startup: list[PhaseRecord] = []
    compile_cache: str = ""
    graphs_pending: int = 0  # CUDA graphs left to capture while serving (StartupUpdate)


class StartupUpdate(msgspec.Struct, tag=True, array_like=True):
    """Start-up work done after Ready (CUDA graphs captured between steps while the engine
    already serves, eagerly where a graph is missing): its records, and the graphs left."""

    records: list[PhaseRecord]
    graphs_pending: int


class CallResult(msgspec.Struct, tag=True, array_like=True):
    cid: int
    value: Any = None
    error: str = ""
    code: str = ""         # gRPC status name of the error
    adapter_error: bool = False


ToCore = AddRequest | Abort | Call | Shutdown
FromCore = StepOutput | CallResult | Ready | StartupUpdate

to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
encoder = msgspec.msgpack.Encoder()
