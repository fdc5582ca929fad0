"""Read a folder of hop traces (`services.common.hop_trace`) into each leg's median per path.

`python -m bench.hop_trace DIR` prints, for each tag the clients gave their requests (the
service bench tags them `<path> <level>`), the median, p90 and mean milliseconds of every leg
between consecutive events a request met, in `HOPS` order, and how many requests had both
ends. `bench.service_overhead --trace-hops DIR` writes the same into its JSON.

`loops` reads the engine core's own rhythm from the same files (`loop_step` at each `step()`
entry, `loop_wait` at each late-admission decision): per stretch of a core's steps, how often
the loop waited before a step and how long, and how many requests it read inside such a
wait; `joins`, per client tag, whether a request joined the first `step()` after it reached
the worker, was read before it but not scheduled, or was read only after it began. `--loops`
prints both (`--out FILE` writes the legs, loops and joins as JSON, `--source RUN.json`
copying the traced run's command, commit and hardware into it).
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.run_record import commit_id
from services.common.hop_trace import HOPS

# How much earlier than the front's `worker_added` a core's `core_added` may be stamped (both
# are wall-clock times from two processes).
ADDED_SKEW_S = 1e-3
# The core stamps `core_started` with its `step()` entry a few microseconds before that entry's
# `loop_step` mark.
STAMP_SKEW_S = 1e-4


def _events(path: Path) -> Iterator[tuple[str, str, float]]:
    """A trace file's (event, key, wall-clock time) lines; a line cut off by a killed process
    is left out."""
    for line in path.read_text().splitlines():
        event, _, rest = line.partition(" ")
        key, _, stamp = rest.rpartition(" ")
        try:
            yield event, key, float(stamp)
        except ValueError:
            continue


def read(folder: Path) -> dict[str, dict[str, dict[str, float]]]:
    """client tag -> request key -> event -> wall-clock time (the first of repeated marks);
    core events are moved onto the request's key through `worker_added`. The core numbers
    its requests afresh each time a worker starts, so a request number met in several core
    files joins the front's request whose `worker_added` came last before its `core_added`.
    Requests no client tagged (warm-up) are left out."""
    by_key: dict[str, dict[str, float]] = defaultdict(dict)
    core: dict[str, list[dict[str, float]]] = defaultdict(list)  # rid -> one per core file
    added: list[tuple[float, str, str]] = []  # (worker_added time, rid, request key)
    tags: dict[str, str] = {}
    for path in sorted(folder.glob("*.hops")):
        in_file: dict[str, dict[str, float]] = defaultdict(dict)
        for event, key, at in _events(path):
            if not key:
                continue
            if event == "client_tag":
                k, _, tag = key.partition("=")
                tags[k] = tag
                continue
            if event == "worker_added":
                key, _, rid = key.rpartition(":")
                added.append((at, rid, key))
            target = in_file[key] if event.startswith("core_") else by_key[key]
            target.setdefault(event, at)
        for rid, events in in_file.items():
            core[rid].append(events)
    taken: set[int] = set()
    for at, rid, key in sorted(added, reverse=True):  # the latest first: it takes the latest
        later = [c for c in core.get(rid, ()) if id(c) not in taken
                 and c.get("core_added", min(c.values())) >= at - ADDED_SKEW_S]
        if later:
            events = min(later, key=lambda c: c.get("core_added", min(c.values())))
            taken.add(id(events))
            for event, t in events.items():
                by_key[key].setdefault(event, t)
    grouped: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for key, events in by_key.items():
        if tags.get(key):
            grouped[tags[key]][key] = events
    return dict(grouped)


# Legs in HOPS order (by their first event, then their second); the TTFT leg last.
LEG_ORDER = {f"{a} -> {b}": n for n, (a, b) in enumerate(
    (a, b) for i, a in enumerate(HOPS) for b in HOPS[i + 1:])}


def legs(traced: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per tag: each leg between consecutive events (ms), over the requests that met both."""
    out: dict[str, Any] = {}
    for tag, reqs in sorted(traced.items()):
        got: dict[str, list[float]] = defaultdict(list)
        for ev in reqs.values():
            seen = [h for h in HOPS if h in ev]
            for a, b in zip(seen, seen[1:], strict=False):
                got[f"{a} -> {b}"].append((ev[b] - ev[a]) * 1e3)
            if "client_send" in ev and "client_first" in ev:
                got["client_send -> client_first (TTFT)"].append(
                    (ev["client_first"] - ev["client_send"]) * 1e3)
        out[tag] = {"requests": len(reqs), "legs_ms": {
            leg: {"n": len(v), "p50": float(np.median(v)), "p90": float(np.percentile(v, 90)),
                  "mean": float(np.mean(v))}
            for leg, v in sorted(got.items(), key=lambda kv: LEG_ORDER.get(kv[0], len(LEG_ORDER)))}}
    return out


