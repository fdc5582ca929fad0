"""The performance tables, generated from the result JSONs (never typed by hand): every row in
docs/performance.md's service-path block, and the few of them README.md shows as headlines.

    python -m bench.readme_table          # rewrite both blocks
    python -m bench.readme_table --check  # exit 1 when either file differs from the JSONs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slora_core.config import EngineConfig
from slora_core.cuda_graphs import ROW_KERNELS_MAX_ROWS_PER_ADAPTER
from slora_kernels.lora_meta import DECODE_BLOCK_M

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PERFORMANCE, README = ROOT / "docs" / "performance.md", ROOT / "README.md"
BEGIN, END = "<!-- service-table:begin -->", "<!-- service-table:end -->"
HEAD_BEGIN, HEAD_END = "<!-- headline-table:begin -->", "<!-- headline-table:end -->"
# README's headlines: the first generated row starting with each prefix and citing that JSON.
HEADLINES = (
    ("| one rank-16 adapter on every request vs base, merged", "engine-speed-merge-h200.json"),
    ("| decode step, batch 64, context 512, 64 rank-16 adapters, LoRA in line",
     "engine-speed-async-h200.json"),
    ("| 2,000 adapters vs 5, alpha 1.0, 50 arrivals/s", "churn-rate50-tiles16-8a69460-h200.json"),
    ("| 2,000 adapters vs 5, alpha 0.5, 50 arrivals/s", "churn-rate50-tiles16-8a69460-h200.json"),
    ("| client -> gateway -> worker, gRPC", "service-overhead-7b-gw4-378382f-h200.json"),
    ("| client -> gateway -> worker, gRPC, per call, then over GenerateMux from "
     "32 streams in flight on a worker on (4 gateway processes), 256 streams",
     "service-overhead-7b-gw4-378382f-h200.json"),
    ("| client -> gateway -> worker, HTTP", "service-overhead-7b-gw4-378382f-h200.json"),
    ("| client -> gateway -> worker, HTTP (OpenAI SSE) read by aiohttp (4 gateway processes), "
     "256 streams", "service-overhead-7b-gw4-378382f-h200.json"),
    ("| one adapter, merge off, riding the base GEMMs", "distinct-adapters-378382f-h200.json"),
    ("| cold load of one adapter, r16 attention", "cold-load-h200.json"),
    ("| decode LoRA grid beside vLLM's kernels", "lora-grid-h200.json"),
    ("| decode LoRA r16 B256 U256, graph replay", "lora-grid-h200.json"),
    ("| decode LoRA r64 B256 U1, graph replay", "lora-grid-h200.json"),
    ("| prefix cache on vs off, multi-turn chat", "prefix-cache-h200.json"),
    ("| half the streams JSON-schema constrained", "structured-output-h200.json"),
)
PATHS = {"worker": "client -> worker (the worker hop alone)",
         "gateway": "client -> gateway -> worker, gRPC",
         "gateway_call": "client -> gateway -> worker, gRPC, one worker call a request",
         "gateway_mux": "client -> gateway -> worker, gRPC, over one GenerateMux stream",
         "gateway_auto": "client -> gateway -> worker, gRPC, per call, then over GenerateMux "
                         "from {mux_from} streams in flight on a worker on",
         "gateway_warm": "client -> gateway -> worker, gRPC, one worker call a request on "
                         "idle calls opened ahead",
         "http": "client -> gateway -> worker, HTTP (OpenAI SSE) read by httpx",
         "http_aiohttp": "client -> gateway -> worker, HTTP (OpenAI SSE) read by aiohttp"}


def _fig(f: dict[str, float], digits: int = 3, unit: str = "") -> str:
    return (f"{f['median']:.{digits}f}{unit} [{f['min']:.{digits}f}, {f['max']:.{digits}f}]")


def service_rows(result: dict[str, Any], source: str, upstream: str = "call") -> list[str]:
    """The rows of a service run; `upstream`: how its default gateway called the worker where
    the JSON does not say (`upstreams`, since 4c37676)."""
    rows = []
    procs = result.get("gateway_procs", 1)
    gw = f" ({procs} gateway processes)" if procs > 1 else ""
    upstream = result.get("upstreams", {}).get("gateway", upstream)
    # The suites ran 4 client processes until a430258 (8 since): said where it differs.
    clients = result.get("client_procs", 4)
    load_by = f", {clients} client processes" if clients != 4 else ""
    if result.get("launch_wait_ms"):  # the removed launch wait's runs (until 9d86df5)
        gw += f", the core's launch held ({result['launch_wait_ms']} ms margin)"
    n, spread = result["new_tokens"], result.get("new_tokens_spread", 0)
    tokens = f"{n}" if not spread else f"{n - spread}-{n + spread}"
    for level in result["levels"]:
        c = level["concurrency"]
        load = (f"{c} streams x {tokens} tokens" if "rate" not in level else
                f"{level['rate']:g} requests/s arriving open-loop x {tokens} tokens") + load_by
        if level.get("worker_admission_lead_ms") is not None:  # --worker-admission-leads
            load += f", the worker's late-admission lead {level['worker_admission_lead_ms']:g} ms"
        for path, figs in level["ratios"].items():
            ttft = (f"TTFT added p50 {_fig(figs['ttft_p50_added_ms'], 1, ' ms')}, p99 "
                    f"{_fig(figs['ttft_p99_added_ms'], 1, ' ms')}")
            if "request_ttft_p50_added_ms" in figs:  # from each request's send (since ad90aae)
                ttft = (f"TTFT from the request's send added p50 "
                        f"{_fig(figs['request_ttft_p50_added_ms'], 1, ' ms')}, p99 "
                        f"{_fig(figs['request_ttft_p99_added_ms'], 1, ' ms')}; from the "
                        f"run's start p50 {_fig(figs['ttft_p50_added_ms'], 1, ' ms')}")
            # Open-loop levels have no target of their own: issue 37's are per closed-loop
            # stream count (docs/performance.md maps them).
            target = "" if "rate" in level else _service_target(result, path, c)
            what = PATHS.get(path, path)
            if path.startswith("in_process_after_"):  # service_overhead.late_path
                late, _, spread_ms = path.removeprefix("in_process_after_").partition(
                    "_spread")
                late += f" (plus up to {spread_ms}, uniformly)" if spread_ms else ""
                what = (f"in process, each next request arriving {late} after the step that "
                        f"ended the one before (added at the next step)")
            if path == "gateway" and upstream != "call":
                what = PATHS[f"gateway_{upstream}"]
            # auto's threshold as the run had it (32 until the JSONs recorded it, f02af64)
            what = what.format(mux_from=result.get("gateway_mux_from", 32))
            rows.append(
                f"| {what}{gw if path.startswith(('gateway', 'http')) else ''}, {load}"
                f"{on_card(result)} "
                f"| {_fig(figs['throughput_ratio'])}x of in-process; {ttft} "
                f"| {target} | {source} |")
    return rows


def _service_target(result: dict[str, Any], path: str, streams: int) -> str:
    """Issue 37's targets where the JSON records them (per path and streams), else the old."""
    targets = result.get("targets", {})
    if "gateway request_ttft_p50_added_ms" not in targets:
        return "0.9x" if path == "http" else "0.95x, 3 ms, 10 ms"
    kind = "http" if path.startswith("http") else path
    got = [f"{figure.split(' ', 1)[1].replace('request_', '')} {bound[str(streams)]}"
           for figure, bound in targets.items()
           if figure.split(" ", 1)[0] == kind and str(streams) in bound]
    return "; ".join(got)


