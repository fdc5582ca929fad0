"""Chat input and context length on the CLI: `slora batch` lines with `messages` are rendered
with the model's chat template exactly as transformers' apply_chat_template tokenizes them (and
refused clearly when they cannot be); `--max-model-len` on batch and worker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.cli import main

CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "The quick brown fox"}]


def run_batch(model_dir: Path, tmp_path: Path, lines: list[object], *extra: str) -> int:
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    return main(["batch", "--model", str(model_dir), "--input", str(inp),
                 "--output", str(tmp_path / "out.jsonl"), "--no-progress", *extra])


def test_messages_generate_as_the_hf_chat_prompt_does(demo_dir, tmp_path):
    from transformers import AutoTokenizer

    model_dir = demo_dir / "model"
    hf_ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    common = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    lines = [{"messages": CHAT, **common}, {"token_ids": list(hf_ids), **common}]
    assert run_batch(model_dir, tmp_path, lines) == 0
    chat, ids = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(chat["token_ids"]) == 6 and chat["token_ids"] == ids["token_ids"]
    assert chat["text"] == ids["text"]


@pytest.mark.parametrize("line, needle", [
    ({"messages": []}, "line 1: messages is empty"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content must be a string"),
    ({"messages": CHAT, "prompt": "x"}, "exactly one of 'prompt', 'token_ids' or 'messages'"),
])
def test_bad_messages_are_refused_before_any_work(demo_dir, tmp_path, capsys, line, needle):
    assert run_batch(demo_dir / "model", tmp_path, [line]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_model_without_chat_template_refuses_messages_by_line(demo_dir, tmp_path, capsys):
    model_dir = tmp_path / "model"
    shutil.copytree(demo_dir / "model", model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    lines = [{"prompt": "fine"}, {"messages": CHAT}]
    assert run_batch(model_dir, tmp_path, lines) == 2
    err = capsys.readouterr().err
    assert "line 2:" in err and "no chat template" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_max_model_len_flag_limits_and_is_checked(demo_dir, tmp_path, capsys):
    line = {"token_ids": [5] * 20, "max_new_tokens": 8}
    assert run_batch(demo_dir / "model", tmp_path, [line], "--max-model-len", "24") == 2
    assert "max_model_len=24" in capsys.readouterr().err
    assert run_batch(demo_dir / "model", tmp_path, [line], "--max-model-len", "513") == 2
    assert "exceeds the model's limit of 512" in capsys.readouterr().err
    assert run_batch(demo_dir / "model", tmp_path, [line], "--max-model-len", "28") == 0


def test_worker_passes_max_model_len_to_its_engine(monkeypatch):
    import services.worker.main as worker_main

    seen = []

    async def fake_serve(opts):
        seen.append(opts.engine.max_model_len)
        return 0

    monkeypatch.setattr(worker_main, "serve_worker", fake_serve)
    base = ["worker", "--model", "m", "--control-plane", "cp:1"]
    assert main([*base, "--max-model-len", "300"]) == 0 and main(base) == 0
    assert seen == [300, None]  # None: the engine takes the model's own limit
