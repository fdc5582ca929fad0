"""bench/results/INDEX.md is current and every result file is cited by a document or the code
(`python -m bench.results_index` regenerates it)."""

from __future__ import annotations

from bench.results_index import expand, main


def test_index_is_current_and_every_result_is_cited() -> None:
    assert main(["--check"]) == 0, "run `python -m bench.results_index` (or cite/delete files)"


def test_brace_lists_cite_each_file() -> None:
    assert expand("lora-{one-adapter,grid}-x-{a,b}.json") == [
        "lora-one-adapter-x-a.json", "lora-one-adapter-x-b.json", "lora-grid-x-a.json",
        "lora-grid-x-b.json"]
    assert expand("plain.json") == ["plain.json"]