def hop_trace_rows(result: dict[str, Any], source: str) -> list[str]:
    """`--trace-hops`: the p50 of each leg a request's first token crossed, per path and load
    (the engine's own legs, from the core's intake to its first token, included)."""
    rows = []
    for tag, got in result.get("hop_trace", {}).items():
        legs = "; ".join(f"{leg.replace(' -> ', ' to ')} {v['p50']:.2f}"
                         for leg, v in got["legs_ms"].items())
        rows.append(f"| hop trace, {tag} ({got['requests']} requests), p50 ms of each leg | "
                    f"{legs} | | {source} |")
    return rows


def traced_service_rows(result: dict[str, Any], source: str) -> list[str]:
    """A service run's rows, then its hop trace's."""
    return service_rows(result, source) + hop_trace_rows(result, source)


def fusion_rows(result: dict[str, Any], source: str) -> list[str]:
    """bench.lora_layer_fusion: one decode layer's four projections with one adapter."""
    return [f"| one 7B decode layer's four projections, one rank-{r['rank']} adapter on all 7 "
            f"modules, {r['batch']} rows, graph replay | base GEMMs {r['base_us']:.1f} us; our "
            f"shrink+expand +{r['lora_added_us']:.1f} us; shrink riding the base GEMM, expand "
            f"by cuBLAS +{r['n_concat_added_us']:.1f} us; expand riding it "
            f"+{r['k_concat_added_us']:.1f} us | | {source} |" for r in result["rows"]]


def fusion_ops_rows(result: dict[str, Any], source: str) -> list[str]:
    """bench.lora_layer_fusion's ops variants: the ride's expands fused into the ops reading
    the projections (rotary, silu_mul), against the ride's addmm, over base. Variants since
    removed (the PDL launches, the norm fusion) appear where a run measured them."""
    parts = (("fused_ops", "qkv's and gate_up's fused into rotary and silu_mul, PDL"),
             ("fused_ops_nopdl", "qkv's and gate_up's fused into rotary and silu_mul"),
             ("fused_ops_all", "also o's and down's in Triton, PDL"),
             ("fused_ops_all_nopdl", "also o's and down's in Triton"))
    rows = []
    for r in result["rows"]:
        cell = "; ".join([f"base GEMMs and ops {r['base_ops_us']:.1f} us",
                          f"ride with addmm expands +{r['n_concat_ops_added_us']:.1f} us",
                          *(f"{label} +{r[f'{name}_added_us']:.1f} us"
                            for name, label in parts if f"{name}_added_us" in r)])
        if "fused_norm_added_us" in r:  # 5be1284 only: the variants were removed after it
            cell += (f"; with the residual norms after o and down, base "
                     f"{r['base_norm_us']:.1f} us, o's and down's addmm "
                     f"+{r['fused_norm_addmm_added_us']:.1f} us, fused into the norms "
                     f"+{r['fused_norm_added_us']:.1f} us")
        swept = sorted(k for k in r if k.startswith("fused_ops_all_m") and k.endswith("_added_us"))
        if swept:  # --sweep-blocks: the Triton expands in other launch shapes
            cell += "; launched M rows/W warps a program: " + ", ".join(
                f"{k[len('fused_ops_all_m'):-len('_added_us')].replace('_w', '/')} "
                f"+{r[k]:.1f}" for k in swept) + " us"
        rows.append(f"| one 7B decode layer's four projections and the ops reading them, the "
                    f"ride's rows for rank {r['rank']}, {r['batch']} rows, graph replay | {cell} "
                    f"| | {source} |")
    return rows


