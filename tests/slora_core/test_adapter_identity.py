"""An adapter's identity is its content (issue 33): a name registered again with other weights
serves the new weights (equal to transformers + peft on them) while a request started before
finishes on the old; weights pushed as tensors are one adapter with their files; a digest that
does not match the files is refused and nothing is kept under it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slora_core.adapters import AdapterFormatError, digest_adapter_dir
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.outputs import ADAPTER_UNLOADABLE
from slora_core.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 99, 7, 300, 12]
NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)


@torch.no_grad()
def hf_greedy(model_dir: Path, adapter_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32), adapter_dir)
    model.eval()
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _engine(demo: Path, **kw: object) -> LLMEngine:
    return LLMEngine.from_model_dir(demo / "model", EngineConfig(num_pages=64, **kw))


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    return got


@pytest.mark.slow
def test_a_name_registered_again_serves_the_new_weights_and_running_requests_the_old(
        demo_dir: Path) -> None:
    """The bug the issue measured: unregister + register of one name served the old weights
    (arena pages kept by name). Here a request started on the old content finishes on it, and
    requests after the second registration match HF + peft on the new adapter's files."""
    old_dir, new_dir = demo_dir / "adapters" / "all-r16", demo_dir / "adapters" / "attn-r8"
    want_old = hf_greedy(demo_dir / "model", old_dir, PROMPT, NEW)
    want_new = hf_greedy(demo_dir / "model", new_dir, PROMPT, NEW)
    assert want_old != want_new  # the two adapters are told apart by their tokens
    engine = _engine(demo_dir)
    first = engine.register_adapter("support", old_dir)
    assert first == digest_adapter_dir(old_dir)
    engine.add_request("before", PROMPT, GREEDY, adapter="support")
    outs = engine.step()  # "before" is running on the old content's pages
    engine.unregister_adapter("support")
    second = engine.register_adapter("support", new_dir)
    assert second != first and second == digest_adapter_dir(new_dir)
    engine.add_request("after", PROMPT, GREEDY, adapter="support")
    got = _drain(engine)
    got["before"] = [t for o in outs for t in o.token_ids] + got["before"]
    assert got["before"] == want_old
    assert got["after"] == want_new
    # The old content is gone once nothing reads it: no name, no host copy, no arena pages.
    assert not engine.pool.is_resident(first) and engine.pool.is_resident(second)
    engine.register_adapter("support", new_dir)  # the same content again: nothing changes
    engine.add_request("again", PROMPT, GREEDY, adapter="support")
    assert _drain(engine)["again"] == want_new


@pytest.mark.slow
def test_registering_a_name_over_a_queued_request_keeps_its_content(demo_dir: Path) -> None:
    """Registered again while a request waits (never scheduled): that request still runs on
    the content it was queued with."""
    old_dir, new_dir = demo_dir / "adapters" / "qv-r4", demo_dir / "adapters" / "ko-r6"
    engine = _engine(demo_dir, max_num_seqs=1)
    engine.register_adapter("a", old_dir)
    engine.add_request("first", [9, 8, 7], GREEDY)  # holds the only sequence slot
    engine.add_request("queued", PROMPT, GREEDY, adapter="a")
    engine.register_adapter("a", new_dir)
    got = _drain(engine)
    assert got["queued"] == hf_greedy(demo_dir / "model", old_dir, PROMPT, NEW)


def test_tensors_pushed_in_memory_are_the_adapter_of_their_files(demo_dir: Path) -> None:
    """register_adapter_tensors (a training loop's new weights, no disk) serves exactly the
    files' adapter; one state dict and config give one digest, other weights another."""
    adir = demo_dir / "adapters" / "attn-r8"
    state = load_file(str(adir / "adapter_model.safetensors"))
    config = json.loads((adir / "adapter_config.json").read_text())
    engine = _engine(demo_dir)
    engine.register_adapter("files", adir)
    digest = engine.register_adapter_tensors("pushed", state, config)
    assert digest == engine.register_adapter_tensors("pushed-again", dict(state), dict(config))
    for rid, name in (("files", "files"), ("pushed", "pushed")):
        engine.add_request(rid, PROMPT, GREEDY, adapter=name)
    got = _drain(engine)
    assert got["pushed"] == got["files"]
    changed = {k: v * 2 if "lora_B" in k else v for k, v in state.items()}
    assert engine.register_adapter_tensors("pushed", changed, config) != digest
    engine.add_request("changed", PROMPT, GREEDY, adapter="pushed")
    assert _drain(engine)["changed"] != got["files"]


def test_a_digest_that_does_not_match_the_files_is_refused(demo_dir: Path) -> None:
    adir = demo_dir / "adapters" / "qv-r4"
    wrong = "0" * 64
    engine = _engine(demo_dir)
    with pytest.raises(AdapterFormatError, match="sha256 mismatch"):
        engine.register_adapter("bad", adir, sha256=wrong)
    assert not engine.adapters.is_registered("bad")
    # Registered without reading (as the worker does): the request that needs it fails with
    # the reason, and nothing is kept under the wrong digest.
    engine.register_adapter("bad", adir, sha256=wrong, preload=False)
    engine.add_request("r", PROMPT, GREEDY, adapter="bad")
    finals = [o for _ in range(50) for o in engine.step() if o.finished]
    assert len(finals) == 1 and finals[0].error_kind == ADAPTER_UNLOADABLE
    assert "sha256 mismatch" in (finals[0].error or "")
    assert not engine.adapters.is_cached("bad") and not engine.pool.is_resident(wrong)
    assert engine.warm_adapters() == []


def test_a_wrong_digest_cannot_borrow_another_names_cached_content(demo_dir: Path) -> None:
    """A name registered (unread) with the digest of content another name already holds in
    host memory does not get that content: its own files are read and checked first."""
    good, other = demo_dir / "adapters" / "qv-r4", demo_dir / "adapters" / "ko-r6"
    engine = _engine(demo_dir)
    digest = engine.register_adapter("good", good)  # in host memory now
    engine.register_adapter("liar", other, sha256=digest, preload=False)
    assert engine.adapters.peek("liar") is None
    with pytest.raises(AdapterFormatError, match="sha256 mismatch"):
        engine.load_adapter("liar")
