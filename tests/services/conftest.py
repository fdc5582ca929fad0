"""The HTTP stack that test_http_api, test_structured_http and test_stack_hops share (one
control plane, worker and gateway instead of three of each: about 25 s of start-up each on the
2-core CI machine). tests/conftest.py's XDIST_GROUPS names them, so one xdist worker runs all
three and starts the stack once; their tests leave it serving as they found it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported by the fixture: the xdist controller runs no test (nor torch)
    from tests.services.dataplane.http_support import HttpStack


@pytest.fixture(scope="session")
def shared_http_stack(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[HttpStack]:
    from tests.services.dataplane.http_support import SHARED_STACK_WORKER_ARGS, http_stack

    with http_stack(demo_dir, tmp_path_factory.mktemp("http"),
                    worker_args=SHARED_STACK_WORKER_ARGS) as running:
        yield running
