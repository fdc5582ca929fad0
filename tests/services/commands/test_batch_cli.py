"""`slora batch` as a user runs it: outputs in input order, and every bad input refused with a
message naming the problem before any work (exit code 2, no output file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main


def write_lines(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def run_batch(demo_dir: Path, tmp_path: Path, lines: list[object], *extra: str) -> int:
    inp = write_lines(tmp_path / "in.jsonl", lines)
    return main(["batch", "--model", str(demo_dir / "model"),
                 "--adapter", f"a={demo_dir / 'adapters' / 'qv-r4'}",
                 "--input", str(inp), "--output", str(tmp_path / "out.jsonl"), "--no-progress",
                 *extra])


def test_outputs_in_input_order_with_text_and_finish_reason(demo_dir, tmp_path):
    lines = [{"prompt": "Once upon a time", "max_new_tokens": 5, "temperature": 0},
             {"token_ids": [5, 6, 7], "adapter": "a", "max_new_tokens": 3, "temperature": 0,
              "ignore_eos": True},
             {"prompt": "Hello", "max_new_tokens": 4, "temperature": 0.9, "seed": 1,
              "adapter": "a"}]
    assert run_batch(demo_dir, tmp_path, lines) == 0
    out = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == 3
    assert len(out[1]["token_ids"]) == 3 and out[1]["finish_reason"] == "length"
    for res, line in zip(out, lines, strict=True):
        assert 1 <= len(res["token_ids"]) <= line["max_new_tokens"]
        assert res["finish_reason"] in ("stop", "length") and isinstance(res["text"], str)
    # Same seed, same answer: run again and compare the seeded line.
    assert run_batch(demo_dir, tmp_path, lines) == 0
    again = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert again == out


@pytest.mark.parametrize("line,needle", [
    ("{not json", "line 1: not valid JSON"),
    ({"prompt": "x", "token_ids": [1]}, "exactly one of 'prompt', 'token_ids' or 'messages'"),
    ({"prompt": "x", "adapter": "nope"}, "adapter 'nope' was not given"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "colour": "red"}, "unknown field(s) ['colour']"),
    ({"token_ids": [1, "2"]}, "'token_ids' must be a list of integers"),
])
def test_bad_lines_are_refused_before_any_work(demo_dir, tmp_path, capsys, line, needle):
    assert run_batch(demo_dir, tmp_path, [line]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_bad_adapter_directory_is_named(demo_dir, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [{"prompt": "x"}])
    code = main(["batch", "--model", str(demo_dir / "model"), "--adapter",
                 f"b={tmp_path / 'missing'}", "--input", str(inp), "--output",
                 str(tmp_path / "out.jsonl"), "--no-progress"])
    assert code == 2
    assert "missing" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
