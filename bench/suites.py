"""The benchmark suites `python -m bench SUITE` runs, each named for what it measures.

A suite is a tuple of steps; a step is one process (`python -m MODULE ARGS`, `{out}` replaced by
the output folder) under its own time limit. Registering a suite is one line in SUITES:

    "prefix-cache": (step("prefix-cache", 300, "bench.prefix_cache", "--out", OUT("prefix-cache")),),

Steps given a `lane` run beside the other lanes (each lane's steps one after another; `in_lane`
can pin a lane to one GPU); steps without one run first, one after another. Defaults are those of the H200 runs the results came from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    argv: tuple[str, ...]  # after `python -m`; "{out}" is the output folder
    env: tuple[tuple[str, str], ...] = ()
    lane: int | None = None  # the step runs in this lane, beside the other lanes
    stop_signal: str = "TERM"  # sent at the limit (INT lets pytest write its XML first)


def step(name: str, limit_s: int, module: str, *args: str, lane: int | None = None,
         stop_signal: str = "TERM", **env: str) -> Step:
    return Step(name, limit_s, (module, *args), tuple(env.items()), lane, stop_signal)


def OUT(stem: str) -> str:  # noqa: N802 (reads as a path constant in the tables below)
    """The result file `{out}/<stem>-<commit>-<card>.json`, as bench/results names them (the
    runner fills in the commit measured and the card it ran on: h200, h100, cpu)."""
    return "{out}/" + stem + "-{commit}-{card}.json"


def in_lane(lane: int, steps: tuple[Step, ...], gpu: int | None = None,
            **env: str) -> tuple[Step, ...]:
    """`steps` in lane `lane`, on GPU `gpu` alone if given (CUDA_VISIBLE_DEVICES)."""
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return tuple(dataclasses.replace(s, lane=lane, env=(*tuple(env.items()), *s.env))
                 for s in steps)


GPU_7B = ("--shape", "llama2-7b", "--device", "cuda", "--dtype", "float16")


def adapter_vs_base(name: str, *flags: str, limit_s: int = 120, repeats: str = "3") -> Step:
    """One rank-16 adapter against the base model in interleaved pairs, and the decode-step
    floor (bench.serving overhead,floor); flags after the defaults win."""
    return step(f"engine-{name}", limit_s, "bench.serving", *GPU_7B, "--scenarios",
                "overhead,floor", "--requests", "100", "--overhead-repeats", repeats, *flags,
                "--out", OUT(f"engine-speed-{name}"))


def decode_floor(name: str, *flags: str) -> Step:
    return step(f"floor-{name}", 90, "bench.serving", *GPU_7B, "--scenarios", "floor",
                "--async-steps", *flags, "--out", OUT(f"engine-floor-{name}"))


GRID_CASES = ("8x1x1,8x16x1,8x64x1,8x256x1,16x1x1,16x16x1,16x64x1,16x256x1,64x1x1,64x16x1,"
              "64x64x1,64x256x1,16x16x16,16x64x64,16x256x256,64x16x16,64x256x256")
# 8 client processes (4 until a430258): with 64 httpx streams in one client process, a new
# request's send waited behind the step's burst of stream events there (`client_sent ->
# gateway_entry` 8.5 ms p50 at 256 streams with 4 processes, 5.0 ms with 8 on an H100:
# service-overhead-7b-gw4-c256-procs8-a430258-h100.json): the load generator's cost, not the
# service's.
SERVICE_7B = (*GPU_7B, "--num-pages", "2400", "--max-model-len", "256", "--concurrency",
              "64,256", "--requests-per-stream", "2", "--new-tokens", "64", "--client-procs", "8",
              "--http", "--http-clients", "httpx,aiohttp")
PROFILE_CORE = (*GPU_7B, "--batch", "64", "--context", "512", "--adapters")
SERVING_90GB = (*GPU_7B, "--arena-gb", "90")
CHURN_2000 = (*GPU_7B, "--arena-gb", "32", "--many-adapters", "2000", "--churn-requests", "600")
GPU_TESTS = ("bench.gpu_checks", "A", "--out", "{out}", "--shards", "6", "--numerics-modes",
             "eager", "all_graphs", "all_graphs_async")
# NVLink multicast stays off (the device notes: it can take the shared GPUs down).
NO_NVLS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
TP_SHORT_7B = ("--engines", "tp2", "tp1_eager", "--requests", "32", "--max-output", "128",
               "--collective-timeout", "30", "--stall-dump", "20")


def tp(part: str, limit_s: int, *args: str, **env: str) -> Step:
    """One tensor-parallel part (bench.tensor_parallel: its JSONs under {out}); SIGKILL follows
    the limit's SIGTERM if NCCL keeps the process alive (the runner's grace period)."""
    return Step(f"tp-{part}", limit_s, ("bench.tensor_parallel", "--part", part, "--out-dir",
                                        "{out}", *args), tuple((NO_NVLS | env).items()))


SUITES: dict[str, tuple[Step, ...]] = {
    # ---- kernels ---------------------------------------------------------------------------
    "kernels": (step("kernel-tests", 240, "pytest", "-q", "-p", "no:cacheprovider", "-m",
                     "slow or not slow", "--durations=5", "tests/kernel_tests",
                     "tests/slora_core/test_ops.py"),
                step("kernels", 320, "bench.kernels", "--out", OUT("kernels"))),
    "lora-grid": (step("grid", 150, "bench.kernels_lora_grid", "--variants",
                       "graph_capture_split,graph_short_list,exact,rows,graph_before,"
                       "short_list_before", "--out", OUT("lora-grid")),),
    # The grid with vLLM's own kernels beside ours (`.vllm-lora`: python -m bench.vllm_lora
    # --fetch .vllm-lora, carried with the tree).
    "lora-grid-vllm": (step("grid-vllm", 300, "bench.kernels_lora_grid", "--variants",
                            "graph_capture_split,graph_short_list,rows", "--vllm-src",
                            ".vllm-lora", "--out", OUT("lora-grid")),),
    "lora-grid-split": (step("grid-split", 150, "bench.kernels_lora_grid", "--cases", GRID_CASES,
                             "--variants", "graph_capture_split,graph_short_list,graph_wave,"
                             "short_list_wave", "--out", OUT("lora-grid-split")),),
    "lora-one-adapter": (step("one-adapter", 150, "bench.lora_one_adapter", "--out",
                              OUT("lora-one-adapter")),),
    "lora-layer-fusion": (step("layer-fusion", 150, "bench.lora_layer_fusion", "--out",
                               OUT("lora-layer-fusion")),),
    "lora-rows": (step("rows", 200, "bench.kernels_lora_rows", "--out", OUT("lora-rows")),),
    "lora-tiles-sweep": (step("lora-sweep", 200, "bench.decode_sweep", "--parts", "lora",
                              "--lora-cases", "16,64,64", "16,256,256", "16,64,1", "--out",
                              OUT("decode-sweep-lora")),),
    "attention-tiles-sweep": (step("sweep", 90, "bench.decode_sweep", "--parts",
                                   "attention_wide", "--attn-wide", "128,4,2", "--out",
                                   OUT("decode-sweep-wide")),),
    "gemm-decode": (step("gemm", 120, "bench.gemm_decode", "--out", OUT("gemm-decode")),),
    "merge-time": (step("merge-time", 120, "bench.merge_time", "--out", OUT("merge-time")),),
    "lora-graph-split": (step("lora-graph-split", 200, "bench.lora_graph_split", "--out",
                              OUT("lora-graph-split")),),
    # ---- the engine ------------------------------------------------------------------------
    "adapter-vs-base": (adapter_vs_base("async", "--async-steps"),),
    "adapter-vs-base-sync": (adapter_vs_base("sync", "--no-async-steps"),),
    "adapter-vs-base-merge": (adapter_vs_base("merge", "--async-steps", "--merge-sole-adapter",
                                              "--scenarios", "overhead", repeats="5"),),
    "adapter-vs-base-pdl": (adapter_vs_base("pdl", "--async-steps", "--lora-pdl"),
                            adapter_vs_base("nopdl", "--async-steps", "--no-lora-pdl")),
    "decode-floor": (adapter_vs_base("async", "--async-steps", "--scenarios", "floor"),),
    "decode-floor-rows": (decode_floor("rows", "--lora-row-kernels"),
                          decode_floor("tiles", "--no-lora-row-kernels")),
    "gc-pauses": (step("gcpause", 150, "bench.serving", *GPU_7B, "--scenarios", "gcpause",
                       "--requests", "100", "--overhead-repeats", "3", "--out",
                       OUT("gc-pauses")),),
    "core-profile": (step("core", 150, "bench.profile_core", *PROFILE_CORE, "--async-steps",
                          "--out", OUT("profile-core-async")),),
    "async-profile": (step("async", 240, "bench.profile_async", "--shape", "llama2-7b", "--out",
                           OUT("profile-async")),),
    "step-profile": (step("profile", 220, "bench.profile_gpu", "--shape", "llama2-7b", "--out",
                          "{out}/profile.json"),),
    "host-probe": (step("probe", 90, "bench.host_probe", "--out", OUT("host-probe")),),
    "structured-output": (step("structured-output", 500, "bench.structured_output", *GPU_7B,
                               "--streams", "64", "--requests", "512", "--out",
                               OUT("structured-output")),),
    # ---- serving ---------------------------------------------------------------------------
    "engine-check": (step("engine-check", 100, "bench.gpu_engine_check", "--out",
                          "{out}/engine-gpu-check.json"),),
    "serving": (step("serving", 320, "bench.serving", *SERVING_90GB, "--scenarios",
                     "overhead,scale,floor,peft32,reuse", "--hf", "--hf-max-time", "40",
                     "--requests", "300", "--rate", "40", "--many-adapters", "2000",
                     "--scale-caps", "64,256", "--out", OUT("serving")),),
    "serving-vs-peft": (step("serving-b", 300, "bench.serving", *SERVING_90GB, "--scenarios",
                             "peft32,reuse,overhead", "--hf", "--hf-max-time", "40",
                             "--requests", "300", "--out", OUT("serving-b")),),
    "prefix-cache": (step("prefix-cache", 400, "bench.prefix_cache", "--out",
                          OUT("prefix-cache")),),
    "cold-load": (step("cold", 90, "bench.cold_load", "--tmp", "/tmp", "--out",
                       OUT("cold-load")),),
    "worker-startup": (step("worker-startup", 570, "bench.worker_startup", "--budget-s", "510",
                            "--also-background",
                            "--out", OUT("worker-startup")),),
    "distinct-profile": (step("distinct-profile", 240, "bench.serving", *GPU_7B, "--scenarios",
                              "distinct_profile", "--arena-gb", "40", "--out",
                              OUT("distinct-profile")),),
    "lora-distinct-layer": (step("lora-distinct-layer", 300, "bench.lora_distinct_layer", "--out",
                                 OUT("lora-distinct-layer")),),
    # 340 s: a fresh machine compiles for ~100 s first; with --ride-sole-adapter the run took
    # 254 s on an H100 (distinct-adapters-0eecaa2-h100.json), and a 185 s limit cut one.
    "distinct-adapters": (step("distinct", 340, "bench.serving", *GPU_7B, "--scenarios",
                               "distinct", "--arena-gb", "40", "--overhead-repeats", "3",
                               "--out", OUT("distinct-adapters")),),
    "churn": (step("churn", 200, "bench.serving", *CHURN_2000, "--scenarios", "churn",
                   "--churn-rate", "50", "--churn-alphas", "1.0,0.5", "--out",
                   OUT("churn-rate50")),),
    "churn-tiers": (step("churn-tiers", 210, "bench.serving", *CHURN_2000, "--scenarios",
                         "coldttft,churndisk,churn", "--churn-disk-requests", "200",
                         "--churn-rate", "60", "--churn-disk-dir", "/tmp", "--out",
                         OUT("churn")),),
    # Each beside a second gateway calling the worker once a request (`--upstream call`, the
    # default until the auto upstream, per call then GenerateMux past 32 streams in flight on
    # the worker in a gateway process, won at 256 streams on an H100 at f0cf944): the
    # gateway_call path. 8 requests a stream: at 2 the first burst ruled every median.
    # With the in-process loop's successors also arriving 1 ms late (in_process_after_1ms):
    # at 64 streams on the H200 that alone added as much TTFT as the gateway path
    # (service-overhead-7b-gw4-c64-fixed-378382f-h200.json); this shows it at 256 too.
    "service-path": (step("service", 540, "bench.service_overhead", *SERVICE_7B, "--repeats", "3",
                          "--requests-per-stream", "8", "--gateway-procs", "4",
                          "--client-channels", "8", "--also-upstream", "call",
                          "--in-process-arrive-after-ms", "1",
                          "--out", OUT("service-overhead-7b-gw4")),),
    # Does the in-process closed loop run in waves on the GPU engine too (docs/performance.md,
    # issue 37's status)? The demo model with the engine's GPU settings, fixed and spread lengths.
    # With successors arriving 1 and 3 ms late too (on the CPU's demo engine a late successor
    # waits out most of a step: closed-loop-arrive-508461d-cpu.json).
    "closed-loop-waves": (step("waves", 150, "bench.closed_loop_waves", "--device", "cuda",
                               "--arrive-after-ms", "0,1,3", "--repeats", "3",
                               "--out", OUT("closed-loop-waves")),),
    # 64 streams with every request at 64 tokens, then at 32-96 (fixed by the prompt, the same
    # on every path): do the in-process loop's waves (bench.closed_loop_waves) make part of
    # the closed loop's added gRPC TTFT? Beside them the in-process loop with successors
    # arriving 1 and 3 ms late (in_process_after_*): the TTFT a late arrival adds by waiting
    # out the step under way, against what each service path adds.
    "service-path-waves": tuple(
        step(f"service-{name}", 290, "bench.service_overhead", *SERVICE_7B, "--concurrency", "64",
             "--repeats", "3", "--requests-per-stream", "8", "--gateway-procs", "4",
             "--client-channels", "8", "--new-tokens-spread", spread, "--trace-hops",
             f"{{out}}/hops-{name}", "--in-process-arrive-after-ms", "1,3",
             "--out", OUT(f"service-overhead-7b-gw4-c64-{name}"))
        for name, spread in (("fixed", "0"), ("spread32", "32"))),
    # gRPC only (no HTTP paths), at 64 and 256 streams, beside the in-process loop with
    # successors 1 ms late, and 1 ms plus up to 6 more (uniformly: spread over a step, as a
    # service's arrivals are, not all at once): does a late arrival account for the gateway's
    # added TTFT at 256 streams too (13.2 ms on the H200,
    # service-overhead-7b-gw4-378382f-h200.json), and do spread arrivals account for the
    # service paths' lower throughput at 64 (0.93-0.95x against 0.98-0.99x for the 1 ms-late
    # loop)? ~6 min a card.
    "service-path-late": (step("service-late", 420, "bench.service_overhead", *GPU_7B,
                               "--num-pages", "2400", "--max-model-len", "256",
                               "--concurrency", "64,256", "--requests-per-stream", "8",
                               "--new-tokens", "64", "--client-procs", "8", "--repeats", "3",
                               "--gateway-procs", "4", "--client-channels", "8",
                               "--in-process-arrive-after-ms", "1",
                               "--in-process-arrive-spread-ms", "6",
                               "--out", OUT("service-overhead-7b-gw4-late")),),
    # The same paths under open-loop Poisson arrivals (the same on every path): a request's
    # added TTFT is then the hop's, not the closed loop's wait for the step under way.
    "service-path-open": (step("service-open", 420, "bench.service_overhead",
                               *SERVICE_7B, "--rates", "60,120", "--repeats", "3",
                               "--gateway-procs", "4", "--client-channels", "8",
                               "--also-upstream", "call", "--out",
                               OUT("service-overhead-7b-open")),),
    "service-path-async": (step("service-async", 330, "bench.service_overhead", *SERVICE_7B,
                                "--repeats", "3", "--async-steps", "--out",
                                OUT("service-overhead-7b-async")),),
    # ---- correctness on the GPU ------------------------------------------------------------
    "numerics": (step("numerics", 330, "bench.gpu_numerics", "--budget-s", "300", "--out",
                      OUT("gpu-numerics")),),
    "gpu-tests": (step("gpu-tests", 420, *GPU_TESTS, "--limit-s", "380", OMP_NUM_THREADS="4"),),
    # The GPU tests a serving loop's defaults reach, pytest alone: the 1 ms late-admission
    # lead is on by default since df81609 (22 passed in 44 s on an H100 at f02af64,
    # gpu-part-A-serving-f02af64-h100.json).
    "gpu-tests-serving": (step("gpu-tests-serving", 200, "bench.gpu_checks", "A", "--out", "{out}",
                               "--shards", "2", "--numerics-dtypes", "--limit-s", "180",
                               "--pytest-paths", "tests/slora_core/test_host_copy.py",
                               "tests/slora_core/test_admission.py",
                               "tests/services/dataplane/test_worker_startup_graphs.py",
                               OMP_NUM_THREADS="4"),),
    "model-agreement": (step("model-agreement", 330, "bench.gpu_checks", "B", "--out", "{out}",
                             "--limit-s", "290", OMP_NUM_THREADS="4"),),
    # ---- tensor parallelism (2 GPUs) -------------------------------------------------------
    "tensor-parallel": (tp("70b", 250), tp("7b", 280)),
    "tensor-parallel-short": (tp("7b", 100, *TP_SHORT_7B, SLORA_TP_DEBUG="1"),
                              tp("70b", 135, "--big-requests", "120", "--weight-sets", "1",
                                 "--collective-timeout", "90", SLORA_TP_DEBUG="1")),
    "tensor-parallel-smoke": (tp("7b", 200, "--smoke"), tp("70b", 200, "--smoke")),
}

# The last call of a session on 2 H200s: the host probe, then two lanes side by side, one GPU
# each, in priority order (GPU 0: the GPU-only tests and numerics; GPU 1: kernels, cold loads,
# model agreement, the service path, churn, one adapter vs base).
SUITES["round"] = (
    *SUITES["host-probe"],
    *in_lane(0, (*SUITES["gpu-tests"], *SUITES["numerics"]), gpu=0, OMP_NUM_THREADS="8"),
    *in_lane(1, (*SUITES["lora-grid"], *SUITES["cold-load"], *SUITES["model-agreement"],
                 *SUITES["service-path"], *SUITES["churn-tiers"],
                 adapter_vs_base("inline")), gpu=1, OMP_NUM_THREADS="8"),
)
# Issue 37's engine figures in one device call (under 600 s): the distinct batch with the
# one-adapter arm riding, then churn at 50 arrivals/s.
SUITES["issue37"] = (
    dataclasses.replace(SUITES["distinct-adapters"][0], argv=(
        *SUITES["distinct-adapters"][0].argv, "--ride-sole-adapter")),
    dataclasses.replace(SUITES["churn"][0], limit_s=220))
# Every distinct arm with the ride, and the one-adapter arm riding unpadded beside the padded
# default (RIDE_ROW_ALIGN; distinct-adapters-91d9eee-h100.json), interleaved: ~230 s on the H200.
SUITES["issue37-align"] = (dataclasses.replace(SUITES["issue37"][0], argv=(
    *SUITES["issue37"][0].argv, "--ride-variants", "unaligned")),)
# The sole-adapter ride (qkv's and gate_up's expands fused into rotary and silu_mul, 7c40866;
# rows sized to the adapter's rank, 960db69; o's and down's expands a Triton launch, on since
# 5be1284) in one call, in the order a call cut short by its 600 s should keep them: the
# kernel tests compiled on the GPU, the ride's logits against HF fp32 / fp16 at 7B width,
# issue37's one-adapter arm (rank 8) beside base riding with the default launches and with
# the variants (--ride-variants: every module's rows at max_rank, o's and down's expands as
# addmm, every expand as addmm) interleaved, the same arm with a rank-64 adapter, the
# many-adapter tiles' expand choices at D = 4, 16 and 64, one layer's ops with and without each
# fusion, churn again, the arm with a rank-16 adapter, and last the ride's step by kernel
# family.
_RIDE_ONE = dataclasses.replace(SUITES["issue37"][0], limit_s=200, argv=(
    *SUITES["issue37"][0].argv, "--distinct-arms", "one_unmerged"))


def _ride_one_rank(rank: int) -> Step:
    argv = list(_RIDE_ONE.argv)
    argv[argv.index(OUT("distinct-adapters"))] = OUT(f"distinct-adapters-ride-r{rank}")
    return dataclasses.replace(_RIDE_ONE, name=f"distinct-r{rank}", limit_s=120,
                               argv=(*argv, "--one-adapter-rank", str(rank)))


SUITES["issue37-ride"] = (
    step("ride-kernel-tests", 120, "pytest", "-q", "-p", "no:cacheprovider", "-m",
         "slow or not slow", "tests/kernel_tests/test_ride_expand.py"),
    step("ride-agreement", 150, "bench.gpu_suite", "--shapes", "llama2-7b", "--modes",
         "ride_sole_adapter", "--out", OUT("gpu-suite-ride-fused-llama2-7b")),
    dataclasses.replace(_RIDE_ONE, argv=(*_RIDE_ONE.argv, "--ride-variants",
                                         "maxrows,nopdl,addmm")),
    _ride_one_rank(64),
    # The D = 16 tiles with early loads, narrower expand column tiles, without the graph's
    # padding, and looping over it (lora-distinct-layer-expand-c337f04-h100.json).
    step("distinct-layer-expand", 120, "bench.lora_distinct_layer", "--cases",
         "16:8-16-32-64,4:8-16-32-64,64:8-16-32-64", "--choices",
         "tiles,tiles_early,tiles_n128,tiles_early_n128,tiles_unpadded_split,tiles_unpadded,"
         "rows",
         "--out", OUT("lora-distinct-layer-expand")),
    step("layer-fusion", 120, "bench.lora_layer_fusion", "--out", OUT("lora-layer-fusion-ops")),
    SUITES["issue37"][1],
    _ride_one_rank(16),
    dataclasses.replace(SUITES["distinct-profile"][0], limit_s=150, argv=(
        *SUITES["distinct-profile"][0].argv[:-1], OUT("distinct-profile-ride"),
        "--distinct-arms", "one_unmerged", "--ride-sole-adapter")))
# What the next H200 call should run (under 600 s): 512-column expand tiles against today's
# 256 at D = 4, 16 and 64 (the D = 16 expand is most of that batch's LoRA time:
# docs/performance.md, "Every distinct adapter riding the base GEMMs"), then issue37-align
# (every distinct arm; the padded ride beside the unpadded one).
SUITES["issue37-next"] = (
    step("expand-n512", 120, "bench.lora_distinct_layer", "--cases",
         "4:8-16-32-64,16:8-16-32-64,64:8-16-32-64", "--choices", "tiles,tiles_n512,rows",
         "--out", OUT("lora-distinct-layer-n512")),
    *SUITES["issue37-align"])
# The many-adapter shrinks forked beside the base GEMMs (they read only x) on a second
# stream, the expands after both (bench.lora_distinct_layer --with-base), against the LoRA
# in line after each GEMM, at D = 4, 16 and 64 on what decode graphs replay; its b256 step
# the same at 256 rows, where 64 and 32 adapters (4 and 8 rows each) take the middle list and
# 128 the row kernels (lora-distinct-layer-fork{,-b256}-b02a099-h100.json).
SUITES["issue37-fork"] = (
    step("fork", 150, "bench.lora_distinct_layer", "--cases",
         "4:8-16-32-64,16:8-16-32-64,64:8-16-32-64", "--choices", "tiles_graph,rows",
         "--with-base", "--out", OUT("lora-distinct-layer-fork")),
    step("fork-b256", 200, "bench.lora_distinct_layer", "--rows", "256", "--cases",
         "32:8-16-32-64,64:8-16-32-64,128:8-16-32-64", "--choices", "tiles_graph,rows",
         "--with-base", "--out", OUT("lora-distinct-layer-fork-b256")),)
# The fork in the engine: 16 and 64 distinct adapters with decode graphs' shrinks forked
# beside the base GEMMs (EngineConfig.lora_fork_shrink, on since
# distinct-adapters-fork-cb90780-h100.json) beside the same arms in line and base, interleaved.
SUITES["issue37-fork-engine"] = (dataclasses.replace(SUITES["issue37"][0], limit_s=300, argv=(
    *SUITES["issue37"][0].argv, "--distinct-arms", "distinct16,distinct64", "--in-line-arms",
    "distinct16,distinct64", "--out", OUT("distinct-adapters-fork"))),)
# The same call again after issue37-next's H100 run (tiles_n512 lost at every D,
# lora-distinct-layer-n512-b6261c0-h100.json): 8 and 2 warps a tile program against 4, then
# issue37-align for the H200's figure of the padded ride.
SUITES["issue37-warps"] = (
    step("tile-warps", 120, "bench.lora_distinct_layer", "--cases",
         "4:8-16-32-64,16:8-16-32-64,64:8-16-32-64", "--choices", "tiles,tiles_w8,tiles_w2",
         "--out", OUT("lora-distinct-layer-warps")),
    *SUITES["issue37-align"])


# Decode graphs' middle tile list (decode_tile_caps) in one call: one layer's LoRA launches on
# the full, middle and real-only lists at 64 rows (D = 16) and 256 rows (D = 64 and 32), then
# the engine's D = 16 arm at batch 64 and D = 64 arm at batch 256 (four rows an adapter:
# tiles), each beside the same arm on the full list (--full-list-arms) and base, interleaved.
_SPLITS = ",".join(f"tiles@{a}/{b}" for a in ("real", "mid", "bound", "full")
                   for b in ("real", "mid", "bound", "full"))
_MID = ("--scenarios", "distinct", "--overhead-repeats", "3", "--ride-sole-adapter")
# With the longest list bounded beside the row kernels (tile_steps_max_tiles), the layer
# steps also time D = 20 at 64 rows and D = 80 at 256 (3.2 rows an adapter: more tiles than
# the middle list holds), and `distinct` runs issue 37's arms at the commit.
SUITES["issue37-tiles"] = (
    step("tiles-layer", 90, "bench.lora_distinct_layer", "--cases",
         "16:8-16-32-64,20:8-16-32-64,24:8-16-32-64,28:8-16-32-64", "--choices",
         "tiles,tiles_mid,tiles_bound,tiles_unpadded,tiles_graph",
         "--out", OUT("lora-distinct-layer-mid")),
    step("tiles-layer-b256", 120, "bench.lora_distinct_layer", "--rows", "256", "--cases",
         "64:8-16-32-64,32:8-16-32-64,80:8-16-32-64,100:8-16-32-64,120:8-16-32-64",
         "--choices", "tiles,tiles_mid,tiles_bound,tiles_unpadded,tiles_graph,rows",
         "--out", OUT("lora-distinct-layer-mid-b256")),
    SUITES["issue37"][0],
    # Each list's padding and K split apart (tiles@L/S), for the lists' split rule.
    step("tiles-split", 150, "bench.lora_distinct_layer", "--cases",
         "16:8-16-32-64,20:8-16-32-64,24:8-16-32-64,28:8-16-32-64", "--choices", _SPLITS,
         "--out", OUT("lora-distinct-layer-split")),
    step("tiles-split-b256", 240, "bench.lora_distinct_layer", "--rows", "256", "--cases",
         "32:8-16-32-64,64:8-16-32-64,80:8-16-32-64,100:8-16-32-64,120:8-16-32-64",
         "--choices", _SPLITS, "--out", OUT("lora-distinct-layer-split-b256")),
    # Where the row kernels should give way to the tiles now that the tiles' lists and split
    # changed (two rows an adapter is the row kernels' today; fewer tiles than the bound list
    # holds fit it, so tiles@bound/* exist at 2 rows an adapter): run at f0cf944,
    # lora-distinct-layer-rows-vs-tiles{,-b256}-f0cf944-h100.json.
    step("rows-vs-tiles", 90, "bench.lora_distinct_layer", "--cases",
         "32:8-16-32-64,26:8-16-32-64", "--choices",
         "rows,tiles,tiles@bound/full,tiles@bound/bound,tiles@real/bound",
         "--out", OUT("lora-distinct-layer-rows-vs-tiles")),
    step("rows-vs-tiles-b256", 120, "bench.lora_distinct_layer", "--rows", "256", "--cases",
         "128:8-16-32-64,110:8-16-32-64", "--choices",
         "rows,tiles,tiles@bound/full,tiles@bound/bound,tiles@real/bound",
         "--out", OUT("lora-distinct-layer-rows-vs-tiles-b256")),
    step("distinct-mid", 220, "bench.serving", *GPU_7B, *_MID, "--arena-gb", "40",
         "--distinct-arms", "distinct16", "--full-list-arms", "distinct16",
         "--out", OUT("distinct-adapters-mid")),
    step("distinct-mid-b256", 240, "bench.serving", *GPU_7B, *_MID, "--arena-gb", "50",
         "--distinct-batch", "256", "--distinct-input", "256", "--distinct-output", "128",
         "--distinct-arms", "distinct64", "--full-list-arms", "distinct64",
         "--own-split-arms", "distinct64", "--out", OUT("distinct-adapters-mid-b256")))
# The fork at 256 rows in the engine (the layer at 256 rows: on the middle list a tie at
# D = 64 and 3.3 us a layer lost at D = 32, 2.2 us won on the row kernels at D = 128,
# lora-distinct-layer-fork-b256-b02a099-h100.json): 64 distinct adapters in a batch of 256
# (four rows each: the middle list) forked and in line, beside base, interleaved.
SUITES["issue37-fork-b256"] = (step(
    "distinct-fork-b256", 260, "bench.serving", *GPU_7B, *_MID, "--arena-gb", "50",
    "--distinct-batch", "256", "--distinct-input", "256", "--distinct-output", "128",
    "--distinct-arms", "distinct64", "--in-line-arms", "distinct64",
    "--out", OUT("distinct-adapters-fork-b256")),)
# The fork with lighter shrink programs: one pipeline stage, or shrink K tiles of 128 or 64
# (a shrink program stages ~80 KB of x and A tiles in shared memory, which the GEMM's
# resident blocks may not leave free), at 64 rows (D = 16, the middle list) and 256 rows
# (D = 32 and 64, the middle list), each in line and forked beside the base GEMMs.
SUITES["issue37-fork-smem"] = (
    step("fork-smem", 120, "bench.lora_distinct_layer", "--cases", "16:8-16-32-64",
         "--choices", "tiles_graph,tiles_graph_s1,tiles_graph_k128,tiles_graph_k64",
         "--with-base", "--out", OUT("lora-distinct-layer-fork-smem")),
    step("fork-smem-b256", 150, "bench.lora_distinct_layer", "--rows", "256", "--cases",
         "32:8-16-32-64,64:8-16-32-64", "--choices",
         "tiles_graph,tiles_graph_s1,tiles_graph_k128,tiles_graph_k64", "--with-base",
         "--out", OUT("lora-distinct-layer-fork-smem-b256")),)
# One pipeline stage on the many-adapter tile lists (GRAPH_TILE_STAGES) in the engine: 16
# distinct adapters in a batch of 64 (the middle list) beside the same arm on two stages and
# base, interleaved (64 distinct at 64 rows run the row kernels, which have no stages); then
# one stage on the short lists, which kept two then (one adapter, 4 adapters of 16 rows), in
# one layer. Run at 752466d: distinct-adapters-stages-752466d-h100.json,
# lora-distinct-layer-stages-short-752466d-h100.json.
SUITES["issue37-stages"] = (
    dataclasses.replace(SUITES["issue37"][0], limit_s=200, argv=(
        *SUITES["issue37"][0].argv, "--distinct-arms", "distinct16", "--two-stage-arms",
        "distinct16", "--out", OUT("distinct-adapters-stages"))),
    step("stages-short", 90, "bench.lora_distinct_layer", "--cases",
         "1:16,1:64,4:8-16-32-64", "--choices", "tiles_graph,tiles_graph_s1", "--with-base",
         "--out", OUT("lora-distinct-layer-stages-short")),)
# The same at 256 rows: 64 distinct adapters in a batch of 256 (four rows each: the middle
# list, one stage since GRAPH_TILE_STAGES) beside the same arm on two stages and base.
SUITES["issue37-stages-b256"] = (step(
    "distinct-stages-b256", 260, "bench.serving", *GPU_7B, *_MID, "--arena-gb", "50",
    "--distinct-batch", "256", "--distinct-input", "256", "--distinct-output", "128",
    "--distinct-arms", "distinct64", "--two-stage-arms", "distinct64",
    "--out", OUT("distinct-adapters-stages-b256")),)
# One stage on the short (one-adapter) list too (GRAPH_TILE_STAGES on every decode graph's
# tile list since the short list gained in one layer at 64 and 256 rows,
# lora-distinct-layer-stages-short{,-b256}-*-h100.json): the engine's one-adapter arm on the
# LoRA kernels (no ride: the short list) beside the same arm on two stages and base,
# interleaved. At 1732685 a cold H100 gave it 86 s, which its compiles took (no repeat); at
# 002a98c it ran: 0.895x of base against 0.885x on two stages
# (distinct-adapters-stages-one-002a98c-h100.json). Its GPU tests belong to gpu-tests.
SUITES["issue37-stages-short"] = (step(
    "distinct-stages-one", 300, "bench.serving", *GPU_7B, "--scenarios", "distinct",
    "--arena-gb", "40", "--overhead-repeats", "3", "--distinct-arms", "one_unmerged",
    "--two-stage-arms", "one_unmerged", "--out", OUT("distinct-adapters-stages-one")),)
# Mixed steps' pipeline stages in one layer: the LoRA of a step of 64 decode rows and a prompt
# chunk, at 16 adapters and a 512-token chunk (16-row tiles in the engine: at most
# SHORT_TILES_MAX_TOKENS tokens), 4 adapters and 2,048 tokens, 2 rank-16 adapters and 2,048
# tokens (64-row tiles), the 64-row tiles on three stages (PREFILL_STAGES), two (as before)
# or one, the 16-row tiles on two (their own), one or three. At 002a98c (64-row tiles then on
# two stages, lora-distinct-layer-mixed-stages-002a98c-h100.json) three won every case.
SUITES["issue37-mixed-stages"] = (step(
    "mixed-stages", 120, "bench.lora_distinct_layer", "--cases",
    "16:8-16-32-64:chunk512,4:8-16-32-64:chunk2048,2:16:chunk2048", "--choices",
    "mixed_tiles64,mixed_tiles64_s2,mixed_tiles64_s1,mixed_tiles16,mixed_tiles16_s1,"
    "mixed_tiles16_s3", "--out", OUT("lora-distinct-layer-mixed-stages")),)
# The same in the engine: 16 and 64 distinct adapters a batch of 64 (mixed steps of ~3,700
# tokens: 64-row tiles) beside the same arms with mixed graphs' tile lists on two stages
# (--mixed-two-stage-arms) and base, interleaved. At f63146d a cold H100's 260 s ended it after
# 2 of 3 repeats (distinct-adapters-mixed-stages-f63146d-h100.json): 320 s.
SUITES["issue37-mixed-stages-engine"] = (dataclasses.replace(
    SUITES["issue37"][0], name="distinct-mixed-stages", limit_s=320, argv=(
        *SUITES["issue37"][0].argv, "--distinct-arms", "distinct16,distinct64",
        "--mixed-two-stage-arms", "distinct16,distinct64",
        "--out", OUT("distinct-adapters-mixed-stages"))),)
# The next device call in one (under 600 s on a cold H100): the GPU suite with the 64-row tiles'
# three stages (PREFILL_STAGES, not run there yet), then mixed steps' stages in one layer.
SUITES["issue37-next"] = (*SUITES["gpu-tests"], *SUITES["issue37-mixed-stages"])
# Both GPU check parts side by side on one GPU (each with a share of the host's cores).
SUITES["gpu-checks"] = (*in_lane(0, SUITES["gpu-tests"]), *in_lane(1, SUITES["model-agreement"]))
# More programs resident a multiprocessor on the decode tiles' one stage, and expand programs
# covering several column tiles (LoraTiles.expand_cols), one 7B layer with its GEMMs and the
# shrinks forked at 64 rows (D = 4 and 16), then 16 distinct adapters in the engine. At 51483c3
# (an H100; lora-distinct-layer-regs-51483c3-h100.json, distinct-adapters-tiles-51483c3-h100.json,
# the engine's 359 s cut after 1 of 3 repeats) that call also ran register caps of 168 and 128
# and column tiles held by hand, which lost and were removed with their arms; four pipelined
# 128-column tiles won and became the many lists' default (MANY_TILE_OVERRIDES). Since, the
# engine's arm runs the default against `cols1`, the expands as before it.
_REGS = "tiles_graph_s1,tiles_graph_s1_k128,tiles_graph_s1_n128c4a"
_TILES_ENGINE = dataclasses.replace(
    SUITES["issue37"][0], name="distinct-tiles", limit_s=300, argv=(
        *SUITES["issue37"][0].argv, "--distinct-arms", "distinct16", "--tile-variant-arms",
        "distinct16", "--tile-variants", "cols1,k128",
        "--out", OUT("distinct-adapters-tiles")))
SUITES["issue37-regs-engine"] = (
    step("regs", 150, "bench.lora_distinct_layer", "--cases", "4:8-16-32-64,16:8-16-32-64",
         "--choices", _REGS, "--with-base", "--out", OUT("lora-distinct-layer-regs")),
    _TILES_ENGINE)
SUITES["issue37-tiles-engine"] = (_TILES_ENGINE,)
# The GPU suite, then one layer at 256 rows (32 and 64 adapters on the middle list) with one
# 256-column tile an expand program and with four of 128, pipelined (the many lists' default
# since MANY_TILE_OVERRIDES, measured at 64 rows only).
SUITES["issue37-call-b"] = (*SUITES["gpu-tests"], step(
    "regs-b256", 180, "bench.lora_distinct_layer", "--rows", "256", "--cases",
    "32:8-16-32-64,64:8-16-32-64", "--choices", "tiles_graph_s1,tiles_graph_s1_n128c4a",
    "--with-base", "--out", OUT("lora-distinct-layer-regs-b256")))
# The whole many-adapter LoRA beside the base GEMM (shrinks and expands on a side stream, the
# expands into a buffer y took after both; `bench.lora_distinct_layer --fork-all`, suites
# issue37-forkall and issue37-call-c) lost at a1de8ba even without that add, the ceiling of
# folding it into y's consumer: one 7B layer at 64 rows, D = 16 on the tile list 244.9 us
# against 235.5 with the shrinks alone forked, D = 64 on the row kernels 330.5 against 317.7
# (lora-distinct-layer-forkall-a1de8ba-h100.json). Removed after a1de8ba.
# The many-adapter expands' column tiles (MANY_TILE_OVERRIDES) at 256 rows in the engine: 64
# distinct adapters in a batch of 256 (four rows each: the middle list) with them and with
# one column tile a program (`cols1`, as before), beside base, interleaved. In one layer they
# won there (lora-distinct-layer-regs-b256-a1de8ba-h100.json).
SUITES["issue37-tiles-b256"] = (step(
    "distinct-tiles-b256", 260, "bench.serving", *GPU_7B, *_MID, "--arena-gb", "50",
    "--distinct-batch", "256", "--distinct-input", "256", "--distinct-output", "128",
    "--distinct-arms", "distinct64", "--tile-variant-arms", "distinct64", "--tile-variants",
    "cols1", "--out", OUT("distinct-adapters-tiles-b256")),)
# Mixed steps' 64-row expands covering four 128-column tiles a program (PREFILL_TILES since
# f770983, where in one layer they beat one a program, and two, and eight of 64 columns:
# lora-distinct-layer-mixed-cols-f770983-h100.json) against one a program (`mixed_cols1`, as
# before): one 7B layer's mixed-step LoRA as in issue37-mixed-stages, then in the engine 16
# distinct adapters a batch of 64 (~3,700-token mixed steps: 64-row tiles) beside base,
# interleaved (a profile at bb81a4e, distinct-profile-bb81a4e-h100.json, gave those steps'
# expands 20.6 ms of 109.5).
SUITES["issue37-mixed-cols"] = (
    step("mixed-cols", 90, "bench.lora_distinct_layer", "--cases",
         "16:8-16-32-64:chunk512,4:8-16-32-64:chunk2048,2:16:chunk2048", "--choices",
         "mixed_tiles64,mixed_tiles64_c1", "--out", OUT("lora-distinct-layer-mixed-cols")),
    dataclasses.replace(SUITES["issue37"][0], name="distinct-mixed-cols", limit_s=320, argv=(
        *SUITES["issue37"][0].argv, "--distinct-arms", "distinct16", "--tile-variant-arms",
        "distinct16", "--tile-variants", "mixed_cols1",
        "--out", OUT("distinct-adapters-mixed-cols"))))
# Late admission (EngineConfig.admission_lead_ms, slora_core/admission.py): the worker keeps
# taking requests after a step returns until the step under way on the GPU is about to end,
# so a closed-loop successor arriving the hops after its predecessor's last token joins the
# next step instead of the one after (the late arrival that makes most of the gRPC TTFT the
# service adds, service-overhead-7b-gw4-late-78a7fae-h100.json). gRPC at 64 and 256 streams
# against the in-process loop (which never waits), the worker off and then (restarted, its
# kernels from its compile cache) with a 1 ms lead, in one run: one stack, one in-process
# engine for both.
def _admission(name: str, limit_s: int, repeats: int, levels: str = "64,256",
               per_stream: int = 4, stem: str = "service-overhead-7b-gw4-admission",
               extra: tuple[str, ...] = (), leads: str = "0,1") -> Step:
    return step(
        name, limit_s, "bench.service_overhead", *GPU_7B, "--num-pages", "2400",
        "--max-model-len", "256", "--concurrency", levels, "--requests-per-stream",
        str(per_stream), "--new-tokens", "64", "--client-procs", "8", "--repeats", str(repeats),
        "--gateway-procs", "4", "--client-channels", "8", "--worker-admission-leads", leads,
        *extra, "--out", OUT(stem))


SUITES["service-path-admission"] = (_admission("service-admission", 450, 2),)
# The same with one repeat a level, for a call with little device time left (222 s on an H100
# at f770983: the stack and the in-process engine, then ~45 s a lead and the worker's
# restart; service-overhead-7b-gw4-admission-f770983-h100.json).
SUITES["service-path-admission-1r"] = (_admission("service-admission-1r", 380, 1),)
# 256 streams only, each run three times as long (12 requests a stream: ~20 s a path), one
# repeat: the 2 s runs above swing by 10-40 ms of TTFT between repeats (230 s on an H100 at
# 2a3ea28, service-overhead-7b-gw4-admission-long-c256-2a3ea28-h100.json).
SUITES["service-path-admission-long"] = (_admission(
    "service-admission-long", 320, 1, levels="256", per_stream=12,
    stem="service-overhead-7b-gw4-admission-long-c256"),)
# Why the lead helps direct to the worker and not through the gateway: the long run with
# hop traces, each lead's requests under their own tags. `worker_added -> core_added` is a
# request's wait in the core's queue, `core_added -> core_started` its wait for the step()
# that launched its first step (the lead's window included); the JSON's hop_trace holds
# each leg's p50 / p90 per path and lead.
SUITES["service-path-admission-trace"] = (_admission(
    "service-admission-trace", 340, 1, levels="256", per_stream=12,
    stem="service-overhead-7b-gw4-admission-trace-c256",
    extra=("--trace-hops", "{out}/hops")),)
# Longer leads. In the trace at 79baaf4 (service-overhead-7b-gw4-admission-trace-c256-79baaf4-
# h100.json) a gateway request took 1.4 ms (p50; mean 4.1) from client to worker and its
# predecessor's last token ~1.3 ms back, while a 1 ms lead aims the next launch so near the
# step's end that the GPU idled ~300 us before each paced step and the slack that idling
# built (2.5-3 ms) left half the steps unpaced. A lead of 4 or 8 ms closes the window well
# before the step ends (a 256-row step is ~19 ms; at 64 rows ~10.5 ms, where 8 ms leaves no
# window: no pacing). Both levels, the hops traced. At 28946b2 neither lead helped: step()
# still waited for the step it had launched (fixed at 26fafc7; service-path-admission-after-
# sync runs late admission again).
SUITES["service-path-admission-leads"] = (_admission(
    "service-admission-leads", 480, 1, levels="64,256", per_stream=12, leads="0,4,8",
    stem="service-overhead-7b-gw4-admission-leads", extra=("--trace-hops", "{out}/hops")),)
# Where a closed-loop client's next request comes from: at 28946b2 the gateway's clients
# learned of a request's end ~15 ms after the core sent its last token (a first token takes
# ~3 ms: service-overhead-7b-gw4-admission-leads-28946b2-h100.json's hops), so successors
# reached the worker late in the step under way. The same levels without a lead, the end's
# hops traced (core_finish ... client_done).
SUITES["service-path-end-trace"] = (_admission(
    "service-end-trace", 300, 1, levels="64,256", per_stream=12, leads="0",
    stem="service-overhead-7b-gw4-end-trace", extra=("--trace-hops", "{out}/hops")),)
# Why a 4 ms lead opened no window at 256 streams: at 28946b2 every step() that launched new
# requests began ~1.4 ms after the previous step's output left, the requests drained at the
# loop's top (hops of service-overhead-7b-gw4-admission-leads-28946b2-h100.json). Hop traces
# now also log each step() entry (`loop_step`) and each pacer decision (`loop_wait`: the wait
# and what it was made of).
SUITES["service-path-pacer-trace"] = (_admission(
    "service-pacer-trace", 300, 1, levels="256", per_stream=12, leads="0,4",
    stem="service-overhead-7b-gw4-pacer-trace-c256", extra=("--trace-hops", "{out}/hops")),)
# Host-blocking copies after a step's launch (slora_core/host_copy.py): the in-process engine
# in a closed loop at 256 streams, greedy and sampled requests, the old synchronizing copies
# (patched in) against host_values, interleaved, two repeats (bench/host_sync.py).
SUITES["host-sync"] = (step(
    "host-sync", 200, "bench.serving", *GPU_7B, "--scenarios", "hostsync", "--arena-gb", "30",
    "--out", OUT("serving-hostsync")),)
# Late admission again once step() no longer waited for the step it had launched (26fafc7):
# the 256-stream measures before it left the pacer no time (service-overhead-7b-gw4-pacer-
# trace-c256-87cd49f-h100.json). Off, 1 ms and 4 ms at 64 and 256 streams, 12 requests a
# stream, hops traced (the loop's waits among them); with the finished requests' ends woken
# ahead of the running streams (2e7e94c), `worker_complete -> gateway_complete_in` says what
# that saved.
SUITES["service-path-admission-after-sync"] = (_admission(
    "service-admission-after-sync", 480, 1, levels="64,256", per_stream=12, leads="0,1,4",
    stem="service-overhead-7b-gw4-admission-after-sync", extra=("--trace-hops", "{out}/hops")),)
# The same once the closed loop no longer runs in waves. At 57ee3f6 the pacer opened a window
# before nearly every step and took almost every successor inside one, yet no lead cut the
# added TTFT (service-overhead-7b-gw4-admission-after-sync-57ee3f6-h100.json): every request
# there asks for 64 tokens, so a level's streams finish together and their successors queue
# for the prefill budget whatever the hops. Lengths spread 32-96 (fixed by each prompt, the
# same on every path), late admission off and at 1 ms, 64 and 256 streams, 8 requests a
# stream (~250 s on an H100), hops traced: the JSON's hop_trace_joins say how many requests
# the first step() after their arrival took.
SUITES["service-path-admission-spread"] = (_admission(
    "service-admission-spread", 330, 1, levels="64,256", per_stream=8, leads="0,1",
    stem="service-overhead-7b-gw4-admission-spread32",
    extra=("--new-tokens-spread", "32", "--trace-hops", "{out}/hops-spread")),)
# The prefill budget in the same waves. In the trace at 57ee3f6 the first step() after a
# gateway request reached the worker took it less often with a lead than without (64 streams:
# 57% at 1 ms, 72% at 4 ms, 93% off; 256 streams: 41%, 56%, 62%); nearly all the others were
# in the core's queue and left (hop-loops-admission-after-sync-57ee3f6-h100.json's joins): a
# window gathers a wave's successors for one step, whose 512-token budget (EngineConfig.
# max_num_batched_tokens, less the decode rows) or free pages leave the rest to the steps
# after. Every request at 64 tokens as there, the budget at 2,048 tokens for the in-process
# engine and the worker alike, late admission off and at 1 ms.
SUITES["service-path-admission-budget"] = (_admission(
    "service-admission-budget", 330, 1, levels="64,256", per_stream=8, leads="0,1",
    stem="service-overhead-7b-gw4-admission-budget2048",
    extra=("--max-num-batched-tokens", "2048", "--trace-hops", "{out}/hops-budget")),)
# Both in one call (~520 s on an H100; with --pack, as the traces are many files).
SUITES["service-path-ttft-next"] = (*SUITES["service-path-admission-spread"],
                                    *SUITES["service-path-admission-budget"])
# The spread run decided for the pacer once (3df18d9, H100, one repeat: request TTFT p50 added
# through the gateway 6.8 -> 3.9 ms at 64 streams and 20.5 -> 1.6 ms at 256;
# service-overhead-7b-gw4-admission-spread32-3df18d9-h100.json), where the 2,048-token budget
# in waves lost (+27.2 -> +37.3 ms at 256; ...-admission-budget2048-3df18d9-h100.json). The
# same spread, three repeats a level and no hop trace, before the lead becomes the default
# (231 s for one repeat: 73 s to a routable stack, 31 s to restart the worker, ~32 s a
# level; three repeats ~490 s).
SUITES["service-path-admission-spread-3r"] = (_admission(
    "service-admission-spread-3r", 540, 3, levels="64,256", per_stream=8, leads="0,1",
    stem="service-overhead-7b-gw4-admission-spread32-3r",
    extra=("--new-tokens-spread", "32")),)
# Hop tracing on against off, in one call. Untraced, three repeats kept none of the traced
# run's gain at 256 streams (gateway request TTFT p50 58.3-59.1 ms at 1 ms against 58.9-59.5
# off; service-overhead-7b-gw4-admission-spread32-3r-c123b76-h100.json), while both traced
# runs showed it (60.4 -> 41.6 ms at 3df18d9, 60.7 -> 41.9 ms at 8461c0f; ...-spread32-
# {3df18d9,8461c0f}-h100.json). The hosts differed too: the untraced run's stack took 111 s
# to be routable, the traced runs' 73 s. On one host, 256 streams: untraced off and at 1 ms
# (~175-230 s), then at 1 ms traced (every event), then at 1 ms with only the engine core's
# events written (the clients still send request ids, as traced; the other processes write
# nothing), ~120-160 s each.
# At 9c7f623 the H100 that came was a slow host (the stack routable 107-110 s after the start,
# not 73): the untraced step ran past its 240 s during its second lead (lead 0 only in
# service-overhead-7b-gw4-admission-spread32-untraced-c256-9c7f623-h100.json: gateway +19.2
# ms, worker direct +309) and the traced ones past their 165 s. Limits for such a host
# (untraced ~300 s, traced ~220 s), the core-only step in a call of its own.
SUITES["service-path-admission-trace-ab"] = (
    _admission("service-admission-untraced", 330, 1, levels="256", per_stream=8,
               stem="service-overhead-7b-gw4-admission-spread32-untraced-c256",
               extra=("--new-tokens-spread", "32")),
    _admission("service-admission-traced", 240, 1, levels="256", per_stream=8, leads="1",
               stem="service-overhead-7b-gw4-admission-spread32-traced-c256",
               extra=("--new-tokens-spread", "32", "--trace-hops", "{out}/hops-ab")))
# Only the engine core's events written (the clients still send request ids, as traced; the
# other processes write nothing), beside the untraced run at 1 ms again on the same host.
SUITES["service-path-admission-trace-core"] = (
    _admission("service-admission-traced-core", 240, 1, levels="256", per_stream=8, leads="1",
               stem="service-overhead-7b-gw4-admission-spread32-traced-core-c256",
               extra=("--new-tokens-spread", "32", "--trace-hops", "{out}/hops-core",
                      "--trace-hops-events", "core_,loop_")),
    _admission("service-admission-untraced-1ms", 240, 1, levels="256", per_stream=8,
               leads="1", stem="service-overhead-7b-gw4-admission-spread32-untraced-1ms-c256",
               extra=("--new-tokens-spread", "32")))
def _front(name: str, limit_s: int, repeats: int, leads: str, stem: str,
           *extra: str, levels: str = "256") -> Step:
    """The worker front's runs: output lengths 32-96, 8 requests a stream, untraced."""
    return _admission(name, limit_s, repeats, levels=levels, per_stream=8, leads=leads,
                      stem=stem, extra=("--new-tokens-spread", "32", *extra))


