"""bench.structured_output: its synthetic tokenizer, and the tiny CPU smoke mode end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.structured_output import main, synthetic_tokenizer


def test_synthetic_tokenizer_has_the_vocabulary_size_and_round_trips() -> None:
    tok = synthetic_tokenizer(700)
    assert tok.vocab_size == 700 and tok.eos_token_ids == (1,)
    text = '{"name": "Ada", "id": 7, "tags": ["x", "y"]}'
    ids = tok.encode(text)
    assert ids[0] == 0 and tok.decode(ids) == text
    assert len(ids) < len(text.encode()), "merges never applied"


@pytest.mark.slow
def test_tiny_cpu_smoke_run_writes_its_record(tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--streams", "4",
                 "--requests", "8", "--prompt-tokens", "8", "--max-tokens", "200",
                 "--max-model-len", "256", "--adapters", "2", "--ranks", "4", "8",
                 "--arena-gb", "0.002", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m bench.structured_output --shape tiny")
    assert result["hardware"] == "cpu" and result["commit"]
    arm = result["arms"][0]
    assert arm["same_tokens"] and arm["constrained_outputs"] == {"valid": 4, "invalid": 0}
    assert arm["ratio"] > 0 and result["grammar_compile_ms"]["n"] >= 1
    assert result["grammar_compile_ms"]["p50"] <= result["grammar_compile_ms"]["p99"]