def many_ride_rows(result: dict[str, Any], source: str) -> list[str]:
    """bench.lora_many_ride: every distinct adapter's A rows riding the base GEMMs, against
    today's LoRA launches, over the base GEMMs."""
    return [f"| one 7B decode layer's four projections, 64 rows on {r['adapters']} adapters "
            f"(ranks 8-64, all 7 modules; {r['lora_path']} today), graph replay{on_card(result)} "
            f"| base GEMMs {r['base_us']:.1f} us; LoRA launches +{r['kernels_added_us']:.1f} us; "
            f"every adapter's A riding the GEMMs, a gather, the expand "
            f"+{r['many_ride_added_us']:.1f} us (the wider GEMMs alone "
            f"{r['wide_gemm_added_us']:+.1f}) | | {source} |" for r in result["rows_out"]]


def grpc_cost_rows(result: dict[str, Any], source: str) -> list[str]:
    """bench.grpc_stream_cost: server CPU a streamed message, per server kind (median of the
    repeats)."""
    kinds: dict[str, list[float]] = {}
    for r in result["rows"]:
        kinds.setdefault(r["server"], []).append(r["server_cpu_us_per_message"])
    return [f"| a Python gRPC server streaming {result['messages_per_stream']} messages on each of "
            f"{result['concurrency']} calls, one a call every {result['step_ms']:g} ms, "
            f"{kind.replace('_', ' ')}, {result['cpus']} CPUs | server CPU "
            f"{statistics.median(v):.1f} us a message [{min(v):.1f}, {max(v):.1f}] | | {source} |"
            for kind, v in kinds.items()]


def hop_rows(result: dict[str, Any], source: str) -> list[str]:
    """The gateway hop alone: the gateway path against the worker path of the same repeat."""
    rows = []
    for level in result["levels"]:
        runs = level["runs"]
        pairs = list(zip(runs["worker"], runs["gateway"], strict=True))
        ratio = sorted(g["output_tok_per_s"] / w["output_tok_per_s"] for w, g in pairs)
        added = sorted((g["ttft_p50_s"] - w["ttft_p50_s"]) * 1e3 for w, g in pairs)
        mid = len(pairs) // 2
        rows.append(f"| the gateway hop alone (gateway path vs worker path), "
                    f"{level['concurrency']} streams | {ratio[mid]:.3f} [{ratio[0]:.3f}, "
                    f"{ratio[-1]:.3f}]x; TTFT p50 added {added[mid]:.1f} ms [{added[0]:.1f}, "
                    f"{added[-1]:.1f}] | | {source} |")
    return rows


def async_rows(result: dict[str, Any], source: str) -> list[str]:
    """bench.profile_async: the floor scenario's step, synchronous vs asynchronous."""
    modes = result["modes"]
    rows = []
    for name, what in (("sync", "synchronous"), ("async", "asynchronous")):
        m = modes.get(name)
        if not m:
            continue
        host = m["host_ms_per_step"]
        work = sum(v for k, v in host.items()
                   if k not in ("wait", "sample_sync_incl_wait", "step_wall"))
        rows.append(f"| decode step, batch {result['batch']}, context {result['context']}, "
                    f"{result['batch']} rank-16 adapters, {what} steps | {m['step_ms']:.2f} ms a "
                    f"step; the CUDA graph inside it {m['graph_in_step']['graph_ms']:.2f} ms, "
                    f"device time between graphs {m['graph_in_step']['between_ms']:.2f} ms; host "
                    f"work {work:.2f} ms a step | | {source} |")
    return rows


def engine_rows(result: dict[str, Any], arm: str, source: str) -> list[str]:
    """One adapter vs base and the decode step against its floor (bench.serving), one arm."""
    rows = []
    ovh, floor = result.get("overhead", {}), result.get("floor", {})
    if "throughput_ratio" in ovh:
        rows.append(f"| one rank-16 adapter on every request vs base, LoRA {arm}, "
                    f"{len(ovh['repeats'])} interleaved pairs | {ovh['throughput_ratio']:.3f} "
                    f"[{ovh['ratio_min']:.3f}, {ovh['ratio_max']:.3f}]x | 0.98x | {source} |")
    if "unmerged" in ovh:
        u = ovh["unmerged"]
        rows[-1] = rows[-1].replace(", LoRA ", ", merged into the weights (merge_sole_adapter)"
                                    ", LoRA ", 1)
        rows.append(f"| same, unmerged (merge off for these runs, interleaved in the same "
                    f"repeats) | {u['throughput_ratio']:.3f} [{u['ratio_min']:.3f}, "
                    f"{u['ratio_max']:.3f}]x | 0.98x | {source} |")
    if "ratio_to_floor" in floor:
        rows.append(f"| decode step, batch {floor['batch']}, context {floor['context']}, "
                    f"{floor['batch']} rank-16 adapters, LoRA {arm} | {floor['step_s'] * 1e3:.2f}"
                    f" ms = {floor['ratio_to_floor']:.2f}x its bytes floor "
                    f"({floor['floor_s'] * 1e3:.2f} ms at copy bandwidth) | 1.3x | {source} |")
    return rows


def on_card(result: dict[str, Any]) -> str:
    """", on an H100" (the card a run had) for runs not on the H200 the tables assume."""
    hw = str(result.get("hardware", ""))
    return "" if "H200" in hw or not hw else f", on an {hw.split()[1] if 'NVIDIA' in hw else hw}"


