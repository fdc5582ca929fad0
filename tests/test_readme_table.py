"""README's service-path table is the one `bench.readme_table` generates from the result JSONs:
a figure typed by hand, or a JSON replaced without regenerating the table, fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_service_table_matches_the_result_jsons():
    res = subprocess.run([sys.executable, "-m", "bench.readme_table", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, "README differs: run `python -m bench.readme_table`" + res.stderr


def test_a_grid_cut_short_says_so_and_names_the_earlier_run_of_each_missing_cell():
    from bench.readme_table import EARLIER_GRIDS, RESULTS, grid_rows

    earlier = json.loads((RESULTS / EARLIER_GRIDS[0]).read_text())
    cells = [r for r in earlier["rows"] if "vllm_us_issue" in r]
    cut = {"complete": False, "cases": earlier["cases"], "rows": cells[:2]}
    rows = grid_rows(cut, "`cut.json` @ 0000000")
    assert "cut at its time limit after 2 of" in rows[0]
    assert len(rows) == 1 + len(cells)
    assert all("`cut.json` @ 0000000 |" in row for row in rows[1:3])
    assert all(f"`{EARLIER_GRIDS[0]}` @ {earlier['commit'][:8]} (not reached at" in row
               for row in rows[3:])
    whole = grid_rows({"complete": True, "rows": cells}, "`whole.json` @ 1111111")
    assert len(whole) == len(cells) and "cut at" not in whole[0]