# The worker front's mux writer: streams pumped in one pass, a frame written every ~0.5 ms of
# pumping (--mux-pump-ms, the default since f33e615) against one frame for a step's every
# stream (0), each with the late-admission lead off and at 1 ms, the worker restarted between
# them, untraced, 256 streams (~370 s on a fast host). On a 2-core CPU a new request's wait
# for the front's loop went from ~10 ms to ~2 ms p50 at 256 streams (python -m
# bench.front_mux_cost); here: what the gateway adds to TTFT, and whether a shorter hop lets
# the lead's window catch the successors untraced.
SUITES["service-path-front-pump"] = (
    _front("service-front-pump", 540, 1, "0,1", "service-overhead-7b-gw4-front-pump-c256",
           "--worker-mux-pump-ms", "0,0.5"),)
# The 1 ms lead with the pump gave +15.0 ms against +19.5 off at 256 streams, one repeat each
# (service-overhead-7b-gw4-front-pump-c256-3b33b95-h100.json): three repeats of both, the
# pump at its default, before the lead becomes a default (~380 s on a slow host).
SUITES["service-path-front-pump-3r"] = (
    _front("service-front-pump-3r", 540, 3, "0,1", "service-overhead-7b-gw4-front-pump-3r-c256"),)
# The 1 ms lead with the pump once more on another host (one repeat; the lead-off figure at
# 256 streams was 19.2-20.5 ms on every host). Not for a call with ~300 s left: on a slow host
# it was cut at 189 s before it measured (the stack routable at 121.5 s, then the in-process
# engine's warm-up; ed5e48c); give it ~260 s.
SUITES["service-path-front-pump-lead1"] = (
    _front("service-front-pump-lead1", 260, 1, "1",
           "service-overhead-7b-gw4-front-pump-lead1-c256"),)
