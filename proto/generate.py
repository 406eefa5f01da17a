"""Regenerate the Python modules of proto/*.proto with grpcio-tools.

    python proto/generate.py            # writes services/rpc/expert_pb2.py, _pb2.pyi, _pb2_grpc.py
    python proto/generate.py OUT_ROOT   # writes OUT_ROOT/services/rpc/... (the staleness test uses this)

The generated modules live in the `services.rpc` package, not in a top-level `proto` package:
`proto` is also the import name of `proto-plus` (pulled in by Ray's dependencies), which would
shadow ours outside the repository root. Each .proto is compiled as if it sat at
services/rpc/<name>.proto, so the modules import each other as `from services.rpc import ...`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTOS = ["expert.proto"]
PACKAGE = "services/rpc"


def generated_names(proto: str) -> list[str]:
    stem = f"{PACKAGE}/{proto.removesuffix('.proto')}"
    return [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]


def generate(out_root: Path = REPO) -> list[Path]:
    """Compile every .proto into `out_root`; returns the files written."""
    from grpc_tools import protoc

    out_root = Path(out_root)
    (out_root / PACKAGE).mkdir(parents=True, exist_ok=True)
    well_known = str(files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as staging:
        (Path(staging) / PACKAGE).mkdir(parents=True)
        for proto in PROTOS:
            shutil.copy(REPO / "proto" / proto, Path(staging) / PACKAGE / proto)
            args = ["grpc_tools.protoc", f"-I{staging}", f"-I{well_known}", f"--python_out={out_root}",
                    f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", f"{PACKAGE}/{proto}"]  # fmt: skip
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {proto}")
    return [out_root / name for proto in PROTOS for name in generated_names(proto)]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO):
        print(path)
