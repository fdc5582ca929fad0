"""bench.distinct_profile's accounting of profiled kernels: families, busy time, one layer."""

from __future__ import annotations

from bench.distinct_profile import busy_us, family, one_layer


def test_kernel_families() -> None:
    assert family("_rows_shrink_kernel") == "lora_rows_shrink"
    assert family("_lora_expand_kernel") == "lora_expand"
    assert family("_decode_split_kernel") == "attention"
    assert family("_rms_norm_kernel") == "rmsnorm"
    assert family("nvjet_sm90_hsh_64x32_64x16_1x2_h_bz_TNT") == "gemm"
    assert family("something_else") == "other"


def test_busy_time_counts_overlapping_kernels_once() -> None:
    # [0, 10) and [5, 12) overlap (PDL: an expand starts inside its shrink), [20, 23) apart.
    events = [(0.0, 10.0, "a"), (5.0, 7.0, "b"), (20.0, 3.0, "c")]
    assert busy_us(events) == 15.0
    assert busy_us([(0.0, 10.0, "a"), (2.0, 3.0, "inside")]) == 10.0
    assert busy_us([]) == 0.0


def test_one_layer_is_the_run_between_two_attention_kernels() -> None:
    layer = ["_decode_split_kernel", "nvjet_gemm", "_lora_shrink_kernel", "_rms_norm_kernel"]
    events = [(float(i), 1.0, name) for i, name in enumerate(layer * 4)]
    got = one_layer(events, layers=4)
    assert [k["name"] for k in got] == layer
    assert [k["family"] for k in got] == ["attention", "gemm", "lora_shrink", "rmsnorm"]
    assert one_layer(events[:3], layers=4) == []  # too few layers seen: nothing