# The writer's slice at 0.25 ms against the default 0.5 ms, both with the 1 ms lead (one
# repeat, ~300 s on a slow host). On a 2-core CPU, once requests being taken go before the next
# slice (36419fc), a new request's wait for the front tracks the slice: 0.37-0.40 ms p50 at
# 0.25, 0.65-0.67 at 0.5, 1.25-1.29 at 1, the front's CPU a step the same
# (front-mux-budgets-4839bca-cpu.json); on a GPU host every frame is one gRPC write more.
SUITES["service-path-front-budget"] = (
    _front("service-front-budget", 330, 1, "1", "service-overhead-7b-gw4-front-budget-c256",
           "--worker-mux-pump-ms", "0.25,0.5"),)
# At 64 streams each of 4 gateway processes holds 16 streams of the worker, under the auto
# upstream's 32, so it calls per request; once the front pumps its mux streams and writes them
# in place (a 64-stream step's delivery 1.8 ms of front CPU on a 2-core CPU,
# front-mux-inplace-99ef60b-r1-cpu.json) the mux may win there too: the auto gateway beside one
# that always takes the mux (`--also-upstream mux`), the lead at its 1 ms default, three
# repeats (~330 s).
SUITES["service-path-mux-c64"] = (
    _front("service-mux-c64", 420, 3, "1", "service-overhead-7b-gw4-mux-c64",
           "--also-upstream", "mux", levels="64"),)
