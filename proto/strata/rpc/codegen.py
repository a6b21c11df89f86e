"""Regenerate (or check) the committed gRPC code from ``strata.proto``.

    python -m strata.rpc.codegen          # rewrite strata_pb2*.py / .pyi
    python -m strata.rpc.codegen --check  # exit 1 if the committed files are stale
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the proto/ folder: its layout matches the package (strata/rpc)
FILES = ("strata_pb2.py", "strata_pb2.pyi", "strata_pb2_grpc.py")


def generate(out: Path) -> None:
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
        f"--grpc_python_out={out}", str(HERE / "strata.proto"),
    ])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for name in FILES:
            new = (Path(tmp) / "strata" / "rpc" / name).read_text()
            cur = HERE / name
            if not cur.exists() or cur.read_text() != new:
                stale.append(name)
                if not args.check:
                    cur.write_text(new)
    if args.check and stale:
        print(f"stale generated files: {', '.join(stale)}; run python -m strata.rpc.codegen", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
