"""bench.kernel_compile_cost's variants give every constexpr its kernel declares (one left out
would compile as an int32 argument: the bench broke that way when kernels gained PDL and
balance switches), and compile_cost refuses a variant that does not."""

from __future__ import annotations

import pytest

from bench import kernel_compile_cost as cost


@pytest.mark.parametrize("make", [cost.variants, cost.float32_variants])
def test_every_variant_names_each_constexpr_of_its_kernel(make: object) -> None:
    assert callable(make)
    for name, fn, consts, _ in make():
        declared = set(cost.constexpr_names(fn))
        assert "MAX_RANK" in declared
        assert declared == set(consts), (name, declared ^ set(consts))


def test_a_missing_constexpr_is_refused_by_name() -> None:
    name, fn, consts, warps = cost.variants()[0]
    partial = {k: v for k, v in consts.items() if k != "TILE"}
    with pytest.raises(ValueError, match="no value for constexpr TILE"):
        cost.compile_cost(fn, partial, warps)
