"""Names and request limits (services.common.names, limits, wire): the charset and length of
every kind of name, paths kept inside their root, bounded error messages, caps on Generate
requests, and undecodable requests answered INVALID_ARGUMENT instead of UNKNOWN."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.common.errors import InvalidArgument
from services.common.limits import DEFAULT_LIMITS, Limits, check_generate, check_n
from services.common.names import (
    check_adapter_id,
    check_name,
    check_version,
    check_worker_id,
    inside,
    shown,
)
from services.common.server import start_server
from services.worker.disk_cache import DiskCache, VersionSource
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from slora_core.adapters import AdapterFormatError

GOOD_IDS = ["a", "acme/support-bot", "org.x/team_1/model-v2", "A" * 128]
BAD_IDS = ["", "../etc", "a/../../x", "a/./b", "/abs", "a//b", "a/", ".hidden", "-flag",
           "a b", "a\\b", "a\x00b", "é", "A" * 129, "a/" * 70 + "a"]


@pytest.mark.parametrize("value", GOOD_IDS)
def test_good_adapter_ids(value: str) -> None:
    assert check_adapter_id(value) == value


@pytest.mark.parametrize("value", BAD_IDS)
def test_bad_adapter_ids(value: str) -> None:
    with pytest.raises(InvalidArgument):
        check_adapter_id(value)


def test_versions_tenants_workers() -> None:
    for good in ("v1", "v3.2.1", "1.0+build5", "2024-01-01"):
        assert check_version(good) == good
    for bad in ("", "../v1", "v1/x", "+v", "v" * 65):
        with pytest.raises(InvalidArgument):
            check_version(bad)
    assert check_name("tenant", "acme-1") == "acme-1"
    for bad in ("", "a/b", "..", "t" * 65):
        with pytest.raises(InvalidArgument):
            check_name("tenant", bad)
    assert check_worker_id("host-1.example-50061") == "host-1.example-50061"
    for bad in ("", "w/1", "w" * 129):
        with pytest.raises(InvalidArgument):
            check_worker_id(bad)


def test_messages_never_echo_unbounded_input() -> None:
    huge = "x" * 1_000_000
    with pytest.raises(InvalidArgument) as caught:
        check_adapter_id(huge)
    assert len(str(caught.value)) < 400 and "1000000 chars" in str(caught.value)
    assert shown("abc") == "'abc'"


def test_inside_refuses_escapes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    assert inside(root, "a", "b") == (root / "a" / "b").resolve()
    for parts in (("..", "x"), ("a", "..", "..", "x"), ("/etc",), ("",)):
        with pytest.raises(InvalidArgument):
            inside(root, *parts)
    (root / "link").symlink_to(tmp_path)  # a link planted under the root leads nowhere
    with pytest.raises(InvalidArgument):
        inside(root, "link", "x")


def test_disk_cache_refuses_traversal(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "cache")
    for adapter_id, version in (("a/../../escaped", "v1"), ("ok", "../../escaped")):
        src = VersionSource(adapter_id, version, (tmp_path / "nowhere").as_uri(), "0" * 64)
        with pytest.raises(AdapterFormatError):
            cache.fetch(src)
    assert list((tmp_path / "cache").iterdir()) == []
    assert not (tmp_path / "escaped").exists()


def _request(**sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", adapter=pb.AdapterRef(adapter_id="acme/bot"),
                              sampling=pb.SamplingOptions(**sampling))  # type: ignore[arg-type]


def test_limits_accept_the_maximum() -> None:
    limits = DEFAULT_LIMITS
    check_generate(_request(stop=["s" * limits.stop_string_bytes] * limits.stop_strings,
                            top_logprobs=limits.top_logprobs))
    check_generate(pb.GenerateRequest(text="é" * (limits.prompt_bytes // 2)))
    check_n(limits.n)


@pytest.mark.parametrize("request_", [
    _request(stop=["x"] * 100_000),
    _request(stop=["x" * 257]),
    _request(stop=[""]),
    _request(top_logprobs=21),
    _request(top_logprobs=-1),
    _request(stop_token_ids=list(range(65))),
    _request(max_new_tokens=-1),
    pb.GenerateRequest(text="x" * (1 << 20)),
    pb.GenerateRequest(text="é" * (DEFAULT_LIMITS.prompt_bytes // 2 + 1)),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 200_000)),
    pb.GenerateRequest(text="x", adapter=pb.AdapterRef(adapter_id="a/../b")),
    pb.GenerateRequest(text="x", adapter=pb.AdapterRef(adapter_id="x" * 1_000_000)),
    pb.GenerateRequest(text="x", adapter=pb.AdapterRef(adapter_id="a", version="../v")),
    pb.GenerateRequest(text="x", request_id="r" * 129),
    pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x" * (1 << 20))]),
], ids=lambda r: str(len(r.SerializeToString())))
def test_limits_refuse_fast(request_: pb.GenerateRequest) -> None:
    start = time.perf_counter()
    with pytest.raises(InvalidArgument) as caught:
        check_generate(request_)
    assert time.perf_counter() - start < 0.05  # refused before anything proportional runs
    assert len(str(caught.value)) < 400


def test_limits_are_configurable() -> None:
    with pytest.raises(InvalidArgument):
        check_generate(_request(stop=["a", "b"]), Limits(stop_strings=1))
    with pytest.raises(InvalidArgument):
        check_n(0)
    with pytest.raises(InvalidArgument):
        check_n(17)


class _Echo(pb_grpc.InferenceServiceServicer):
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(chunk=pb.Chunk(text=request.text))


async def _call(port: int, payload: bytes) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/slora.v1.InferenceService/Generate",
                                    request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)(payload)
        try:
            texts = [r.chunk.text async for r in call]
            return grpc.StatusCode.OK, "".join(texts)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""


def test_invalid_utf8_on_the_wire_is_invalid_argument() -> None:
    async def main() -> None:
        handle = await start_server(
            "127.0.0.1:0", lambda s: pb_grpc.add_InferenceServiceServicer_to_server(_Echo(), s),
            ["slora.v1.InferenceService"])
        try:
            good = pb.GenerateRequest(text="x").SerializeToString()
            assert await _call(handle.port, good) == (grpc.StatusCode.OK, "x")
            code, details = await _call(handle.port, good.replace(b"x", b"\xff"))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in details
            code, _ = await _call(handle.port, b"\x12\xff\xff")  # truncated message
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await handle.server.stop(0)

    asyncio.run(main())


def test_security_doc_lists_every_request_cap() -> None:
    """docs/security.md's table names each cap of `Limits` with its value."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "security.md").read_text()
    table = doc[doc.index("## Request limits"):doc.index("## Registration")]
    numbers = {int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", table)}
    for f in dataclasses.fields(DEFAULT_LIMITS):
        value = getattr(DEFAULT_LIMITS, f.name)
        shown = value >> 10 if f.name == "prompt_bytes" else value  # written as 512 KiB
        assert shown in numbers, f"docs/security.md does not give the {f.name} cap ({value})"
    for field_name in ("request_id", "routing_key", "token_ids", "stop_token_ids", "messages"):
        assert f"`{field_name}`" in table or f"`sampling.{field_name}`" in table, field_name
