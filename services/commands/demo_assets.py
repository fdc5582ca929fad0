"""`slora demo-assets DIR [--seed N]`: write the tiny demo model and its PEFT adapters."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo-assets",
                       help="write a tiny Llama (HF dir) and 12 PEFT adapters, seeded")
    p.add_argument("dir", help="output directory (model/, adapters/<name>/, manifest.json)")
    p.add_argument("--seed", type=int, default=0, help="the same seed writes identical files")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from devtools.demo_assets import write_demo_assets  # torch: only when run (fast --help)

    assets = write_demo_assets(args.dir, seed=args.seed)
    sys.stdout.write(f"model:    {assets.model_dir}\n")
    for name, path in assets.adapter_dirs.items():
        sys.stdout.write(f"adapter:  {name:<12} {path}\n")
    sys.stdout.write(f"manifest: {assets.manifest}\n")
    return 0
