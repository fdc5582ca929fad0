"""`slora serve MODEL` with vLLM's command line: the flags map onto the worker's, the flags
slora has no use for are accepted with a warning, and (slow) the started server serves an
adapter and the base model to the `openai` SDK, with or without --api-key."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from services.cli import build_parser
from services.commands.serve import lora_modules, warnings, worker_args
from services.common.processes import free_port, slora_argv

VLLM_ARGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
             "--max-model-len", "256", "--dtype", "float32", "--gpu-memory-utilization", "0.9",
             "--max-cpu-loras", "4", "--tensor-parallel-size", "1")


def parse(*argv: str):  # type: ignore[no-untyped-def]
    args, unknown = build_parser("serve").parse_known_args(["serve", *argv])
    args.unknown_flags = unknown
    return args


def test_vllm_flags_map_onto_the_worker_and_unknown_ones_warn(demo_dir: Path) -> None:
    args = parse(str(demo_dir / "model"), *VLLM_ARGS, "--lora-modules",
                 f"sql={demo_dir / 'adapters' / 'qv-r4'}",
                 '{"name": "chat", "path": "' + str(demo_dir / "adapters" / "attn-r8") + '"}',
                 "--disable-log-requests", "--swap-space", "4", "--served-model-name", "tiny")
    flags = worker_args(args)
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs == {"--max-model-len": "256", "--dtype": "float32", "--max-rank": "16",
                     "--max-adapters-per-batch": "2", "--tensor-parallel-size": "1"}
    notes = warnings(args)
    assert any("--gpu-memory-utilization" in n for n in notes)
    assert any("--max-cpu-loras" in n for n in notes)
    assert notes[-1] == "ignoring flags slora does not use: --disable-log-requests --swap-space 4"
    modules = lora_modules(args.lora_modules)
    assert [(m.name, m.path.name) for m in modules] == [("sql", "qv-r4"), ("chat", "attn-r8")]
    assert args.served_model_name == ["tiny"]


def test_a_lora_module_that_is_not_an_adapter_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not a PEFT adapter folder"):
        lora_modules([f"x={tmp_path}"])
    with pytest.raises(SystemExit, match="NAME=PATH"):
        lora_modules(["just-a-path"])


@pytest.fixture(scope="module")
def served(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(slora_argv(
            "serve", str(demo_dir / "model"), "--port", str(port), "--served-model-name",
            "tiny", "--lora-modules", f"sql={demo_dir / 'adapters' / 'qv-r4'}",
            "--api-key", "sk-test", "--num-pages", "128", *VLLM_ARGS, "--swap-space", "4"),
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "serving tiny" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        assert "ignoring flags slora does not use: --swap-space 4" in log.read_text()
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.slow
def test_serve_answers_the_openai_sdk_for_the_adapter_and_the_base(served: str) -> None:
    client = OpenAI(base_url=served, api_key="sk-test", max_retries=0)
    assert {m.id for m in client.models.list()} == {"tiny", "sql"}
    for model in ("sql", "tiny"):
        r = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=5,
                                      temperature=0)
        assert r.usage is not None and r.usage.completion_tokens == 5
        assert r.system_fingerprint == ("sql@v1" if model == "sql" else "tiny")
    chat = client.chat.completions.create(model="sql", max_tokens=4, messages=[
        {"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        OpenAI(base_url=served, api_key="EMPTY", max_retries=0).models.list()
