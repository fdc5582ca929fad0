"""Command-line flags and environment variables for EngineConfig, generated from its fields so
that `slora worker`, `slora batch` and the benchmarks offer the same names and defaults.

    add_engine_args(parser)                  # --num-pages, --max-num-seqs, --async-steps, ...
    config = engine_config_from_args(parser.parse_args())

Each field `name` is the flag `--name-with-dashes` and the environment variable
`SLORA_NAME_IN_CAPITALS` (a flag beats the variable, the variable beats the default). Booleans
take `--flag` / `--no-flag` (an optional boolean's variable also takes `none`: its automatic
choice); optional integers take `none` (or an empty variable) for None.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import fields
from typing import Any, get_type_hints

from slora_core.config import EngineConfig

# One description a field, kept with the field itself (slora_core.config.knob).
HELP: dict[str, str] = {f.name: f.metadata["help"] for f in fields(EngineConfig)}
ENV_PREFIX = "SLORA_"


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _converter(kind: Any) -> Callable[[str], Any]:
    """str -> value for a field annotated `kind` (bool, bool | None, int, int | None, float or
    str)."""
    if kind is bool:
        def to_bool(text: str) -> bool:
            value = text.strip().lower()
            if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(f"expected true or false, got {text!r}")
            return value in ("1", "true", "yes", "on")
        return to_bool
    if kind == bool | None:
        as_bool = _converter(bool)
        return lambda text: None if text.strip().lower() in ("", "none") else as_bool(text)
    if kind is int:
        return int
    if kind is float:
        return float
    if kind == int | None:
        return lambda text: None if text.strip().lower() in ("", "none") else int(text)
    return str


def _default(name: str, kind: Any, default: Any, env: Mapping[str, str]) -> Any:
    raw = env.get(env_name(name))
    if raw is None:
        return default
    try:
        return _converter(kind)(raw)
    except ValueError as e:
        raise SystemExit(f"{env_name(name)}={raw!r}: {e}") from None


def add_engine_args(parser: argparse.ArgumentParser, *,
                    defaults: Mapping[str, Any] | None = None, skip: Collection[str] = (),
                    env: Mapping[str, str] | None = None) -> None:
    """Add one flag per EngineConfig field (except `skip`) to `parser`, in a group of its own.
    `defaults` replaces EngineConfig's defaults (a benchmark's own sizes); a set `SLORA_<FIELD>`
    variable in `env` (default: os.environ) replaces both."""
    defaults = defaults or {}
    unknown = (set(defaults) | set(skip)) - set(HELP)
    if unknown:
        raise ValueError(f"not EngineConfig fields: {sorted(unknown)}")
    env = os.environ if env is None else env
    kinds = get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine", "EngineConfig (each flag also reads the "
                                      f"{ENV_PREFIX}<FIELD> environment variable)")
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        kind = kinds[f.name]
        default = _default(f.name, kind, defaults.get(f.name, f.default), env)
        help_text = f"{HELP[f.name]} [{env_name(f.name)}; default: %(default)s]"
        if kind is bool or kind == bool | None:
            group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction,
                               default=default, help=help_text)
        else:
            group.add_argument(flag_name(f.name), type=_converter(kind), default=default,
                               metavar=f.name.upper(), help=help_text)


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields `args` carries (those add_engine_args added)."""
    names = {f.name for f in fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names}


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """EngineConfig from parsed flags; `overrides` set fields the command decides itself.
    Raises ConfigError (a ValueError) for values the config refuses."""
    return EngineConfig(**(engine_config_kwargs(args) | overrides))


def engine_cli_args(values: Mapping[str, Any]) -> list[str]:
    """The flags that give `values` (EngineConfig fields) to another command's add_engine_args,
    e.g. a worker process a benchmark starts."""
    kinds = get_type_hints(EngineConfig)
    out: list[str] = []
    for name, value in values.items():
        if name not in kinds:
            raise ValueError(f"not an EngineConfig field: {name!r}")
        kind = kinds[name]
        if kind == bool | None and value is None:
            continue  # the command's own default: the same automatic choice
        if kind is bool or kind == bool | None:
            out.append(flag_name(name) if value else "--no-" + name.replace("_", "-"))
        else:
            out += [flag_name(name), "none" if value is None else str(value)]
    return out

