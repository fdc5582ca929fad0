"""Does one request with the largest allowed stop list slow the others? (issue 14)

A local stack (demo model, one worker, one gateway, gRPC). Each round runs `--streams` ordinary
streams beside one extra stream, whose only difference between the two conditions is its stop
list: none ("plain") or the cap, `Limits.stop_strings` strings of `Limits.stop_string_bytes`
random characters that never match ("max_stops"). The batch is the same size in both, so the
difference is the stop list's cost alone. Conditions alternate (ABBA) to cancel drift. The
figure is the ordinary streams' median per-token gap, max_stops over plain (target <= 1.5).

Also timed: how long the gateway takes to refuse a list past the cap (100,000 strings) and a
1 MiB prompt (INVALID_ARGUMENT before any tokenization).

    python -m bench.stop_list_load --out bench/results/stop_list_load_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.run_record import commit_id
from devtools.demo_assets import write_demo_assets
from devtools.demo_stack import (
    Stack,
    StackConfig,
    publish_demo_adapters,
    wait_until_routable,
)
from services.common.limits import DEFAULT_LIMITS
from services.common.processes import exit_on_sigterm
from services.control_plane.api.client import AdminClient
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=4, help="ordinary streams per round")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=8, help="rounds per condition (ABBA order)")
    p.add_argument("--out", default="")
    return p.parse_args()


def max_stop_list(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits
    return ["".join(rng.choice(alphabet) for _ in range(DEFAULT_LIMITS.stop_string_bytes))
            for _ in range(DEFAULT_LIMITS.stop_strings)]


def request(i: int, new_tokens: int, stop: list[str]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=f"Story {i}: once upon a time", routing_key=str(i),
        sampling=pb.SamplingOptions(max_new_tokens=new_tokens, temperature=0, ignore_eos=True,
                                    stop=stop))


async def stream(stub: pb_grpc.InferenceServiceStub, req: pb.GenerateRequest,
                 md: tuple[tuple[str, str], ...]) -> float:
    """Mean gap between chunks after the first (seconds per token, as the client sees it)."""
    stamps = []
    tokens = 0
    async for r in stub.Generate(req, metadata=md, timeout=120):
        if r.HasField("chunk"):
            stamps.append(time.perf_counter())
            tokens += len(r.chunk.token_ids)
    return (stamps[-1] - stamps[0]) / max(1, tokens - 1)


async def one_round(stub: pb_grpc.InferenceServiceStub, md: tuple[tuple[str, str], ...],
                    args: argparse.Namespace, extra_stop: list[str], seed: int) -> list[float]:
    ordinary = [request(seed * 100 + i, args.new_tokens, []) for i in range(args.streams)]
    extra = request(seed * 100 + 99, args.new_tokens, extra_stop)
    gaps = await asyncio.gather(*(stream(stub, r, md) for r in [*ordinary, extra]))
    return list(gaps[:-1])


async def refusal_s(stub: pb_grpc.InferenceServiceStub, md: tuple[tuple[str, str], ...],
                    req: pb.GenerateRequest) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        async for _ in stub.Generate(req, metadata=md, timeout=60):
            pass
        code = "OK"
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
    return {"code": code, "seconds": round(time.perf_counter() - start, 4)}


async def measure(gateway: str, token: str, args: argparse.Namespace) -> dict[str, Any]:
    md = (("authorization", f"Bearer {token}"),)
    stops = max_stop_list()
    gaps: dict[str, list[float]] = {"plain": [], "max_stops": []}
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        await one_round(stub, md, args, [], seed=999)  # warm-up
        for r in range(args.rounds):
            order = ["plain", "max_stops"] if r % 2 == 0 else ["max_stops", "plain"]
            for cond in order:
                gaps[cond] += await one_round(stub, md, args, stops if cond == "max_stops"
                                              else [], seed=r)
        over_cap = request(0, 4, ["x"] * 100_000)
        huge = pb.GenerateRequest(text="x" * (1 << 20))
        refusals = {"100000_stop_strings": await refusal_s(stub, md, over_cap),
                    "1MiB_prompt": await refusal_s(stub, md, huge)}
    med = {k: statistics.median(v) for k, v in gaps.items()}
    return {"per_token_gap_ms_median": {k: round(v * 1e3, 3) for k, v in med.items()},
            "ratio_max_stops_over_plain": round(med["max_stops"] / med["plain"], 3),
            "samples": {k: len(v) for k, v in gaps.items()}, "refusals": refusals}


def main() -> int:
    args = parse_args()
    exit_on_sigterm()  # a time limit still stops the stack (`finally`)
    root = Path(tempfile.mkdtemp(prefix="slora-stoplist-"))
    write_demo_assets(root / "demo")
    stack = Stack(StackConfig(demo_dir=root / "demo", state_dir=root / "state"))
    try:
        stack.start_control_plane()
        token = publish_demo_adapters(AdminClient.connect(stack.cp_address, stack.admin_token),
                                      root / "demo", [])
        stack.start_worker("worker-0")
        stack.start_gateway()
        gateway = stack.gateway_addresses["gateway"]
        wait_until_routable(gateway, token, [])
        figures = asyncio.run(measure(gateway, token, args))
    finally:
        stack.stop()
    result = {
        "command": "python -m bench.stop_list_load " + " ".join(sys.argv[1:]),
        "commit": commit_id(),
        "hardware": f"{platform.machine()} CPU ({platform.processor() or 'unknown'}), shared",
        "streams": args.streams, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "stop_list": {"strings": DEFAULT_LIMITS.stop_strings,
                      "bytes_each": DEFAULT_LIMITS.stop_string_bytes},
        "target": {"ratio_max_stops_over_plain": "<= 1.5"},
        **figures,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
