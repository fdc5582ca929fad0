from slora_core.page_pool import PagePool
from slora_core.sampling_params import SamplingParams
from slora_core.scheduler import PLACEHOLDER, Scheduler, SchedulerLimits
from slora_core.sequence import SeqStatus, Sequence


def make(num_pages=32, max_seqs=8, budget=64, max_adapters=2, bs=4, max_model_len=None):
    pool = PagePool(num_pages, num_slots=num_pages)
    limits = SchedulerLimits(bs, max_seqs, budget, max_adapters, max_model_len=max_model_len)
    return Scheduler(limits, pool, eos_token_ids=(2,)), pool


def seq(rid, n=6, adapter=None, pages=2, max_new=4):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=max_new),
                    adapter=adapter, adapter_pages=pages if adapter else 0)


def sampled(out, token=7):
    """Every sequence the step samples drew `token` (what the engine hands to postprocess)."""
    return [(s.seq, token) for s in out.scheduled if s.samples]


def test_prefill_and_decode_share_a_step():
    sched, _ = make()
    a = seq("a")
    sched.add(a)
    out = sched.schedule()
    sched.postprocess(out.scheduled, sampled(out))
    b = seq("b")
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 6)]


def test_chunked_prefill_respects_the_token_budget():
    sched, _ = make(budget=4)
    a = seq("a", n=10)
    sched.add(a)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks.append([(s.num_new_tokens, s.samples) for s in out.scheduled])
        sched.postprocess(out.scheduled, sampled(out))
    assert chunks == [[(4, False)], [(4, False)], [(2, True)]]
    assert a.output_token_ids == [7]


def test_batch_is_grouped_by_adapter_and_capped_at_max_adapters():
    sched, pool = make(max_adapters=2)
    for rid, ad in [("1", "x"), ("2", "y"), ("3", "x"), ("4", "z"), ("5", None), ("6", "y")]:
        sched.add(seq(rid, adapter=ad))
    out = sched.schedule()
    got = [(s.seq.request_id, s.seq.adapter) for s in out.scheduled]
    assert {a for _, a in got if a} == {"x", "y"}  # z waits: two adapters per batch
    assert "4" not in [r for r, _ in got]
    adapters = [a for _, a in got]
    # each adapter's requests are adjacent, base-model requests last
    assert adapters[-1] is None
    firsts = [adapters.index(a) for a in ("x", "y")]
    for a, f in zip(("x", "y"), firsts, strict=True):
        assert adapters[f : f + adapters.count(a)] == [a] * adapters.count(a)
    assert out.distinct_adapters() == 2
    # x and y are loaded for this step; z, waiting, is prefetched into free pages (idle)
    assert [r.key for r in out.new_adapters] == ["x", "y", "z"]
    assert pool.resident("z").refcount == 0
    assert pool.resident("x").refcount == 2


def test_admission_counts_kv_and_adapter_pages():
    sched, pool = make(num_pages=6, bs=4)
    sched.add(seq("a", n=8, adapter="x", pages=3))  # 2 KV blocks + 3 adapter pages
    sched.add(seq("b", n=8, adapter="y", pages=3))  # would need 5 more pages: only 1 left
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    assert pool.num_free == 1 and len(sched.waiting) == 1


def test_preemption_instead_of_failure_and_resume():
    sched, pool = make(num_pages=4, bs=2, budget=64)
    a, b = seq("a", n=4, max_new=8), seq("b", n=4, max_new=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.postprocess(out.scheduled, sampled(out))  # each holds 2 blocks: arena full
    assert pool.num_free == 0
    out = sched.schedule()  # a's next token needs a third block -> preempt youngest (b)
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    assert out.preempted == [b] and b.status is SeqStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]  # generated tokens are kept and recomputed
    sched.postprocess(out.scheduled, sampled(out))
    sched.finish(a)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 5)]


def test_finish_frees_pages_and_adapter_reference():
    sched, pool = make()
    a = seq("a", adapter="x")
    sched.add(a)
    out = sched.schedule()
    sched.postprocess(out.scheduled, sampled(out))
    sched.finish(a)
    assert pool.num_kv_pages == 0 and pool.resident("x").refcount == 0
    assert a.status is SeqStatus.FINISHED and not sched.has_work()


def _decode_until_done(sched, s, tokens):
    """Prefill `s`, then feed it `tokens` one step each; the finish reason of each step."""
    sched.add(s)
    reasons = []
    for tok in tokens:
        out = sched.schedule()
        reasons += sched.postprocess(out.scheduled, sampled(out, tok))
        if reasons[-1] is not None:
            break
    return reasons


def test_postprocess_finishes_on_stop_ids_eos_and_lengths_and_frees_pages():
    def params(**kw):
        return SamplingParams(**{"max_new_tokens": 5, **kw})

    cases = [
        (params(stop_token_ids=(9,)), [7, 9, 7], [None, "stop"]),
        (params(), [7, 2], [None, "stop"]),  # EOS (2)
        (params(ignore_eos=True), [2, 2, 2, 2, 2], [None] * 4 + ["length"]),
        (params(min_new_tokens=3), [2, 2, 2], [None, None, "stop"]),
        (params(max_new_tokens=2), [7, 7], [None, "length"]),
    ]
    for p, tokens, want in cases:
        sched, pool = make()
        s = Sequence("a", [1, 2, 3], p)
        assert _decode_until_done(sched, s, tokens) == want, (p, tokens)
        assert s.output_token_ids == tokens[: len(want)]
        assert s.status is SeqStatus.FINISHED and pool.num_kv_pages == 0
        assert s.num_computed_tokens == s.num_tokens - 1  # the last token was never input
    sched, _ = make(max_model_len=5)
    s = Sequence("a", [1, 2, 3], SamplingParams(max_new_tokens=10))
    assert _decode_until_done(sched, s, [7, 7, 7]) == [None, "length"]  # 3 + 2 = max_model_len