# A pause this long between two `step()` entries ends a stretch of a core's steps (the bench
# runs its levels and paths one after another, the core idle between them).
STRETCH_GAP_S = 1.0
# The share of a stretch a client tag's requests must span to name it.
TAG_OVERLAP = 0.1


@dataclass
class Core:
    """One core process's loop events (wall-clock s)."""

    steps: list[float] = field(default_factory=list)
    waits: list[tuple[float, float]] = field(default_factory=list)  # (at, wait s)
    added: dict[str, float] = field(default_factory=dict)  # rid -> core_added


def cores(folder: Path) -> dict[str, Core]:
    """Core processes' files (those with `loop_step` events), by file name: what `loops` and
    `joins` read (once for both)."""
    found: dict[str, Core] = {}
    for path in sorted(folder.glob("*.hops")):
        core = Core()
        for event, key, at in _events(path):
            if event == "loop_step":
                core.steps.append(at)
            elif event == "loop_wait":
                core.waits.append((at, float(key.partition(":")[0]) / 1e6))
            elif event == "core_added":
                core.added.setdefault(key, at)
        if core.steps:
            core.steps.sort()
            core.waits.sort()
            found[path.name] = core
    return found


def _tag_spans(traced: dict[str, dict[str, dict[str, float]]]) -> dict[str, tuple[float, float]]:
    """Each client tag's first send to its last event (wall-clock s)."""
    spans = {}
    for tag, reqs in traced.items():
        sends = [ev["client_send"] for ev in reqs.values() if "client_send" in ev]
        ends = [max(ev.values()) for ev in reqs.values()]
        if sends:
            spans[tag] = (min(sends), max(ends))
    return spans


def loops(by_core: dict[str, Core], traced: dict[str, dict[str, dict[str, float]]] | None = None,
          ) -> list[dict[str, Any]]:
    """Per core file (`cores`) and stretch of its steps (split at pauses of `STRETCH_GAP_S`):
    the steps, the waits before them (`loop_wait` > 0) and their mean, and the requests read
    in the stretch and inside a wait. `tags`: the client tags whose requests' spans cover more
    than `TAG_OVERLAP` of the stretch (`traced`: `read`'s; one core serves every path of a
    worker run)."""
    spans = _tag_spans(traced) if traced else {}
    out: list[dict[str, Any]] = []
    for name, core in by_core.items():
        bounds = [0] + [i + 1 for i in range(len(core.steps) - 1)
                        if core.steps[i + 1] - core.steps[i] > STRETCH_GAP_S] + [len(core.steps)]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            first, last = core.steps[lo], core.steps[hi - 1]
            positive = [w for at, w in core.waits if first <= at <= last and w > 0.0]
            added = [at for at in core.added.values() if first <= at <= last]
            in_wait = 0
            for at in added:
                i = bisect.bisect_right(core.waits, (at, float("inf"))) - 1
                if i >= 0:
                    wait_at, wait = core.waits[i]
                    nxt = bisect.bisect_right(core.steps, wait_at)
                    if wait > 0.0 and (nxt == len(core.steps) or at < core.steps[nxt]):
                        in_wait += 1
            tags = sorted(tag for tag, (a, b) in spans.items()
                          if min(b, last) - max(a, first) > TAG_OVERLAP * (last - first))
            out.append({
                "core": name, "tags": tags,
                "seconds": last - first, "steps": hi - lo, "waits": len(positive),
                "wait_ms_mean": float(np.mean(positive)) * 1e3 if positive else 0.0,
                "requests": len(added), "read_in_wait": in_wait})
    return out


