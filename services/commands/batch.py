"""`slora batch`: offline generation over a JSONL file, in one mixed multi-LoRA batch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from slora_core.chat_template import ChatTemplateError, check_messages
from slora_core.config import EngineConfig
from slora_core.engine_args import add_engine_args, engine_config_from_args
from slora_core.launch import AnyEngine, start_engine
from slora_core.sampling_params import SamplingParams
from slora_core.tokenizer import Tokenizer

_PARAM_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
               "min_new_tokens", "repetition_penalty", "stop_token_ids")
_INPUT_KEYS = ("prompt", "token_ids", "messages")
_KNOWN_KEYS = {*_INPUT_KEYS, "adapter", *_PARAM_KEYS}


class BatchInputError(ValueError):
    """A line of the input file that cannot be run; names the line."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="generate for every line of a JSONL file")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   help="a PEFT adapter directory, referred to by NAME in the input (repeatable)")
    p.add_argument("--input", required=True,
                   help="JSONL: {prompt|token_ids|messages, adapter?, ...}; messages "
                        "([{role, content}]) are rendered with the model's chat template")
    p.add_argument("--output", required=True, help="JSONL written in input order")
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p, skip=("max_queue",))  # every line is queued at once
    p.set_defaults(func=run)


def parse_adapters(specs: list[str]) -> dict[str, str]:
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise BatchInputError(f"--adapter {spec!r}: expected NAME=DIR")
        adapters[name] = path
    return adapters


def parse_line(lineno: int, line: str, adapters: dict[str, str]) -> dict[str, Any]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise BatchInputError(f"line {lineno}: not valid JSON: {e}") from None
    if not isinstance(item, dict):
        raise BatchInputError(f"line {lineno}: expected a JSON object")
    unknown = set(item) - _KNOWN_KEYS
    if unknown:
        raise BatchInputError(f"line {lineno}: unknown field(s) {sorted(unknown)}")
    if sum(k in item for k in _INPUT_KEYS) != 1:
        raise BatchInputError(f"line {lineno}: give exactly one of 'prompt', 'token_ids' or "
                              f"'messages'")
    prompt = item.get("prompt", item.get("token_ids"))
    messages = None
    if "messages" in item:
        try:
            messages = check_messages(item["messages"])
        except ChatTemplateError as e:
            raise BatchInputError(f"line {lineno}: {e}") from None
    if "prompt" in item and not isinstance(prompt, str):
        raise BatchInputError(f"line {lineno}: 'prompt' must be a string")
    if "token_ids" in item and not (
        isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    ):
        raise BatchInputError(f"line {lineno}: 'token_ids' must be a list of integers")
    adapter = item.get("adapter")
    if adapter is not None and adapter not in adapters:
        raise BatchInputError(f"line {lineno}: adapter {adapter!r} was not given with --adapter")
    try:
        params = SamplingParams(**{k: item[k] for k in _PARAM_KEYS if k in item})
    except (TypeError, ValueError) as e:
        raise BatchInputError(f"line {lineno}: {e}") from None
    return {"prompt": prompt, "messages": messages, "line": lineno, "adapter": adapter,
            "params": params}


def render_chats(items: list[dict[str, Any]], model_dir: str) -> None:
    """Give every `messages` item its prompt: the model's chat template, tokenized (as
    transformers' apply_chat_template). Refuses the first line the template cannot render."""
    chats = [item for item in items if item["messages"] is not None]
    if not chats:
        return
    tokenizer = Tokenizer.from_dir(model_dir)
    for item in chats:
        try:
            item["prompt"] = tokenizer.encode_chat(item["messages"])
        except ChatTemplateError as e:
            raise BatchInputError(f"line {item['line']}: {e}") from None


def run_batch(engine: AnyEngine, items: list[dict[str, Any]], progress: bool) -> list[dict]:
    """Run every item through the engine; returns one result dict per item, in order."""
    results: list[dict[str, Any]] = [
        {"token_ids": [], "text": "", "finish_reason": None} for _ in items
    ]
    for i, item in enumerate(items):
        engine.add_request(str(i), item["prompt"], item["params"], adapter=item["adapter"])
    total = sum(item["params"].max_new_tokens for item in items)
    with tqdm(total=total, unit="tok", disable=not progress, file=sys.stderr) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                res = results[int(out.request_id)]
                res["token_ids"] += out.token_ids
                res["text"] += out.text
                bar.update(len(out.token_ids))
                if out.finished:
                    res["finish_reason"] = out.finish_reason
                    if out.error:
                        res["error"] = out.error
                    bar.update(items[int(out.request_id)]["params"].max_new_tokens
                               - len(res["token_ids"]))
    return results


def run(args: argparse.Namespace) -> int:
    try:
        adapters = parse_adapters(args.adapter)
        lines = Path(args.input).read_text().splitlines()
        items = [parse_line(i + 1, ln, adapters) for i, ln in enumerate(lines) if ln.strip()]
        render_chats(items, args.model)
    except (OSError, ValueError) as e:  # BatchInputError, or an unreadable tokenizer
        print(f"slora batch: {e}", file=sys.stderr)
        return 2
    try:  # ConfigError (a ValueError): e.g. a max_model_len above the model's
        config = engine_config_from_args(
            args, max_queue=max(EngineConfig.max_queue, len(items)))
        engine = start_engine(args.model, config)
        for name, path in adapters.items():
            engine.register_adapter(name, path)
        results = run_batch(engine, items, progress=not args.no_progress)
    except ValueError as e:
        print(f"slora batch: {e}", file=sys.stderr)
        return 2
    with open(args.output, "w") as f:
        for res in results:
            f.write(json.dumps(res) + "\n")
    return 0
