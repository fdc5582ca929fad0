"""The `slora` console script: one subcommand per module under `services.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes `register(subparsers)`, which adds its subcommand(s) and sets
# `func(args) -> int` as the parser default. Imported lazily so `slora --help` stays fast.
COMMAND_MODULES: tuple[str, ...] = (
    "services.commands.demo_assets",
    "services.commands.batch",
    "services.commands.control_plane",
    "services.commands.admin",
    "services.commands.worker",
    "services.commands.gateway",
    "services.commands.up",
    "services.commands.generate",
    "services.commands.serve",
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with `command` (e.g. "control-plane"), only that subcommand's module is
    imported, so a command does not pay for the others' imports (torch, for `batch`)."""
    parser = argparse.ArgumentParser(prog="slora", description="Multi-LoRA serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        if command is None or name.rsplit(".", 1)[1].replace("_", "-") == command:
            importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known = {m.rsplit(".", 1)[1].replace("_", "-") for m in COMMAND_MODULES}
    parser = build_parser(argv[0] if argv and argv[0] in known else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_unknown_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown_flags = unknown  # `slora serve` takes vLLM's flags it has no use for
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
