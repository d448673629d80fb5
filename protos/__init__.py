"""Protocol buffers and gRPC stubs, generated from `tandem.proto` by the build.

The stubs are generated on first import (with the installed grpcio-tools, so they always match the
installed protobuf/grpcio) into `protos/_generated/`, keyed by the .proto's hash, and never
committed. `from protos import pb, rpc` gives the message and service modules.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
PROTO = _HERE / "tandem.proto"


def _generate(out: Path) -> None:
    from grpc_tools import protoc

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gen-", dir=out.parent))
    try:
        include = Path(protoc.__file__).resolve().parent / "_proto"
        code = protoc.main(["grpc_tools.protoc", f"-I{_HERE}", f"-I{include}", f"--python_out={staging}",
                            f"--grpc_python_out={staging}", str(PROTO)])
        if code != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit {code})")
        (staging / "__init__.py").write_text("")
        try:
            os.replace(staging, out)  # atomic; another process may have won the race
        except OSError:
            if not (out / "tandem_pb2.py").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _load():
    digest = hashlib.sha256(PROTO.read_bytes()).hexdigest()[:16]
    out = _HERE / "_generated" / f"v{digest}"
    if not (out / "tandem_pb2_grpc.py").is_file():
        try:
            _generate(out)
        except PermissionError:  # installed read-only: generate into the user's cache instead
            out = Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem")) / "protos" / f"v{digest}"
            if not (out / "tandem_pb2_grpc.py").is_file():
                _generate(out)
    sys.path.insert(0, str(out))  # the generated grpc module imports `tandem_pb2` by bare name
    try:
        return importlib.import_module("tandem_pb2"), importlib.import_module("tandem_pb2_grpc")
    finally:
        sys.path.remove(str(out))


pb, rpc = _load()

# Import paths for Ray Serve's gRPC proxy (`grpc_options.grpc_servicer_functions` in ray_config.yaml).
add_GenerationServicer_to_server = rpc.add_GenerationServicer_to_server
