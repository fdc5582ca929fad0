"""The need markers tests/conftest.py sets (gpu, docker, postgres) select what they say: a
collection with `-m` finds the CUDA, docker and PostgreSQL cases and none of the others."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/slora_core/test_precompile.py", "tests/services/dataplane/test_compose.py",
         "tests/services/control_plane/test_registry_concurrency.py"]


def collected(marker: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-n", "0", "-p",
                          "no:cacheprovider", "-m", marker, *FILES], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 5), out.stdout[-2000:] + out.stderr[-2000:]
    return {line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line}


def test_need_markers_select_their_cases() -> None:
    gpu, docker, pg = collected("gpu"), collected("docker"), collected("postgres")
    assert gpu == {"test_warmup_precompiles_every_kernel_the_capture_launches"}
    assert docker == {"test_docker_compose_config_accepts_the_file_only_with_secrets",
                      "test_compose_up_end_to_end_in_containers"}
    assert len(pg) >= 3 and all(name.endswith("[postgresql]") for name in pg)