# The 1 ms lead became the default on its 256-stream figures with the new front (0.25 ms
# [0.24, 0.54] added against 19.2 off, three repeats;
# service-overhead-7b-gw4-front-pump-3r-c256-f65c29b-h100.json); at 64 streams it was last
# measured before the front's changes (6.0 against 7.2 ms off, c123b76): off against 1 ms,
# three repeats (~330 s).
SUITES["service-path-lead-c64-3r"] = (
    _front("service-lead-c64-3r", 420, 3, "0,1", "service-overhead-7b-gw4-lead-c64-3r",
           levels="64"),)
# Both questions at 64 streams in one call (one stack start, ~100 s, instead of two): the
# lead off and at 1 ms, each through the auto gateway (per call at 64) and one always on the
# mux, three repeats (~380 s on a slow host). On a 2-core CPU with a fake worker the mux handed
# a finished stream's successor over 0.85 ms sooner at 16 streams a gateway process
# (gateway-hop-c16-c32-1569450-cpu.json).
SUITES["service-path-c64-next"] = (
    _front("service-c64-next", 500, 3, "0,1", "service-overhead-7b-gw4-c64-next",
           "--also-upstream", "mux", levels="64"),)
# Where the rest goes at 64 streams, hops traced at the 1 ms default (one repeat, ~250 s). At
# 3df18d9 (64 streams, per call below the auto upstream's 32 streams a gateway process) a
# finished request's end took 2.8-2.9 ms p50 from the core's send to the front's pump
# (`core_finish -> worker_complete`) against 0.5 ms for a first token (`core_first ->
# worker_first_out`), though both are woken a loop turn ahead
# (service-overhead-7b-gw4-admission-spread32-3df18d9-h100.json's hop_trace).
SUITES["service-path-lead-c64-traced"] = (
    _front("service-lead-c64-traced", 300, 1, "1", "service-overhead-7b-gw4-lead-c64-traced",
           "--trace-hops", "{out}/hops-c64", levels="64"),)
