"""`slora gateway`'s upstream flags: how worker calls travel (per call, over the mux, or auto:
per call until --mux-from streams are in flight on a worker), and bad values refused."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from services.commands.gateway import MUX_FROM_DEFAULT, gateway_options


def options(*flags: str):  # type: ignore[no-untyped-def]
    args = build_parser("gateway").parse_args(["gateway", "--control-plane", "cp:1", *flags])
    return gateway_options(args)


@pytest.mark.parametrize("flags, mux, mux_from", [
    ((), False, 0),
    (("--upstream", "mux"), True, 0),
    (("--upstream", "auto"), True, MUX_FROM_DEFAULT),
    (("--upstream", "auto", "--mux-from", "8"), True, 8),
    (("--upstream", "call", "--mux-from", "8"), False, 0),  # only auto reads it
])
def test_upstream_flags(flags: tuple[str, ...], mux: bool, mux_from: int,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLORA_GATEWAY_UPSTREAM", raising=False)
    monkeypatch.delenv("SLORA_GATEWAY_MUX_FROM", raising=False)
    opts = options(*flags)
    assert (opts.upstream_mux, opts.upstream_mux_from) == (mux, mux_from)


@pytest.mark.parametrize("flags", [("--upstream", "sometimes"), ("--mux-from", "0")])
def test_bad_upstream_flags_are_a_usage_error(flags: tuple[str, ...],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        options(*flags)
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err
