"""`slora gateway`'s upstream flags: how worker calls travel (per call, over the mux, auto:
per call until --mux-from streams are in flight on a worker, or warm: per call on idle calls
opened ahead), and bad values refused."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from services.commands.gateway import MUX_FROM_DEFAULT, WARM_CALLS_DEFAULT, gateway_options
from services.gateway.main import GatewayOptions


def options(*flags: str) -> GatewayOptions:
    args = build_parser("gateway").parse_args(["gateway", "--control-plane", "cp:1", *flags])
    return gateway_options(args)


@pytest.mark.parametrize("flags, mux_from, warm", [
    ((), MUX_FROM_DEFAULT, 0),  # auto
    (("--mux-from", "8"), 8, 0),
    (("--upstream", "call"), None, 0),
    (("--upstream", "mux"), 0, 0),
    (("--upstream", "auto"), MUX_FROM_DEFAULT, 0),
    (("--upstream", "auto", "--mux-from", "8"), 8, 0),
    (("--upstream", "call", "--mux-from", "8"), None, 0),  # only auto reads it
    (("--upstream", "mux", "--mux-from", "8"), 0, 0),
    (("--upstream", "warm"), None, WARM_CALLS_DEFAULT),
    (("--upstream", "warm", "--warm-calls", "2"), None, 2),
    (("--upstream", "auto", "--warm-calls", "2"), MUX_FROM_DEFAULT, 0),  # only warm reads it
])
def test_upstream_flags(flags: tuple[str, ...], mux_from: int | None, warm: int,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLORA_GATEWAY_UPSTREAM", raising=False)
    monkeypatch.delenv("SLORA_GATEWAY_MUX_FROM", raising=False)
    opts = options(*flags)
    assert (opts.upstream_mux_from, opts.upstream_warm) == (mux_from, warm)


@pytest.mark.parametrize("flags", [("--upstream", "sometimes"), ("--mux-from", "0"),
                                   ("--warm-calls", "0")])
def test_bad_upstream_flags_are_a_usage_error(flags: tuple[str, ...],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        options(*flags)
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err