def churn_rows(result: dict[str, Any], source: str) -> list[str]:
    rows = []
    churn = result.get("churn", {})
    rate = result.get("args", {}).get("churn_rate")
    at = f", {rate:g} arrivals/s" if rate else ""
    if "+rows-unbalanced" in str(result.get("commit", "")):
        at += ", row kernels' K split the same for every rank (before 0eecaa2)"
    at += on_card(result)
    # Decode LoRA path (runs from before the option existed ran the tiles).
    at += (", row kernels for many-adapter steps" if result.get("args", {}).get(
        "lora_row_kernels") else ", 16-row tiles only")
    for key, what, target in (("alpha1.0_host", "alpha 1.0", "0.95x, 2x"),
                              ("alpha0.5_host", "alpha 0.5", "0.95x, 3x (issue 37)")):
        run = churn.get(key)
        if run:
            rows.append(
                f"| 2,000 adapters vs 5, {what}{at}, reloads from pinned host "
                f"| {run['throughput_ratio']:.3f}x throughput, p99 TTFT "
                f"{run['p99_ttft_ratio']:.2f}x; {run['distinct_requested']} adapters used, "
                f"{run['gpu_loads']} loads, {run['evictions']} evictions in the window "
                f"| {target} | {source} |")
    disk = result.get("churndisk", {})
    if "loads_from_disk" in disk:
        # Without an n=5 run before it in the same process the run has no ratios.
        figs = (f"{disk['throughput_ratio']:.3f}x throughput, p99 TTFT "
                f"{disk['p99_ttft_ratio']:.2f}x" if "throughput_ratio" in disk else
                f"{disk['output_tok_per_s']:.0f} tok/s, TTFT p50 {disk['ttft_s']['p50']:.1f} s, "
                f"p99 {disk['ttft_s']['p99']:.1f} s")
        rows.append(f"| 2,000 adapters, alpha 1.0, small host tier (disk reloads) "
                    f"| {figs}; {disk['loads_from_disk']} loads from disk, "
                    f"{disk['loads_from_host']} from host | | {source} |")
    return rows


def cold_rows(result: dict[str, Any], source: str) -> list[str]:
    rows = []
    for r in result["rows"]:
        rows.append(f"| cold load of one adapter, r{r['rank']} {r['modules']} "
                    f"({r['bytes'] / 2**20:.0f} MiB) | from pinned host {r['host_ms']:.2f} ms = "
                    f"{r['host_over_plain_copy']:.2f}x a plain copy ({r['plain_copy_ms']:.2f} ms);"
                    f" from disk {r['disk_ms']:.0f} ms (read + parse + validate alone "
                    f"{r['disk_read_parse_validate_ms']:.0f} ms) | 1.5x (host) | {source} |")
    return rows


