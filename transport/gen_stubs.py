"""Regenerate the checked-in protobuf/gRPC stubs from ``transport/diloco.proto``.

Runs ``python -m grpc_tools.protoc`` and rewrites the generated top-level import
(``import diloco_pb2``) to a package-relative one so the stubs import as ``transport.diloco_pb2``.
``tests/test_proto_stubs.py`` regenerates into a temporary directory and diffs against the checked-in files,
so the stubs can never drift from the .proto.

Usage: ``python -m transport.gen_stubs [OUT_DIR]`` (default: the transport package directory).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_NAME = "diloco.proto"
GENERATED = ("diloco_pb2.py", "diloco_pb2.pyi", "diloco_pb2_grpc.py")

_ABSOLUTE_IMPORT = "import diloco_pb2 as diloco__pb2"
_PACKAGE_IMPORT = "from transport import diloco_pb2 as diloco__pb2"


def generate_stubs(out_dir: Path | str = PROTO_DIR) -> list[Path]:
    """Generate the stubs into ``out_dir``; return the written paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        PROTO_NAME,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"protoc failed ({result.returncode}): {result.stderr.strip()}")
    grpc_file = out / "diloco_pb2_grpc.py"
    text = grpc_file.read_text()
    if _ABSOLUTE_IMPORT not in text:
        raise RuntimeError(f"unexpected generated import in {grpc_file}; update gen_stubs.py")
    grpc_file.write_text(text.replace(_ABSOLUTE_IMPORT, _PACKAGE_IMPORT))
    return [out / name for name in GENERATED]


if __name__ == "__main__":
    for path in generate_stubs(sys.argv[1] if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
