"""Generate the gRPC/protobuf Python package `slora.v1` from `proto/slora/v1/*.proto`.

Generated code is a build product: it is written next to `slora/v1/__init__.py` at set-up and
ignored by git. Run `python -m services.codegen`; building a wheel runs it too (setup.py), so
the wheel carries the generated modules.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(root: Path = ROOT, out: Path | None = None) -> list[Path]:
    """Compile every proto under root/proto/slora/v1 into out/slora/v1 (default: root's);
    return the proto files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted((root / "proto").glob("slora/v1/*.proto"))
    if not protos:
        return []
    include = Path(grpc_tools.__file__).parent / "_proto"
    out = out or root
    (out / "slora" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{root / 'proto'}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(root / "proto")) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {[p.name for p in protos]}")
    return protos


def main() -> None:
    protos = generate()
    print(f"generated {len(protos)} proto file(s) into slora/v1", file=sys.stderr)


if __name__ == "__main__":
    main()