def test_placeholders_wait_for_their_ids_and_missing_tokens_are_not_appended():
    sched, pool = make()
    s = seq("a", max_new=2)
    sched.add(s)
    out = sched.schedule()
    assert sched.postprocess(out.scheduled, sampled(out, PLACEHOLDER)) == [None]
    assert s.output_token_ids == [PLACEHOLDER] and s.num_uncomputed == 1
    # The engine's order: the next step is scheduled (the placeholder is its input) and
    # launched, the previous step's ids arrive, then this step's placeholders are appended.
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(s, 1)]
    assert sched.resolve(s, 7) is None and s.output_token_ids == [7]
    # This placeholder reaches max_new_tokens: no decision until its id arrives.
    assert sched.postprocess(out.scheduled, sampled(out, PLACEHOLDER)) == [None]
    assert s.status is SeqStatus.RUNNING and s.output_token_ids == [7, PLACEHOLDER]
    assert sched.resolve(s, 8) == "length" and s.output_token_ids == [7, 8]
    assert s.status is SeqStatus.FINISHED and pool.num_kv_pages == 0
    b = seq("b")
    sched.add(b)
    out = sched.schedule()
    assert sched.postprocess(out.scheduled, [(b, None)]) == [None]
    assert b.output_token_ids == [] and b.num_computed_tokens == 6


def test_unready_adapter_does_not_block_others():
    sched, _ = make()
    a = seq("a", adapter="x")
    a.adapter_ready = False
    sched.add(a)
    sched.add(seq("b"))
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["b"]
    a.adapter_ready = True
    assert "a" in [s.seq.request_id for s in sched.schedule().scheduled]


def test_adapters_of_waiting_requests_are_prefetched_into_free_pages():
    sched, pool = make(num_pages=16, max_seqs=1)
    sched.add(seq("a", adapter="x", pages=2))
    sched.add(seq("b", adapter="y", pages=2))  # waits: max one running sequence
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    assert [r.key for r in out.new_adapters] == ["x", "y"]
    assert pool.resident("y").refcount == 0  # idle: evictable if KV needs the room


def test_tenants_are_interleaved_so_a_flood_does_not_starve_others():
    sched, _ = make(max_seqs=4)
    for i in range(6):
        s = seq(f"big{i}")
        s.tenant = "big"
        sched.add(s)
    small = seq("small0")
    small.tenant = "small"
    sched.add(small)
    out = sched.schedule()
    admitted = [s.seq.request_id for s in out.scheduled]
    assert "small0" in admitted and len(admitted) == 4  # FCFS alone would admit big0..big3
    assert [r for r in admitted if r.startswith("big")] == ["big0", "big1", "big2"]


def test_waiting_requests_past_their_deadline_are_dropped_unrun():
    sched, pool = make(max_seqs=1)
    a, b = seq("a"), seq("b")
    b.deadline = 10.0
    sched.add(a)
    sched.add(b)
    out = sched.schedule(now=5.0)
    assert [s.seq.request_id for s in out.scheduled] == ["a"] and out.expired == []
    out = sched.schedule(now=11.0)
    assert out.expired == [b] and b.status is SeqStatus.FINISHED and not sched.waiting


def test_a_deadline_never_expires_a_request_that_was_scheduled():
    """A preempted request that already produced tokens waits for its turn past its deadline
    and resumes; only requests never scheduled expire."""
    sched, pool = make(num_pages=4, bs=2, budget=64)
    a, b = seq("a", n=4, max_new=8), seq("b", n=4, max_new=8)
    b.deadline = 10.0
    sched.add(a)
    sched.add(b)
    out = sched.schedule(now=0.0)
    sched.postprocess(out.scheduled, sampled(out))  # both ran a step: b has a token
    assert b.first_scheduled == 0.0
    out = sched.schedule(now=1.0)  # a's next token needs a block: b is preempted
    assert out.preempted == [b] and b.output_token_ids == [7]
    sched.postprocess(out.scheduled, sampled(out))
    out = sched.schedule(now=20.0)  # past b's deadline, still no room for it
    assert out.expired == [] and b.status is SeqStatus.WAITING
    sched.postprocess(out.scheduled, sampled(out))
    sched.finish(a)
    out = sched.schedule(now=30.0)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 5)] and not out.expired
    late = seq("late")
    late.deadline = 25.0
    sched.add(late)
    assert sched.schedule(now=31.0).expired == [late]


def test_token_slice_equals_slicing_the_whole_token_list():
    s = seq("a", n=5)
    s.output_token_ids = [50, 51, 52]
    whole = s.token_ids()
    for start in range(9):
        for end in range(start, 9):
            assert s.token_slice(start, end) == whole[start:end], (start, end)