# The HTTP target (<= 20 ms TTFT p50 added and >= 0.95x throughput at 256 streams) was last
# measured with the lead off (aiohttp 19.5 ms, 1.028x; service-overhead-7b-gw4-378382f-h200.json):
# aiohttp clients beside gRPC, off against 1 ms, one repeat (~400 s).
SUITES["service-path-http-lead"] = (
    _front("service-http-lead", 480, 1, "0,1", "service-overhead-7b-gw4-http-lead-c256",
           "--http", "--http-clients", "aiohttp"),)
# The gateway's auto upstream takes the mux from 8 streams in flight a process since 96c5224
# (at 64 streams with the 1 ms lead the mux added 1.28 ms [1.07, 5.70] against 5.53 per call,
# service-overhead-7b-gw4-c64-next-f02af64-h100.json): the new default through the auto
# gateway beside one call a request, at 64 streams and at 32 (8 a process, the threshold),
# the lead at its default, three repeats (~300 s).
SUITES["service-path-auto8"] = (
    _front("service-auto8", 500, 3, "1", "service-overhead-7b-gw4-auto8",
           "--also-upstream", "call", levels="32,64"),)
# HTTP at 256 streams with the lead, three repeats: one repeat gave aiohttp 19.6 ms at 1.041x,
# at the target's edge, on a host where the lead did not catch over gRPC either
# (service-overhead-7b-gw4-http-lead-c256-f02af64-h100.json; ~330 s).
SUITES["service-path-http-lead-3r"] = (
    _front("service-http-lead-3r", 480, 3, "1", "service-overhead-7b-gw4-http-lead-3r-c256",
           "--http", "--http-clients", "aiohttp"),)
