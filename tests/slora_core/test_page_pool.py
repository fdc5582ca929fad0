import pytest

from slora_core.page_pool import OutOfPages, PagePool, pack_matrices


def test_kv_and_adapters_share_one_free_list():
    pool = PagePool(num_pages=10, num_slots=4)
    kv, evicted = pool.allocate(4)
    assert kv == [0, 1, 2, 3] and evicted == []
    rec, new, _ = pool.acquire_adapter("a", 3)
    assert new and rec.pages == [4, 5, 6] and rec.refcount == 1
    assert pool.num_free == 3 and pool.num_kv_pages == 4 and pool.num_adapter_pages == 3


def test_in_use_adapter_is_never_evicted():
    pool = PagePool(num_pages=6, num_slots=4)
    pool.acquire_adapter("a", 3)
    assert not pool.can_allocate(4)
    with pytest.raises(OutOfPages):
        pool.allocate(4)
    assert pool.is_resident("a") and pool.num_free == 3


def test_idle_adapters_are_evicted_lru_when_kv_needs_room():
    pool = PagePool(num_pages=6, num_slots=4)
    for key in ("a", "b", "c"):
        pool.acquire_adapter(key, 2)
    pool.release_adapter("a")
    pool.release_adapter("b")
    pool.acquire_adapter("a", 2)  # a is used again: b is now least recently used
    pool.release_adapter("a")
    pages, evicted = pool.allocate(2)
    assert [r.key for r in evicted] == ["b"] and len(pages) == 2
    pages, evicted = pool.allocate(2)
    assert [r.key for r in evicted] == ["a"]
    assert pool.resident_keys() == ["c"] and pool.evictions == 2


def test_slots_are_reused_and_limited():
    pool = PagePool(num_pages=10, num_slots=2)
    a, _, _ = pool.acquire_adapter("a", 1)
    pool.acquire_adapter("b", 1)
    assert not pool.can_admit_adapter("c", 1)  # both slots busy
    pool.release_adapter("a")
    c, new, evicted = pool.acquire_adapter("c", 1)
    assert new and [r.key for r in evicted] == ["a"] and c.slot == a.slot


def test_release_without_acquire_is_an_error():
    pool = PagePool(num_pages=4, num_slots=2)
    pool.acquire_adapter("a", 1)
    pool.release_adapter("a")
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release_adapter("a")


def test_pack_matrices_first_fit_decreasing_keeps_each_matrix_in_one_page():
    sizes = [60, 30, 50, 40, 20, 10]
    n, placements = pack_matrices(sizes, page_numel=100)
    assert n == 3  # 210 elements, no matrix split
    used: dict[int, list[tuple[int, int]]] = {}
    for size, (page, off) in zip(sizes, placements, strict=True):
        assert off >= 0 and off + size <= 100
        used.setdefault(page, []).append((off, off + size))
    for spans in used.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match="does not fit"):
        pack_matrices([101], 100)


def test_counters_agree_with_the_records_through_a_random_history():
    import random

    rng = random.Random(0)
    pool = PagePool(num_pages=40, num_slots=6)
    held: dict[str, int] = {}
    kv: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        key = f"a{rng.randrange(8)}"
        if op < 0.35 and pool.can_admit_adapter(key, 3):
            pool.acquire_adapter(key, 3)
            held[key] = held.get(key, 0) + 1
        elif op < 0.6 and held.get(key):
            pool.release_adapter(key)
            held[key] -= 1
        elif op < 0.8 and pool.can_allocate(2):
            kv.append(pool.allocate(2)[0])
        elif kv:
            pool.free(kv.pop(rng.randrange(len(kv))))
        records = [pool.resident(k) for k in pool.resident_keys()]
        assert pool.num_adapter_pages == sum(len(r.pages) for r in records)
        assert pool.idle_adapter_pages() == sum(len(r.pages) for r in records if r.refcount == 0)
        assert pool.num_kv_pages == sum(len(p) for p in kv)
        assert all(r.refcount == held.get(r.key, 0) for r in records)
