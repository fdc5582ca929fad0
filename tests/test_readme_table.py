"""README's service-path table is the one `bench.readme_table` generates from the result JSONs:
a figure typed by hand, or a JSON replaced without regenerating the table, fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_service_table_matches_the_result_jsons():
    res = subprocess.run([sys.executable, "-m", "bench.readme_table", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, "README differs: run `python -m bench.readme_table`" + res.stderr