# A shorter lead widens the window a successor must reach the core in (at 64 streams ~4 ms
# from the core's send, against 8.4-9.6 ms back per call: docs/performance.md, "The mux at 64
# streams with the lead"), at the risk of the GPU idling where a wait overruns: 0.5 ms
# against the 1 ms default, 64 and 256 streams, the auto gateway (the mux at both since
# 96c5224), two repeats (~420 s).
SUITES["service-path-lead-half"] = (
    _front("service-lead-half", 540, 2, "0.5,1", "service-overhead-7b-gw4-lead-half",
           levels="64,256"),)
# The engine core's early outputs on the GPU: from the read of a step's ids to the send that
# carries them, with them (the default since b140f8c) and without, one engine, alternating, 3
# repeats, batches of 64 and 256 decoding requests (on this 2-core CPU 0.29 against 0.73 ms
# and 1.16 against 2.23; profile-core-early-b64-4689ba1-cpu.json; ~2 x 150 s).
# Batch 256 at 128-token prompts in 4,000 pages (32 GB of KV; 512-token ones would not fit).
SUITES["core-profile-early"] = tuple(
    step(f"core-early-b{b}", 200, "bench.profile_core", *GPU_7B, "--batch", str(b),
         "--context", context, "--num-pages", pages, "--adapters", "--async-steps",
         "--early-outputs", "on,off", "--repeats", "3", "--out", OUT(f"profile-core-early-b{b}"))
    for b, context, pages in ((64, "512", "2400"), (256, "128", "4000")))
