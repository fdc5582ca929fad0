"""The names clients and processes give things, checked in one place at every entry point.

Names end up in SQL rows, log lines, metric labels and file paths (a worker's disk cache keeps
`<root>/<adapter_id>/<version>-<sha256[:16]>/`), so each kind has a closed charset and a length
cap:

| kind                         | pattern                                              | max |
|------------------------------|------------------------------------------------------|-----|
| adapter id                   | segments `[A-Za-z0-9][A-Za-z0-9._-]*` joined by `/`  | 128 |
| version                      | `[A-Za-z0-9][A-Za-z0-9._+-]*`                        |  64 |
| tenant, key and gateway name | `[A-Za-z0-9][A-Za-z0-9._-]*`                         |  64 |
| worker id                    | `[A-Za-z0-9][A-Za-z0-9._-]*`                         | 128 |

Every segment starts with a letter or digit, so no name (or segment) is `.` or `..`, starts
with `/` or `-`, or holds a backslash, NUL or whitespace: a path built from names cannot climb
out of its root. `inside` checks that anyway, for paths built from names read back from disk
or a database. Error messages quote names through `shown`, which truncates: a 1 MB adapter id
is never echoed whole.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from services.common.errors import InvalidArgument

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"
ADAPTER_ID_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
NAME_RE = re.compile(_SEGMENT)
MAX_ADAPTER_ID = 128
MAX_VERSION = 64
MAX_NAME = 64
MAX_WORKER_ID = 128
SHOWN_CHARS = 64


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)`, cut to about `limit` characters with the full length noted when longer."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} chars)"


def _check(kind: str, value: str, pattern: re.Pattern[str], limit: int, rule: str) -> str:
    # Length first: a regex over a megabyte of input is wasted work.
    if not value or len(value) > limit or not pattern.fullmatch(value):
        raise InvalidArgument(f"{kind} {shown(value)} is not valid: {rule}, 1 to {limit} chars")
    return value


def check_adapter_id(value: str, kind: str = "adapter_id") -> str:
    """`value` if it is a valid adapter id; InvalidArgument otherwise."""
    return _check(kind, value, ADAPTER_ID_RE, MAX_ADAPTER_ID,
                  "'/'-separated segments of letters, digits, '.', '_', '-', each starting "
                  "with a letter or digit")


def check_version(value: str, kind: str = "version") -> str:
    """`value` if it is a valid version name (`v3.2.1`, `2024-01-01`, `1.0+build5`)."""
    return _check(kind, value, VERSION_RE, MAX_VERSION,
                  "letters, digits, '.', '_', '+', '-', starting with a letter or digit")


def check_name(kind: str, value: str) -> str:
    """`value` if it is a valid tenant, key or gateway name."""
    return _check(kind, value, NAME_RE, MAX_NAME,
                  "letters, digits, '.', '_', '-', starting with a letter or digit")


def check_worker_id(value: str, kind: str = "worker_id") -> str:
    """`value` if it is a valid worker id (`hostname-port` by default)."""
    return _check(kind, value, NAME_RE, MAX_WORKER_ID,
                  "letters, digits, '.', '_', '-', starting with a letter or digit")


def inside(root: str | Path, *parts: str) -> Path:
    """`root/parts...`, refused (InvalidArgument) unless it resolves inside `root`.

    Symlinks and '..' are resolved before comparing, so neither a crafted name nor a link
    planted under `root` leads out of it."""
    base = Path(os.path.realpath(root))
    path = Path(os.path.realpath(base.joinpath(*parts)))
    if path == base or not path.is_relative_to(base):
        raise InvalidArgument(f"path {shown('/'.join(parts))} leaves its root")
    return path
