"""Child processes that must not outlive their parent: the worker's engine core, tensor-parallel
ranks, gateway processes. An orphan would hold its GPU, or its port, until someone kills it."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies, and exit at once if the
    parent is already gone (it died before prctl took effect). Without prctl only the callers'
    own parent-pid checks remain."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        except OSError:
            log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent-pid check")
    if os.getppid() != parent_pid:
        os._exit(1)
