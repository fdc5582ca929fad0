"""Kernel tests run the Triton kernels on the CPU interpreter unless TRITON_INTERPRET=0 is set
(on a GPU machine). The variable is read when a kernel is decorated, so it is set here, before
any test module imports `kernels`."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
