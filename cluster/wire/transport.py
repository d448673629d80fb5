"""The internal gRPC transport: where a verifier listens, how routers reach it, and who may call it.

- **Address.** `bind: node` (the default) binds the Ray node's IP and advertises it: 127.0.0.1 on
  the loopback-only cluster that `init_local_ray` starts, the node's own address on a multi-node
  cluster. `bind: loopback` always binds 127.0.0.1 (every router on the same machine).
- **Authentication.** One secret per Ray cluster, made by the first tandem process that asks and
  kept in Ray's GCS key-value store, so it reaches routers through Ray. Every call on the `Verifier`
  service carries it as `authorization: Bearer …` metadata (call credentials on TLS channels, a
  client interceptor on plaintext ones); the server's interceptor refuses a missing or wrong one
  with UNAUTHENTICATED. The secret is never logged and is not part of any endpoint or config.
- **TLS (optional).** The verifier serves with the configured certificate and key and advertises the
  CA certificate (public) in its endpoint, which routers get through Ray, so a router needs no
  certificate configuration of its own.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import secrets
from dataclasses import dataclass

import grpc

from cluster.core.config import NetworkConfig, TLSConfig

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
SECRET_METADATA_KEY = "authorization"
_KV_NAMESPACE, _KV_SECRET = b"tandem", b"internal_secret"


@dataclass(frozen=True)
class Endpoint:
    """Where and how to reach one verifier replica; routers get it through Ray. Holds no secret."""

    name: str
    address: str  # host:port, as bound
    root_certificates: bytes | None = None  # PEM the server's certificate chains to; None: plaintext
    server_name: str | None = None  # expected name in the certificate, when not the dialled address


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """The verifier's TLS credentials from the configured PEM files."""
    return grpc.ssl_server_credentials([(tls.read_pem("key_file"), tls.read_pem("cert_file"))])


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_host(network: NetworkConfig) -> str:
    """The address to bind in this process: Ray's IP for this node, or loopback."""
    if network.bind == "loopback":
        return LOOPBACK
    import ray.util

    return ray.util.get_node_ip_address()


def cluster_secret() -> str:
    """This Ray cluster's secret for internal calls: created by the first caller, read by the rest."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        raise RuntimeError("the cluster secret lives in Ray: connect to Ray first")
    internal_kv._internal_kv_put(_KV_SECRET, secrets.token_urlsafe(32), overwrite=False, namespace=_KV_NAMESPACE)
    secret = internal_kv._internal_kv_get(_KV_SECRET, namespace=_KV_NAMESPACE)  # whoever put first won
    if not secret:
        raise RuntimeError("the cluster secret could not be stored in Ray's key-value store")
    return secret.decode()


def _bearer(secret: str) -> str:
    return f"Bearer {secret}"


# ---- server side ------------------------------------------------------------------------------


def _refuse(request_or_iterator, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "this internal service needs the cluster's secret")


_REFUSALS = {  # (request_streaming, response_streaming) -> a handler that only refuses
    (False, False): grpc.unary_unary_rpc_method_handler(_refuse),
    (False, True): grpc.unary_stream_rpc_method_handler(_refuse),
    (True, False): grpc.stream_unary_rpc_method_handler(_refuse),
    (True, True): grpc.stream_stream_rpc_method_handler(_refuse),
}


class SecretCheck(grpc.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not the cluster secret (UNAUTHENTICATED)."""

    def __init__(self, secret: str):
        self._expected = _bearer(secret).encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED
            return None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == SECRET_METADATA_KEY and secrets.compare_digest(
                    value.encode() if isinstance(value, str) else value, self._expected):
                return handler
        return _REFUSALS[(handler.request_streaming, handler.response_streaming)]


def add_port(server: grpc.Server, host: str, port: int, network: NetworkConfig) -> int:
    """Bind `host:port` (plaintext or TLS as configured); returns the bound port."""
    address = host_port(host, port)
    if network.tls is not None:
        bound = server.add_secure_port(address, server_credentials(network.tls))
    else:
        bound = server.add_insecure_port(address)
        if not is_loopback(host):
            log.warning("the Verifier service listens in plaintext on %s (calls are authenticated, "
                        "traffic is not encrypted): set engine.network.tls for multi-node clusters", address)
    if bound == 0:
        raise RuntimeError(f"could not bind {address}")
    return bound


def advertised_endpoint(name: str, host: str, port: int, network: NetworkConfig) -> Endpoint:
    """What a verifier bound to `host:port` tells routers (through Ray)."""
    tls = network.tls
    return Endpoint(name, host_port(host, port), tls.root_certificates() if tls else None,
                    tls.server_name if tls else None)


# ---- client side ------------------------------------------------------------------------------


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _SecretMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                      grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the secret to every call on a plaintext channel (gRPC sends call credentials only over TLS)."""

    def __init__(self, secret: str):
        self._metadata = (SECRET_METADATA_KEY, _bearer(secret))

    def _details(self, d) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._metadata], d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _SecretCredentials(grpc.AuthMetadataPlugin):
    def __init__(self, secret: str):
        self._metadata = ((SECRET_METADATA_KEY, _bearer(secret)),)

    def __call__(self, context, callback) -> None:
        callback(self._metadata, None)


def open_channel(endpoint: Endpoint, secret: str | None = None) -> grpc.Channel:
    """A channel to `endpoint` whose every call carries the cluster secret (fetched from Ray if not given)."""
    secret = secret if secret is not None else cluster_secret()
    if endpoint.root_certificates is None:
        return grpc.intercept_channel(grpc.insecure_channel(endpoint.address), _SecretMetadata(secret))
    credentials = grpc.composite_channel_credentials(
        grpc.ssl_channel_credentials(root_certificates=endpoint.root_certificates),
        grpc.metadata_call_credentials(_SecretCredentials(secret), name="tandem-cluster-secret"))
    options = [("grpc.ssl_target_name_override", endpoint.server_name)] if endpoint.server_name else []
    return grpc.secure_channel(endpoint.address, credentials, options=options)
