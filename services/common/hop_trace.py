"""Where a request's first token spends its time between the client and the engine: a debug hook.

Off unless `SLORA_TRACE_HOPS=DIR` is set in a process's environment. Then each process appends
one line per event to `DIR/<pid>.hops`: `<event> <key> <time.time()>`. The key joins a request
across processes: its `request_id` on the client, gateway and worker front (the gateway passes
its id upstream), and the core's request number inside the worker (the front's `worker_added`
event carries both). `bench.hop_trace` reads a folder of these into one timeline per request
and the median of each leg. A mark costs a few microseconds when on and one environment lookup
when off; never leave it on in production (the files grow by ~6 lines a request a process).
`SLORA_TRACE_HOPS_EVENTS=core_,loop_` (comma-separated prefixes) writes only the events whose
names begin with one of them: the other processes then write nothing (each mark is two
environment lookups), so a run can tell which process's tracing changes what it measures.

The events, in the order a request meets them (`HOPS`):
client_send (the arrival the client was given) / client_sent (when it actually sent),
gateway_entry, gateway_write (over a mux only: the up-frame holding the request goes to
gRPC; marked before the write, as its completion reaches the gateway's loop late, even after
the worker has read the frame), worker_mux_in (the worker's mux reader has that frame),
worker_entry, worker_added (`request_id:core rid`), core_added, core_started
(the loop entered the `step()` that launched the request's first step: `core_added ->
core_started` is its wait to join one, late admission's window included), core_first (the
step output holding the first token leaves the core), worker_first_in (the front has it),
worker_first_out (the front yields it), gateway_first_in, gateway_first_out, client_first.
Then its end, which a closed-loop client waits for before it sends its next request:
core_finish (the step output that finishes it leaves the core), worker_complete (the front
yields its `complete`), gateway_complete_in (it reaches the gateway's call, with the last
chunks), gateway_complete (the gateway passes it on, once the last chunk's write is done),
gateway_end (the gateway's call is over: the client's stream ends after it), client_complete
(the client has the `complete`) and client_done (its stream ended).
"""

from __future__ import annotations

import os
import time
from functools import cache
from typing import IO

ENV = "SLORA_TRACE_HOPS"
EVENTS_ENV = "SLORA_TRACE_HOPS_EVENTS"
HOPS = ("client_send", "client_sent", "gateway_entry", "gateway_write", "worker_mux_in",
        "worker_entry", "worker_added",
        "core_added", "core_started", "core_first", "worker_first_in", "worker_first_out",
        "gateway_first_in", "gateway_first_out", "client_first",
        "core_finish", "worker_complete", "gateway_complete_in", "gateway_complete", "gateway_end",
        "client_complete",
        "client_done")

_file: IO[str] | None = None


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def mark(event: str, key: object, at: float | None = None) -> None:
    """Record `event` for `key` now (or at wall-clock `at`), when tracing is on."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    only = os.environ.get(EVENTS_ENV)
    if only and not event.startswith(_prefixes(only)):
        return
    global _file
    if _file is None:
        os.makedirs(folder, exist_ok=True)
        _file = open(os.path.join(folder, f"{os.getpid()}.hops"), "a", buffering=1)  # noqa: SIM115
    _file.write(f"{event} {key} {time.time() if at is None else at:.6f}\n")


@cache
def _prefixes(only: str) -> tuple[str, ...]:
    """`SLORA_TRACE_HOPS_EVENTS`'s prefixes (parsed once per value, not once per mark)."""
    return tuple(filter(None, only.split(",")))