def engine_graph_us(r: dict[str, Any]) -> tuple[float, str]:
    """The LoRA graph decode steps replayed for a grid cell when the grid ran, as
    `DecodeGraphs._lora_graph` picked it then: the list of cdiv(B, 16) tiles when the step's
    real tiles fit it (the short list, or at B <= 16 with one tile the bucket's own list), the
    row kernels when adapters own at most ROW_KERNELS_MAX_ROWS_PER_ADAPTER rows each (runs that
    measured them), else the full list. The grids predate the middle and bounded lists and
    their K split (cuda_graphs.decode_lora_graph, fbb4a8f-dc73b24), which they do not time."""
    b, u = r["batch"], r["adapters"]
    few = -(-b // DECODE_BLOCK_M)
    real = u * -(-(b // u) // DECODE_BLOCK_M)  # rows sorted by adapter: a segment each
    if real <= few:
        if "graph_short_list_us" in r:
            return r["graph_short_list_us"], "short tile list"
        if few == b:  # the bucket's list is the short one
            return r["graph_capture_split_us"], "full tile list"
    if "rows_us" in r and b <= ROW_KERNELS_MAX_ROWS_PER_ADAPTER * u:
        return r["rows_us"], "row kernels"
    return r["graph_capture_split_us"], "full tile list"


# Complete grids of earlier commits, newest first, whose cells stand in for those a grid cut at
# its time limit did not reach (each row names its JSON and commit).
EARLIER_GRIDS = ("lora-grid-atomic-rejected-h200.json",)


def _cell(r: dict[str, Any]) -> tuple[int, int, int, str]:
    return r["rank"], r["batch"], r["adapters"], r["order"]


def grid_rows(result: dict[str, Any], source: str) -> list[str]:
    """The issue's cells: the graph path the engine replays beside vLLM's quoted times. A run
    cut short says so, and the cells it did not reach come from the newest complete earlier
    grid, marked as such."""
    rows = []
    cells = [r for r in result["rows"] if "vllm_us_issue" in r]
    if not result.get("complete", True):
        rows.append(f"| decode LoRA grid: cut at its time limit after {len(result['rows'])} "
                    f"of {result['cases']} cases; the cells it did not reach below are from "
                    f"the earlier run named beside them | | | {source} |")
        seen = {_cell(r) for r in result["rows"]}
        for name in EARLIER_GRIDS:
            earlier_path = RESULTS / name
            if earlier_path.exists():
                earlier = json.loads(earlier_path.read_text())
                src = f"`{name}` @ {earlier['commit'][:8]} (not reached at {source})"
                cells += [dict(r, source=src) for r in earlier["rows"]
                          if "vllm_us_issue" in r and _cell(r) not in seen]
                break
    measured = [r for r in result["rows"] if "vllm_us" in r]
    if measured:  # vLLM's kernels run beside ours: every cell of the grid, not the quoted ones
        cells = measured
        faster = sum(engine_graph_us(r)[0] <= r["vllm_us"] for r in cells)
        rows.append(f"| decode LoRA grid beside vLLM's kernels run in the same process: the "
                    f"engine's graph path at or below vLLM's in {faster} of {len(cells)} cells "
                    f"| | every cell | {source} |")
    for r in cells:
        us, path = engine_graph_us(r)
        order = ", rows in random order" if r["order"] == "random" else ""
        theirs = (f"vLLM {r['vllm_us']:.1f} us (run here)" if "vllm_us" in r
                  else f"vLLM {r['vllm_us_issue']} us")
        rows.append(f"| decode LoRA r{r['rank']} B{r['batch']} U{r['adapters']}{order}, graph "
                    f"replay ({path}) | {us:.1f} us (bytes floor {r['floor_us']:.1f}) | "
                    f"{theirs} | {r.get('source', source)} |")
    return rows


def prefix_rows(result: dict[str, Any], source: str) -> list[str]:
    r, chat, un = result["ratios"], result["chat"], result["unshared"]
    on, off = chat["cache_on"], chat["cache_off"]
    w = result["workload"]
    return [
        f"| prefix cache on vs off, multi-turn chat ({w['conversations']} conversations x "
        f"{w['turns']} turns, {w['system_tokens']}-token system prompt, {w['adapters']} adapters)"
        f" | TTFT p50 {off['ttft_s']['p50'] * 1e3:.0f} -> {on['ttft_s']['p50'] * 1e3:.0f} ms "
        f"({r['ttft_p50_off_over_on']:.2f}x lower), throughput "
        f"{r['output_throughput_on_over_off']:.2f}x, hit rate {on['hit_rate']:.2f}, evictions "
        f"{on['evictions']['prefix_pages']} prefix pages / {on['evictions']['adapters']} adapters "
        f"| 3x, 1.5x | {source} |",
        f"| prefix cache on vs off, no shared prefix | throughput "
        f"{r['unshared_throughput_on_over_off']:.3f}x; evictions "
        f"{un['cache_on']['evictions']['prefix_pages']} prefix pages / "
        f"{un['cache_on']['evictions']['adapters']} adapters | 0.99x | {source} |"]


def structured_rows(result: dict[str, Any], source: str) -> list[str]:
    c = result["grammar_compile_ms"]
    streams = result["args"]["streams"]
    return [f"| half the streams JSON-schema constrained, mixed adapters, {streams} streams, vs none "
            f"constrained | {result['ratio_median']:.3f}x throughput (cost "
            f"{result['throughput_cost'] * 100:.1f}%); grammar compile p50 {c['p50']:.1f} ms, "
            f"p99 {c['p99']:.0f} ms | cost <= 5% | {source} |"]


def distinct_rows(result: dict[str, Any], source: str) -> list[str]:
    d = result["distinct"]
    rows = []
    # A run its time limit stopped before its last repeat says so beside every figure.
    cut = f" (cut short: {d['cut_short']})" if "cut_short" in d else ""
    for arm, label in (("distinct16", "16 distinct adapters"), ("distinct64", "64 distinct adapters"),
                       ("one_unmerged", "one adapter, merge off")):
        if arm not in d:  # a run of some arms only (--distinct-arms)
            continue
        r = d[arm]
        bound = (f"; bytes bound {r['bytes_bound']:.3f}x ({r['of_bytes_bound']:.0%} of it)"
                 if "bytes_bound" in r else "")
        what = (f"rank {d.get('one_adapter_rank', 8)}, all 7 modules" if arm == "one_unmerged"
                else "ranks 8-64, all 7 modules")
        rows.append(f"| {label} in a batch of {d['batch']} ({what}) vs base, "
                    f"decode-heavy{on_card(result)} | {r['throughput_ratio']:.3f} [{r['ratio_min']:.3f}, "
                    f"{r['ratio_max']:.3f}]x{cut}{bound} | {r['target']}x | {source} |")
    if "one_kernels" in d:  # the one-adapter arm rode; the same requests on the kernels
        k = d["one_kernels"]
        rows[-1] = rows[-1].replace("merge off", "merge off, riding the base GEMMs")
        rows.append(f"| one adapter, merge off, on the LoRA kernels (same run{on_card(result)}) | "
                    f"{k['throughput_ratio']:.3f} [{k['ratio_min']:.3f}, {k['ratio_max']:.3f}]x"
                    f"{cut} | | {source} |")
    # --full-list-arms: the same requests with every tile step on its bucket's full tile list;
    # --own-split-arms: with every tile list's K split picked for its own length;
    # --fork-arms (cb90780, when the fork was the variant) / --in-line-arms: with the shrinks
    # forked beside the base GEMMs / in line after them; --two-stage-arms: the tile lists on
    # two pipeline stages (as before GRAPH_TILE_STAGES); --mixed-two-stage-arms: mixed graphs'
    # 64-row tile lists on two (as before PREFILL_STAGES); --tile-variant-arms: decode graphs'
    # tile lists launched as a --tile-variants entry (a shrink K tile of 128, a register cap).
    for arm, label in (("distinct16", "16 distinct adapters"), ("distinct64", "64 distinct adapters"),
                       ("one_unmerged", "one adapter, merge off, on the LoRA kernels")):
        for suffix, how in (("full_list", "on the longest tile list (the middle list off, "),
                            ("own_split", "each tile list's K split for its own length ("),
                            ("fork", "the shrinks on a second stream beside the base GEMMs ("),
                            ("in_line", "the shrinks in line after the base GEMMs ("),
                            ("two_stage", "the tile lists on two pipeline stages ("),
                            ("mixed_two_stage", "mixed steps' 64-row tiles on two stages ("),
                            ("tiles_k128", "the tile lists' shrinks on K tiles of 128 ("),
                            ("tiles_reg168", "the tile lists' kernels capped at 168 registers ("),
                            ("tiles_reg128", "the tile lists' kernels capped at 128 registers ("),
                            ("tiles_cols2", "expand programs of two 256-column tiles ("),
                            ("tiles_n128cols4", "expand programs of four 128-column tiles ("),
                            ("tiles_n128cols4a", "expand programs of four 128-column tiles, "
                             "pipelined ("),
                            ("tiles_cols1", "expand programs of one 256-column tile (")):
            k = d.get(f"{arm}_{suffix}")
            if k is not None:
                rows.append(f"| {label} in a batch of {d['batch']}, {how}same run"
                            f"{on_card(result)}) | {k['throughput_ratio']:.3f} "
                            f"[{k['ratio_min']:.3f}, {k['ratio_max']:.3f}]x{cut} | | {source} |")
    # --ride-variants: the same requests riding with other launches, interleaved.
    default = next((v for k, v in d.get("ride", {}).items() if k.startswith("one_unmerged ")),
                   None)
    for name, v in d.items():
        if not name.startswith("one_ride_"):
            continue
        fields = next(k for k in v if "," in k)
        diff = ", ".join((f"{f} {'on' if on else 'off'}" if isinstance(on, bool) else
                          f"{f} {on}" if isinstance(on, int) else
                          f"{f} {'x'.join(map(str, on)) if on else 'per step'}") for f, on, was in
                         zip(fields.split(", "), v[fields], default or v[fields], strict=True)
                         if on != was)
        rows.append(f"| one adapter, merge off, riding with {diff or 'the default launches'} "
                    f"(variant {name[len('one_ride_'):]}, same run{on_card(result)}) | "
                    f"{v['throughput_ratio']:.3f} [{v['ratio_min']:.3f}, {v['ratio_max']:.3f}]x"
                    f" | | {source} |")
    return rows


def startup_rows(result: dict[str, Any], source: str) -> list[str]:
    rows = []
    for model, m in result["models"].items():
        for kind in ("cold", "warm", "warm_background"):
            r = m.get(kind)
            if r is None:
                continue
            how = " (graphs captured in the background)" if r.get("graphs_in_background") else ""
            k = r.get("kernels", {})
            figure = (f"first token {r['first_token_s']:.1f} s; kernels {k.get('compiled', 0)} "
                      f"compiled ({r.get('compile_s', 0):.1f} s of compiling), "
                      f"{k.get('cache_hit', 0)} from the cache"
                      if r.get("served") else "not served in its time")
            target = m.get("targets_s", {}).get(kind.split("_")[0])
            rows.append(f"| worker start-up, {model} {m['dtype']}, {kind.split('_')[0]} compile "
                        f"cache{how} | {figure} | {f'{target:.0f} s' if target else '-'} | "
                        f"{source} |")
    return rows


def table() -> str:
    return "\n".join([BEGIN, *rows(), END])


def headline_table() -> str:
    found = rows()
    picked = [next((r for r in found if r.startswith(prefix) and f"`{name}`" in r), None)
              for prefix, name in HEADLINES]
    return "\n".join([HEAD_BEGIN, "| what | figure | target | JSON |", "| --- | --- | --- | --- |",
                      *(r for r in picked if r is not None), HEAD_END])


def rows() -> list[str]:
    lines = ["| what | figure (median [min, max] over repeats) | target | JSON |",
             "| --- | --- | --- | --- |"]
    # The latest service run: the 4-process gateway's when present (it supersedes the one-
    # process run, measured before the gateway code changed).
    for name in ("service-overhead-7b-gw4-h200.json", "service-overhead-7b-h200.json"):
        if (RESULTS / name).exists():
            result = json.loads((RESULTS / name).read_text())
            source = f"`{name}` @ {result['commit'][:8]}"
            lines += (service_rows(result, source) + hop_rows(result, source)
                      + hop_trace_rows(result, source))
            break
    # The closed loop before the worker front woke first tokens first (and before the trace):
    # 256 streams kept 1.0-1.1x there (docs/performance.md says what is not explained). Then
    # open-loop arrivals: the latest run with its hop trace, the two before it without.
    for name, make in (
            ("service-overhead-7b-gw4-037c3d6-h200.json",
             lambda r, src: service_rows(r, src) + hop_rows(r, src)),
            # 256 streams at a926e02 with the trace off: the d3a95eb drop was the trace's.
            ("service-overhead-7b-gw4-c256-a926e02-h200.json", service_rows),
            ("service-overhead-7b-open-h200.json",
             traced_service_rows),
            ("service-overhead-7b-open-9bfd047-h200.json", service_rows),
            ("service-overhead-7b-open-dd94c6e-h200.json", service_rows),
            # The gateway's multiplexed upstream (GenerateMux, the default then) beside one
            # worker call a request (gateway_call), side by side in one run, on an H100. The
            # mux did not win there, and the default went back to one call a request.
            ("service-overhead-7b-gw4-mux-d97d349-h100.json",
             lambda r, src: service_rows(r, src, "mux")),
            ("service-overhead-7b-open-mux-d97d349-h100.json",
             lambda r, src: service_rows(r, src, "mux")),
            # The auto upstream beside per call (the default then), on an H100: 8 requests a
            # stream, the hop trace on; and the suite's earlier 2 a stream. Auto became the
            # default after them (7368594).
            ("service-overhead-7b-gw4-auto-f0cf944-h100.json",
             traced_service_rows),
            ("service-overhead-7b-gw4-auto-r2-f0cf944-h100.json", service_rows),
            # Auto the default, a step's first tokens in a mux frame of their own, beside a
            # per-call gateway, on an H100.
            ("service-overhead-7b-gw4-4c37676-h100.json",
             lambda r, src: service_rows(r, src, "auto") + hop_trace_rows(r, src)),
            # The launch wait (a measuring switch, removed after): off, then a 2 ms margin, on
            # an H100, each against its own in-process run (the off run has 64 streams only).
            ("service-launch-wait-off-148b782-h100.json",
             traced_service_rows),
            ("service-launch-wait-on-9d86df5-h100.json",
             traced_service_rows),
            # Auto the default beside the mux forced at every load, on an H100 (README's
            # service headlines): at 64 streams, where auto calls per request, the mux lost.
            ("service-overhead-7b-gw4-mux64-9d86df5-h100.json",
             traced_service_rows),
            # Idle calls opened ahead to the worker (`--upstream warm`, GenerateOpen; removed
            # after) beside auto, closed loop then open loop, on an H100: the gateway -> worker
            # leg shrank, the request's TTFT did not.
            ("service-overhead-7b-gw4-warm-fd23e5c-h100.json",
             traced_service_rows),
            ("service-overhead-7b-open-fd23e5c-h100.json",
             traced_service_rows),
            # The standard suite (auto beside per call) at the commit that removed them, on an
            # H100: README's service headlines.
            ("service-overhead-7b-gw4-a430258-h100.json",
             traced_service_rows),
            # The same at 256 streams only, from 8 client processes instead of 4.
            ("service-overhead-7b-gw4-c256-procs8-a430258-h100.json",
             traced_service_rows),
            # The standard suite again on the H200 at 378382f (README's service headlines),
            # and 64 streams beside the in-process loop with successors 1 and 3 ms late.
            ("service-overhead-7b-gw4-378382f-h200.json",
             traced_service_rows),
            ("service-overhead-7b-gw4-c64-fixed-378382f-h200.json",
             traced_service_rows),
            # gRPC at 64 and 256 streams beside the in-process loop with successors 1 ms late
            # and 1 ms plus up to 6 more (an H100; the H200 did not come).
            ("service-overhead-7b-gw4-late-78a7fae-h100.json",
             traced_service_rows),
            # 64 streams, the worker's lead off and at 1 ms (the default since df81609), the
            # auto gateway (per call there, at 32) beside the mux: the mux won with the lead,
            # and auto takes it from 8 since. Then HTTP at 256 with both leads (an H100).
            ("service-overhead-7b-gw4-c64-next-f02af64-h100.json", service_rows),
            ("service-overhead-7b-gw4-http-lead-c256-f02af64-h100.json", service_rows),
            ("lora-layer-fusion-h200.json", fusion_rows),
            ("lora-layer-fusion-ops-3b09231-h100.json", fusion_ops_rows),
            ("lora-layer-fusion-ops-5be1284-h100.json", fusion_ops_rows),
            ("lora-layer-fusion-ops-7786a51-h100.json", fusion_ops_rows),
            ("lora-layer-fusion-blocks-d3cf840-h100.json", fusion_ops_rows),
            ("lora-many-ride-30984e9-h100.json", many_ride_rows),
            ("grpc-stream-cost-cpu.json", grpc_cost_rows)):
        lines += _rows_of(name, make)
    path = RESULTS / "profile-async-h200.json"
    if path.exists():
        result = json.loads(path.read_text())
        lines += async_rows(result, f"`{path.name}` @ {result['commit'][:8]}")
    for arm in ("merge", "async", "sync", "inline", "overlap"):
        path = RESULTS / f"engine-speed-{arm}-h200.json"
        if path.exists():
            result = json.loads(path.read_text())
            a = result["args"]
            steps = "asynchronous" if EngineConfig(
                device=a["device"], async_steps=a.get("async_steps"),
                tensor_parallel_size=a.get("tensor_parallel_size", 1)).steps_async \
                else "synchronous"
            where = "on a second stream" if result["args"].get("lora_overlap") else "in line"
            if result["args"].get("lora_row_kernels"):
                where += ", row kernels for many-adapter steps"
            lines += engine_rows(result, f"{where}, {steps} steps",
                                 f"`{path.name}` @ {result['commit'][:8]}")
    # One-run pairs: the LoRA expands as programmatic dependents or not (dccb3ce), and the
    # decode step's floor alone with and without the row kernels' graph.
    row_kernels = "row kernels for many-adapter steps"
    for name, label in (
            ("engine-speed-pdl-dccb3ce-h200.json",
             f"{row_kernels}, expands as programmatic dependents (lora_pdl on)"),
            ("engine-speed-nopdl-dccb3ce-h200.json",
             f"{row_kernels}, expands launched plainly (lora_pdl off)"),
            ("engine-floor-rows-h200.json", row_kernels),
            ("engine-floor-tiles-h200.json", "16-row tiles only (lora_row_kernels off)")):
        path = RESULTS / name
        if path.exists():
            result = json.loads(path.read_text())
            lines += engine_rows(result, f"in line, {label}",
                                 f"`{path.name}` @ {result['commit'][:8]}")
    # Saturated (60/s), below saturation (50/s, 40/s), and the older run with the disk tier.
    # churn-rate50-4a1c7c8-h200.json: the last run on tiles with alpha 0.5 (3d9d85a ran 1.0
    # only). churn-rate50-alpha1-bdfe3de-h200.json: alpha 1.0 alone at the commit and arrivals
    # of churn-rate50-h200.json (p99 TTFT 1.87x with 126 evictions there, 1.55x with 58 here:
    # the tail rises with the evictions); the bb1ca0b repeat likewise (2.06x / 78, 1.47x / 23).
    for name in ("churn-h200.json", "churn-rate50-h200.json",
                 "churn-rate50-alpha1-bdfe3de-h200.json",
                 "churn-rate50-alpha1-repeat-bb1ca0b-h200.json", "churn-rows-h200.json",
                 "churn-rate50-tiles-3d9d85a-h200.json", "churn-rate50-4a1c7c8-h200.json",
                 "churn-rate40-h200.json", "churn-disk-h200.json",
                 "churn-rate50-balanced-0eecaa2-h100.json",
                 "churn-rate50-unbalanced-0eecaa2-h100.json",
                 "churn-rate50-tiles16-8a69460-h200.json", "churn-rate50-5be1284-h100.json",
                 "churn-rate50-7786a51-h100.json"):
        path = RESULTS / name
        if path.exists():
            result = json.loads(path.read_text())
            churn = churn_rows(result, f"`{path.name}` @ {result['commit'][:8]}")
            if name == "churn-rate50-4a1c7c8-h200.json":
                churn = [row for row in churn if "alpha 0.5" in row]
            if name == "churn-rate50-tiles16-8a69460-h200.json":  # the first run with them
                churn = [row.replace(", reloads", ", mixed steps of <= 2,048 tokens in 16-row "
                                     "LoRA tiles, reloads") for row in churn]
            lines += churn if name != "churn-disk-h200.json" else churn[-1:]
    for name, make in (("cold-load-h200.json", cold_rows), ("lora-grid-h200.json", grid_rows),
                       ("prefix-cache-h200.json", prefix_rows),
                       ("structured-output-h200.json", structured_rows),
                       ("distinct-adapters-h200.json", distinct_rows),
                       ("distinct-adapters-0eecaa2-h100.json", distinct_rows),
                       ("distinct-adapters-ride-8a69460-h200.json", distinct_rows),
                       ("distinct-adapters-ride-5be1284-h100.json", distinct_rows),
                       ("distinct-adapters-ride-c4cb6f6-h100.json", distinct_rows),
                       ("distinct-adapters-ride-7786a51-h100.json", distinct_rows),
                       ("distinct-adapters-ride-r16-7786a51-h100.json", distinct_rows),
                       ("distinct-adapters-ride-r64-7786a51-h100.json", distinct_rows),
                       ("distinct-adapters-ride-blocks-d3cf840-h100.json", distinct_rows),
                       ("distinct-adapters-ride-r64-blocks-d3cf840-h100.json", distinct_rows),
                       ("distinct-adapters-ride-w8-4325d23-h100.json", distinct_rows),
                       ("distinct-adapters-ride-r64-w8-4325d23-h100.json", distinct_rows),
                       ("distinct-adapters-mid-fbb4a8f-h100.json", distinct_rows),
                       ("distinct-adapters-mid-b256-fbb4a8f-h100.json", distinct_rows),
                       ("distinct-adapters-ride-ba20ecd-h100.json", distinct_rows),
                       ("distinct-adapters-split-b256-dc73b24-h100.json", distinct_rows),
                       ("distinct-adapters-378382f-h200.json", distinct_rows),
                       ("distinct-adapters-91d9eee-h100.json", distinct_rows),
                       ("distinct-adapters-9a4dbfc-h100.json", distinct_rows),
                       ("distinct-adapters-norm-3ceb912-h100.json", distinct_rows),
                       ("distinct-adapters-norm-r16-3ceb912-h100.json", distinct_rows),
                       ("distinct-adapters-b6261c0-h100.json", distinct_rows),
                       ("distinct-adapters-fork-cb90780-h100.json", distinct_rows),
                       ("distinct-adapters-fork-b02a099-h100.json", distinct_rows),
                       ("distinct-adapters-fork-b256-ecdfb2a-h100.json", distinct_rows),
                       ("distinct-adapters-stages-752466d-h100.json", distinct_rows),
                       ("distinct-adapters-stages-b256-752466d-h100.json", distinct_rows),
                       ("distinct-adapters-stages-one-002a98c-h100.json", distinct_rows),
                       ("distinct-adapters-mixed-stages-f63146d-h100.json", distinct_rows),
                       ("distinct-adapters-tiles-51483c3-h100.json", distinct_rows),
                       ("distinct-adapters-tiles-a1de8ba-h100.json", distinct_rows),
                       ("distinct-adapters-tiles-b256-bb81a4e-h100.json", distinct_rows),
                       ("distinct-adapters-mixed-cols-20a18b8-h100.json", distinct_rows),
                       ("worker-startup-7b-h200.json", startup_rows),
                       ("worker-startup-h200.json", startup_rows),
                       ("worker-startup-d2d45c7-h200.json", startup_rows)):
        lines += _rows_of(name, make)
    return lines


def _rows_of(name: str, make: Callable[[dict[str, Any], str], list[str]]) -> list[str]:
    """`make`'s rows for result `name`, cited with its commit; none when the file is absent."""
    path = RESULTS / name
    if not path.exists():
        return []
    result = json.loads(path.read_text())
    return make(result, f"`{name}` @ {result['commit'][:8]}")


def replace_block(text: str, begin: str, end: str, block: str) -> str | None:
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    return head + block + rest.split(end, 1)[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = []
    for path, begin, end, block in ((PERFORMANCE, BEGIN, END, table()),
                                    (README, HEAD_BEGIN, HEAD_END, headline_table())):
        text = path.read_text()
        new = replace_block(text, begin, end, block)
        if new is None:
            print(f"{path}: no {begin} ... {end} block", file=sys.stderr)
            return 1
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("stale: " + ", ".join(map(str, stale)), file=sys.stderr)
    return int(args.check and bool(stale))


if __name__ == "__main__":
    sys.exit(main())
