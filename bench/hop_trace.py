"""Read a folder of hop traces (`services.common.hop_trace`) into each leg's median per path.

`python -m bench.hop_trace DIR` prints, for each tag the clients gave their requests (the
service bench tags them `<path> <level>`), the median, p90 and mean milliseconds of every leg
between consecutive events a request met, in `HOPS` order, and how many requests had both
ends. `bench.service_overhead --trace-hops DIR` writes the same into its JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from services.common.hop_trace import HOPS

# How much earlier than the front's `worker_added` a core's `core_added` may be stamped (both
# are wall-clock times from two processes).
ADDED_SKEW_S = 1e-3


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
        for line in path.read_text().splitlines():
            event, _, rest = line.partition(" ")
            key, _, stamp = rest.rpartition(" ")
            try:
                at = float(stamp)
            except ValueError:
                continue  # a line cut off by a killed process
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
    args = ap.parse_args()
    summary = legs(read(args.folder))
    print(json.dumps(summary, indent=1) if args.json else table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
