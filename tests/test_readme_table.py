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


def test_a_service_row_names_its_runs_own_mux_threshold_and_worker_lead():
    """The auto gateway's threshold moved (32 -> 8): each row says the one its JSON ran with
    (32 where the JSON predates the field), and a level run at a worker lead says which."""
    from bench.readme_table import service_rows

    fig = {"median": 1.0, "min": 1.0, "max": 1.0}
    level = {"concurrency": 64, "worker_admission_lead_ms": 0.5,
             "ratios": {"gateway": {"throughput_ratio": fig, "ttft_p50_added_ms": fig,
                                    "ttft_p99_added_ms": fig}}}
    old = {"gateway_procs": 4, "upstreams": {"gateway": "auto"}, "new_tokens": 64,
           "levels": [level], "hardware": "NVIDIA H100 80GB HBM3"}
    new = old | {"gateway_mux_from": 8}
    (old_row,), (new_row,) = service_rows(old, "`old.json`"), service_rows(new, "`new.json`")
    assert "over GenerateMux from 32 streams in flight" in old_row
    assert "over GenerateMux from 8 streams in flight" in new_row
    assert "the worker's late-admission lead 0.5 ms, on an H100" in new_row
    assert "lead" not in service_rows(old | {"levels": [level | {
        "worker_admission_lead_ms": None}]}, "`x.json`")[0]