def joins(by_core: dict[str, Core], traced: dict[str, dict[str, dict[str, float]]],
          ) -> dict[str, Any]:
    """Per client tag: of the requests the cores (`cores`) traced, the share whose first step was
    launched by the first `step()` after they reached the worker (`worker_added`), the share
    read into the core before that `step()` but not scheduled by it (the step's budget or
    limits), and the share read only after it had begun; and each group's median ms from
    `worker_added` to `core_first`."""
    steps = sorted(t for core in by_core.values() for t in core.steps)
    out: dict[str, Any] = {}
    for tag, reqs in sorted(traced.items()):
        groups: dict[str, list[float]] = defaultdict(list)
        for ev in reqs.values():
            if not all(k in ev for k in ("worker_added", "core_added", "core_started",
                                         "core_first")):
                continue
            i = bisect.bisect_right(steps, ev["worker_added"])
            if i == len(steps):
                continue
            if ev["core_started"] >= steps[i] - STAMP_SKEW_S and (
                    i + 1 == len(steps) or ev["core_started"] < steps[i + 1] - STAMP_SKEW_S):
                group = "joined_next_step"
            elif ev["core_added"] < steps[i]:
                group = "read_before_it_not_taken"
            else:
                group = "read_after_it_began"
            groups[group].append((ev["core_first"] - ev["worker_added"]) * 1e3)
        total = sum(map(len, groups.values()))
        if total:
            out[tag] = {"requests": total, **{g: {
                "share": len(v) / total, "worker_added_to_core_first_ms_p50": float(np.median(v))}
                for g, v in sorted(groups.items())}}
    return out


def join_table(summary: dict[str, Any]) -> str:
    lines = []
    for tag, s in summary.items():
        groups = ", ".join(
            f"{g} {v['share']:.0%} ({v['worker_added_to_core_first_ms_p50']:.1f} ms)"
            for g, v in s.items() if g != "requests")
        lines.append(f"{tag} ({s['requests']} requests): {groups}")
    return "\n".join(lines)


def loop_table(rows: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{r['core']} {' + '.join(r['tags']) or '-'} ({r['seconds']:.1f} s): {r['steps']} "
        f"steps, waits before {r['waits']} (mean {r['wait_ms_mean']:.2f} ms), {r['requests']} "
        f"requests, {r['read_in_wait']} read in a wait" for r in rows)


def table(summary: dict[str, Any]) -> str:
    lines = []
    for tag, s in summary.items():
        lines.append(f"{tag} ({s['requests']} requests)")
        for leg, v in s["legs_ms"].items():
            lines.append(f"  {leg:<48} p50 {v['p50']:7.2f}  p90 {v['p90']:7.2f}  "
                         f"mean {v['mean']:7.2f} ms  (n={v['n']})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--loops", action="store_true", help="also the core loop's stretches")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the legs, the loops' stretches and the joins to this JSON file")
    ap.add_argument("--source", type=Path, default=None,
                    help="the traced run's result JSON: its command, commit and hardware are "
                         "recorded in --out's")
    args = ap.parse_args()
    traced = read(args.folder)
    summary = legs(traced)
    by_core = cores(args.folder) if args.loops or args.out else {}
    stretches, joined = loops(by_core, traced), joins(by_core, traced)
    print(json.dumps(summary, indent=1) if args.json else table(summary))
    if args.loops:
        print(loop_table(stretches))
        print(join_table(joined))
    if args.out:
        record: dict[str, Any] = {
            "command": " ".join(["python", "-m", "bench.hop_trace", *sys.argv[1:]]),
            "commit": commit_id(), "hardware": "cpu (reading traces)"}
        if args.source:
            run = json.loads(args.source.read_text())
            record["source"] = {"file": args.source.name, "command": run.get("command"),
                                "commit": run.get("commit"), "hardware": run.get("hardware")}
        args.out.write_text(json.dumps({**record, "legs": summary, "loops": stretches,
                                        "joins": joined},
                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
