"""`slora gateway`'s upstream flags: how worker calls travel (per call, over the mux, or auto:
per call until --mux-from streams are in flight on a worker), and bad values refused."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from services.commands.gateway import MUX_FROM_DEFAULT, gateway_options
from services.gateway.main import GatewayOptions


def options(*flags: str) -> GatewayOptions:
    args = build_parser("gateway").parse_args(["gateway", "--control-plane", "cp:1", *flags])
    return gateway_options(args)


@pytest.mark.parametrize("flags, mux_from", [
    ((), MUX_FROM_DEFAULT),  # auto
    (("--mux-from", "8"), 8),
    (("--upstream", "call"), None),
    (("--upstream", "mux"), 0),
    (("--upstream", "auto"), MUX_FROM_DEFAULT),
    (("--upstream", "auto", "--mux-from", "8"), 8),
    (("--upstream", "call", "--mux-from", "8"), None),  # only auto reads it
    (("--upstream", "mux", "--mux-from", "8"), 0),
])
def test_upstream_flags(flags: tuple[str, ...], mux_from: int | None,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLORA_GATEWAY_UPSTREAM", raising=False)
    monkeypatch.delenv("SLORA_GATEWAY_MUX_FROM", raising=False)
    assert options(*flags).upstream_mux_from == mux_from


@pytest.mark.parametrize("flags", [("--upstream", "sometimes"), ("--mux-from", "0")])
def test_bad_upstream_flags_are_a_usage_error(flags: tuple[str, ...],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        options(*flags)
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err
