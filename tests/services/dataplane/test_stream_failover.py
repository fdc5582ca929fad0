"""Stream failover on the gateway's routing path (gRPC and HTTP share it): a worker that fails
mid-generation is replaced by the next one, which continues after the tokens the client already
has (`resume_token_ids`), so the client's stream equals the uninterrupted one; requests that
cannot resume exactly, and deterministic errors, end with the error instead. Scripted workers
(gateway_harness.py) generate greedily from the whole context, as a model does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from services.common import errors as e
from services.worker.resume import resumed_end
from slora.v1 import inference_pb2 as pb
from slora_core.detokenizer import TextStream
from slora_core.sampling_params import SamplingParams
from slora_core.tokenizer import Tokenizer
from tests.services.dataplane.dp_support import PROMPTS, generate, request
from tests.services.dataplane.gateway_harness import (
    expected_output,
    run_call,
    started,
    stop_all,
)
from tests.services.dataplane.test_worker_faults import start_worker

PROMPT = [3, 1, 4, 1, 5]


def ids_request(max_new_tokens: int = 20, **extra: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT),
                              sampling=pb.SamplingOptions(max_new_tokens=max_new_tokens),
                              **extra)  # type: ignore[arg-type]


def first_fails_at(position: int, error: e.ServiceError | None = None):  # type: ignore[no-untyped-def]
    """A fail_with for the first worker called: fails at output `position`, once."""
    def fail(request: pb.GenerateRequest, pos: int) -> e.ServiceError | None:
        if pos == position and not request.resume_token_ids:
            return error or e.Unavailable("Stream removed")
        return None
    return fail


def test_a_stream_broken_mid_generation_is_resumed_on_the_next_worker() -> None:
    async def scenario() -> None:
        router, workers = await started("w1", "w2")
        for w in workers:
            w.fail_with = first_fails_at(7)
        try:
            out = await run_call(router, ids_request(20))
            assert out.error is None, out.error
            assert out.token_ids == expected_output(PROMPT, 20)
            resumed = [c for w in workers for c in w.calls if c.resume_token_ids]
            assert len(resumed) == 1
            assert list(resumed[0].resume_token_ids) == expected_output(PROMPT, 7)
            assert router.metrics.resumed._value.get() == 1
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


def test_a_stream_resumed_twice_still_equals_the_uninterrupted_one() -> None:
    """Three workers, the first two failing at different points."""
    async def scenario() -> None:
        router, workers = await started("w1", "w2", "w3")
        broken: dict[str, int] = {}

        def fail(request: pb.GenerateRequest, pos: int) -> e.ServiceError | None:
            # Each worker fails once, at a point after where its stream started.
            name = next(w.worker_id for w in workers if w.calls and w.calls[-1] is request)
            if name not in broken and len(broken) < 2 and pos >= len(request.resume_token_ids) + 3:
                broken[name] = pos
                return e.Internal("Received RST_STREAM with error code 2")
            return None

        for w in workers:
            w.fail_with = fail
        try:
            out = await run_call(router, ids_request(16))
            assert out.error is None, out.error
            assert out.token_ids == expected_output(PROMPT, 16)
            assert len(broken) == 2 and router.metrics.resumed._value.get() == 2
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


def test_clients_cannot_send_resume_token_ids() -> None:
    async def scenario() -> None:
        router, workers = await started("w1")
        try:
            out = await run_call(router, ids_request(4, resume_token_ids=[1, 2]))
            assert out.error is not None and out.error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert not workers[0].calls
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


def test_structured_output_and_deterministic_errors_are_not_resumed() -> None:
    async def scenario() -> None:
        router, workers = await started("w1", "w2")
        try:
            cases = [
                (ids_request(10, structured_output=pb.StructuredOutput(regex="[a-z]+")),
                 e.Unavailable("Stream removed"), grpc.StatusCode.UNAVAILABLE),
                (ids_request(10), e.Internal("non-finite logits", deterministic=True),
                 grpc.StatusCode.INTERNAL),
            ]
            for request, error, code in cases:
                for w in workers:
                    w.calls.clear()
                    w.fail_with = first_fails_at(4, error)
                out = await run_call(router, request)
                assert out.error is not None and out.error.code == code, out.error
                assert out.token_ids == expected_output(PROMPT, 4)
                assert sum(len(w.calls) for w in workers) == 1
            assert router.metrics.resumed._value.get() == 0
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


@pytest.mark.slow  # a worker process: ~15 s on a 2-core CPU
def test_a_worker_resumes_greedy_and_seeded_streams_exactly(demo_dir: Path,
                                                            tmp_path: Path) -> None:
    """The worker's side: the same request with `resume_token_ids` = the first n tokens of its
    uninterrupted output gives the rest of that output, token for token and character for
    character (text held back by the detokenizer included), and usage of the whole stream."""
    worker, address, _, _ = start_worker(demo_dir, tmp_path)
    tokenizer = Tokenizer.from_dir(demo_dir / "model")
    try:
        for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9, "seed": 7}):
            whole = generate(address, request(max_new_tokens=24, ignore_eos=True, **sampling))
            assert whole.error is None and len(whole.token_ids) == 24
            for n in (1, 9, 23, 24):
                req = request(max_new_tokens=24, ignore_eos=True, **sampling)
                req.resume_token_ids[:] = whole.token_ids[:n]
                rest = generate(address, req)
                assert rest.error is None, rest.details
                assert rest.token_ids == whole.token_ids[n:], (sampling, n)
                # What the first worker had released after n tokens, then the rest.
                text = TextStream(tokenizer, tokenizer.encode(PROMPTS[0]))
                sent = "".join(text.append(t) for t in whole.token_ids[:n])
                assert sent + rest.text == whole.text, (sampling, n)
                assert rest.complete is not None
                assert rest.complete.usage.completion_tokens == 24
                assert rest.complete.usage.prompt_tokens == whole.complete.usage.prompt_tokens
        # A stream that had matched its stop string (cut there) when its end was lost: the
        # resumed call only ends it, with the text it held back and finish_reason "stop".
        whole = generate(address, request(max_new_tokens=24, ignore_eos=True, temperature=0))
        stop = whole.text[12:15]
        cut = generate(address, request(max_new_tokens=24, ignore_eos=True, temperature=0,
                                         stop=[stop]))
        assert cut.complete is not None and cut.complete.finish_reason == "stop"
        req = request(max_new_tokens=24, ignore_eos=True, temperature=0, stop=[stop])
        req.resume_token_ids[:] = cut.token_ids
        rest = generate(address, req)
        assert rest.error is None and rest.token_ids == [], rest.details
        assert rest.complete is not None and rest.complete.finish_reason == "stop"
        text = TextStream(tokenizer, tokenizer.encode(PROMPTS[0]), (stop,))
        sent = "".join(text.append(t) for t in cut.token_ids)
        assert sent + rest.text == cut.text
    finally:
        worker.kill()


def test_resumed_tokens_that_already_end_the_stream() -> None:
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(9,))
    assert resumed_end([], params, [2], stopped=False) is None
    assert resumed_end([5, 6], params, [2], stopped=False) is None
    assert resumed_end([5, 2], params, [2], stopped=False) == "stop"  # end of sequence
    assert resumed_end([5, 9], params, [2], stopped=False) == "stop"  # a stop token
    assert resumed_end([5, 6], params, [2], stopped=True) == "stop"  # a stop string
    assert resumed_end([5] * 8, params, [2], stopped=False) == "length"
    ignoring = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert resumed_end([5, 2], ignoring, [2], stopped=False) is None


def test_the_http_api_resumes_on_the_same_routing_path() -> None:
    """/v1/completions (streamed and not) through the real HttpApi over the same Router: the
    broken worker's stream is resumed and the text equals the uninterrupted one."""
    import httpx

    from services.gateway.http_api import HttpApi
    from tests.services.dataplane.gateway_harness import TOKEN

    async def scenario() -> None:
        router, workers = await started("w1", "w2")
        for w in workers:
            w.fail_with = first_fails_at(6)
        app = HttpApi(router, router.metrics, "base", env={}).app()
        want = "".join(f"<{t}>" for t in expected_output(PROMPT, 12))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gw") as client:
                for stream in (False, True):
                    for w in workers:
                        w.calls.clear()
                    r = await client.post("/v1/completions", headers={
                        "authorization": f"Bearer {TOKEN}"}, json={
                        "model": "base", "prompt": PROMPT, "max_tokens": 12,
                        "temperature": 0, "stream": stream})
                    assert r.status_code == 200, r.text
                    if stream:
                        events = [json.loads(line[6:]) for line in r.text.splitlines()
                                  if line.startswith("data: {")]
                        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
                    else:
                        text = r.json()["choices"][0]["text"]
                    assert text == want, stream
                    assert sum(1 for w in workers for c in w.calls if c.resume_token_ids) == 1
            assert router.metrics.resumed._value.get() == 2
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())
