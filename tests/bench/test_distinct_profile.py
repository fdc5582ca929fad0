"""bench.distinct_profile's accounting of profiled kernels (families, busy time, one layer), and
its scenario on the CPU."""

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


def test_the_scenario_profiles_each_arms_prefill_and_the_one_adapter_arm_on_the_kernels(
        tmp_path):
    """The distinct_profile scenario on the CPU (tiny shape): every arm's prefill is timed
    and profiled; with the ride on, the one-adapter arm's prefill rides and the same requests
    run on the LoRA kernels as one_kernels (the ride off for it, then back on)."""
    import json

    from bench import serving

    out = tmp_path / "dp.json"
    assert serving.main([
        "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--scenarios",
        "distinct_profile", "--distinct-arms", "one_unmerged", "--ride-sole-adapter",
        "--profile-steps", "1", "--distinct-batch", "2", "--distinct-input", "64",
        "--distinct-output", "4", "--arena-gb", "0.2", "--out", str(out)]) == 0
    d = json.loads(out.read_text())["distinct_profile"]
    arms = ("base", "one_unmerged", "one_kernels")
    assert all(d[a]["prefill"]["steps"] >= 1 and d[a]["prefill"]["step_ms"] > 0
               and d[a]["prefill"]["kernels_per_step"] > 0 for a in arms)
    assert [d[a]["prefill"]["ride_steps"] for a in arms] == [
        0, d["one_unmerged"]["prefill"]["steps"], 0]
    assert set(d["prefill_step_ratio_to_base"]) == {"one_unmerged", "one_kernels"}
    assert d["one_kernels"]["distinct_adapters"] == 1  # the one adapter's requests, not base's
