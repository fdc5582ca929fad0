"""`slora serve MODEL`: one command serving a base model and its LoRA adapters over the OpenAI
API, taking vLLM's command line (`vllm serve MODEL --enable-lora --lora-modules name=path ...`),
so slora is tried as vLLM is, and KServe's LLMInferenceService can render its command.

It runs the whole stack under one supervising process: a control plane on SQLite in the state
folder, one worker, one gateway whose HTTP API listens on --host:--port. Adapters given with
--lora-modules are registered with their sha256 like published versions (version v1, promoted),
under one tenant whose key the HTTP API uses for every caller (no key needed, or the one given
with --api-key, as vLLM). vLLM flags slora has no use for are accepted with a warning.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ADAPTER_VERSION = "v1"
TENANT = "serve"
# vLLM flags that map onto a worker flag (vLLM name -> slora worker flag).
WORKER_FLAGS = {"max_model_len": "--max-model-len", "dtype": "--dtype",
                "max_lora_rank": "--max-rank", "max_loras": "--max-adapters-per-batch",
                "max_num_seqs": "--max-num-seqs", "tensor_parallel_size": "--tensor-parallel-size",
                "max_num_batched_tokens": "--max-num-batched-tokens", "device": "--device",
                "num_pages": "--num-pages", "block_size": "--block-size",
                "metrics_port": "--metrics-port"}  # the worker's vLLM-named /metrics
# Accepted with a note of what slora does instead.
NOTED_FLAGS = {
    "gpu_memory_utilization": "the page arena is sized by --num-pages (KV and adapters share it)",
    "max_cpu_loras": "adapters kept warm in host memory: --capacity versions, LRU by bytes",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve MODEL and LoRA adapters over the OpenAI API, with "
                                     "vLLM's command line")
    p.add_argument("model", help="Hugging Face model directory (a local folder)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (vLLM's default: all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the `model` naming the base model (default: MODEL as given)")
    p.add_argument("--enable-lora", action="store_true", help="accepted: LoRA is always on")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters to serve (PEFT folders), or JSON {name, path}")
    p.add_argument("--api-key", default="", help="the key callers must present (default: none)")
    for name in WORKER_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), default=None)
    for name in NOTED_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), default=None)
    p.add_argument("--capacity", type=int, default=0, help="adapter versions to keep warm")
    p.add_argument("--state-dir", default="", help="database, logs, caches (default: a temp dir)")
    p.set_defaults(func=run, accepts_unknown_flags=True)


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: Path


def lora_modules(specs: list[str]) -> list[LoraModule]:
    """vLLM's `name=path` or JSON `{"name": ..., "path": ...}` forms."""
    import json

    out = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            obj = json.loads(spec)
            name, path = str(obj["name"]), str(obj["path"])
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise SystemExit(f"slora serve: --lora-modules takes NAME=PATH, got {spec!r}")
        folder = Path(path).expanduser().resolve()
        if not (folder / "adapter_config.json").is_file():
            raise SystemExit(f"slora serve: {folder} is not a PEFT adapter folder "
                             "(no adapter_config.json)")
        out.append(LoraModule(name, folder))
    return out


def worker_args(args: argparse.Namespace) -> list[str]:
    flags = []
    for name, flag in WORKER_FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            flags += [flag, str(value)]
    if args.capacity:
        flags += ["--capacity", str(args.capacity)]
    return flags


def warnings(args: argparse.Namespace) -> list[str]:
    notes = [f"--{n.replace('_', '-')} is accepted; {why}" for n, why in NOTED_FLAGS.items()
             if getattr(args, n) is not None]
    unknown = getattr(args, "unknown_flags", [])
    if unknown:
        notes.append(f"ignoring flags slora does not use: {' '.join(unknown)}")
    return notes


def run(args: argparse.Namespace) -> int:
    from services.commands.serve_stack import ServeStack
    from services.common.processes import StopOnSignal

    model = Path(args.model).expanduser().resolve()
    if not (model / "config.json").is_file():
        say(f"{model} is not a Hugging Face model folder (no config.json); slora serves "
            "local folders")
        return 2
    for note in warnings(args):
        say(f"warning: {note}")
    name = (args.served_model_name or [args.model])[0]
    state = Path(args.state_dir or tempfile.mkdtemp(prefix="slora-serve-")).resolve()
    stack = ServeStack(model, name, lora_modules(args.lora_modules), state,
                       f"{args.host}:{args.port}", worker_args(args), args.api_key)
    stop = StopOnSignal()
    try:
        stack.start(say)
        say(f"serving {name} and {len(stack.adapters)} adapter(s) on "
            f"http://{args.host}:{args.port}/v1 (logs in {state / 'logs'})")
        return stop.watch(lambda: stack.children, say)
    except RuntimeError as exc:
        say(f"start-up failed: {exc}")
        return 1
    finally:
        stack.stop()


def say(msg: str) -> None:
    sys.stdout.write(f"slora serve: {msg}\n")
    sys.stdout.flush()
