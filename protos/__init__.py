"""Protocol buffers and gRPC stubs, generated from `tandem.proto` by the build.

The stubs are generated on first import (with the installed grpcio-tools, so they always match the
installed protobuf/grpcio) into `protos/_generated/`, keyed by the .proto's hash, and never
committed. `from protos import pb, rpc` gives the message and service modules;
`add_GenerationServicer_to_server` registers the public service for Ray Serve's gRPC proxy with a
request reader that never raises (a corrupt request becomes INVALID_ARGUMENT, not UNKNOWN).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

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

MAX_REQUEST_BYTES = 4 * 2**20  # the largest public request read: a gRPC GenerateRequest or an HTTP body


@dataclass(frozen=True)
class UnreadableRequest:
    """Handed to the servicer instead of a request that cannot be read (corrupt wire format, too
    large): the servicer answers INVALID_ARGUMENT with `reason`, where a raising deserializer would
    make the server answer UNKNOWN."""

    reason: str


def read_generate_request(data: bytes) -> pb.GenerateRequest | UnreadableRequest:
    if len(data) > MAX_REQUEST_BYTES:
        return UnreadableRequest(f"the request is {len(data)} bytes; this server accepts at most {MAX_REQUEST_BYTES}")
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        return UnreadableRequest(f"the request is not a valid tandem.v1.GenerateRequest: {e}")


def add_GenerationServicer_to_server(servicer, server) -> None:
    """The generated `rpc.add_GenerationServicer_to_server`, reading requests with
    `read_generate_request`. Ray Serve's gRPC proxy imports it (`grpc_options.grpc_servicer_functions`
    in ray_config.yaml) and keeps its request deserializer."""
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=read_generate_request,
        response_serializer=pb.GenerateResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.v1.Generation", handlers),))
    server.add_registered_method_handlers("tandem.v1.Generation", handlers)
