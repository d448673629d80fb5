"""Authenticated internals: the `Verifier` service refuses every call without the cluster's secret
(UNAUTHENTICATED), over plaintext and over TLS; TLS refuses plaintext clients and certificates from
an unknown CA; routers of both runtimes (standalone `TandemCluster`, Serve `VerifierPool` leases)
get the secret through Ray and produce the target's exact greedy output."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import ray

from cluster.core.config import EngineConfig, NetworkConfig, TLSConfig
from cluster.core.errors import ConfigError
from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.model.verifier import VerifierEngine
from cluster.ray.router import Router
from cluster.ray.runtime import LOOPBACK, ClusterConfig, TandemCluster, init_local_ray
from cluster.wire.transport import advertised_endpoint, cluster_secret, open_channel, server_credentials
from cluster.wire.verifier_server import serve
from protos import pb, rpc
from tests.helpers import tiny_llama
from tests.net_helpers import listening_hosts, self_signed, status_code

MAX_TOKENS = 16
PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("What is the capital of France?", True),
]
SECRET = "the-test-secret"
UNAUTHENTICATED, UNAVAILABLE = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("certs")
    return {"verifier": self_signed(root / "verifier", ips=(LOOPBACK,)),
            "stranger": self_signed(root / "stranger", name="stranger", ips=(LOOPBACK,))}


def _tls(certs) -> NetworkConfig:
    cert_file, key_file = certs["verifier"]
    return NetworkConfig(tls=TLSConfig(cert_file=cert_file, key_file=key_file))


def _each_kind_of_call(stub) -> dict[str, object]:
    """Calls of every kind the router makes: unary (Health, Open, Release) and the bidi Verify stream."""
    return {
        "Health": lambda: stub.Health(pb.HealthRequest(), timeout=10),
        "Open": lambda: stub.Open(pb.OpenRequest(session="s", token_ids=[1, 2, 3],
                                                 params=pb.SamplingParams(max_tokens=4)), timeout=10),
        "Verify": lambda: list(stub.Verify(iter([pb.VerifyRequest(session="s", round=0, epoch=0, bonus=True)]),
                                           timeout=10)),
        "Release": lambda: stub.Release(pb.ReleaseRequest(session="s"), timeout=10),
    }


@contextmanager
def _local_verifier(network: NetworkConfig):
    """A verifier server over a tiny model in this process (no Ray): the secret is given, not read."""
    engine = VerifierEngine(TorchModelRunner(tiny_llama(0), name="tiny"))
    server, port = serve(engine, "local", LOOPBACK, 0, network=network, secret=SECRET)
    try:
        yield engine, advertised_endpoint("local", LOOPBACK, port, network)
    finally:
        server.stop(None)
        engine.stop()


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_every_call_needs_the_secret(tls, certs):
    with _local_verifier(_tls(certs) if tls else NetworkConfig()) as (engine, endpoint):
        if tls:  # TLS, but no call credentials at all
            bare = grpc.secure_channel(endpoint.address, grpc.ssl_channel_credentials(endpoint.root_certificates))
        else:
            bare = grpc.insecure_channel(endpoint.address)
        for channel in (bare, open_channel(endpoint, secret="not-" + SECRET)):
            with channel:
                for name, call in _each_kind_of_call(rpc.VerifierStub(channel)).items():
                    assert status_code(call) == UNAUTHENTICATED, name
        assert engine.num_sessions == 0  # nothing reached the engine
        with open_channel(endpoint, secret=SECRET) as channel:
            calls = _each_kind_of_call(rpc.VerifierStub(channel))
            assert calls["Health"]().serving
            assert calls["Open"]().length == 3 and engine.num_sessions == 1
            (result,) = calls["Verify"]()
            assert result.bonus and len(result.output_token_ids) == 1
            assert calls["Release"]().released and engine.num_sessions == 0


def test_tls_refuses_plaintext_and_unknown_certificates(certs):
    with _local_verifier(_tls(certs)) as (engine, endpoint):
        stranger_ca = Path(certs["stranger"][0]).read_bytes()
        for wrong in (dataclasses.replace(endpoint, root_certificates=None),  # plaintext client, with the secret
                      dataclasses.replace(endpoint, root_certificates=stranger_ca)):  # trusts another CA
            with open_channel(wrong, secret=SECRET) as channel:
                assert status_code(_each_kind_of_call(rpc.VerifierStub(channel))["Health"]) == UNAVAILABLE
        with open_channel(endpoint, secret=SECRET) as channel:
            assert rpc.VerifierStub(channel).Health(pb.HealthRequest(), timeout=10).serving


def test_network_config_is_checked(certs, tmp_path):
    with pytest.raises(ConfigError, match="bind"):
        EngineConfig.build(network={"bind": "0.0.0.0"})
    with pytest.raises(ConfigError, match="key_file"):
        EngineConfig.build(network={"tls": {"cert_file": certs["verifier"][0]}})
    missing = TLSConfig(cert_file=certs["verifier"][0], key_file=str(tmp_path / "nope.key"))
    with pytest.raises(ConfigError, match=r"network\.tls\.key_file: cannot read"):
        server_credentials(missing)


# ---- through Ray: the secret is made once per cluster and reaches routers of both runtimes ------


@pytest.fixture(scope="module")
def ray_local():
    init_local_ray(num_cpus=8)
    yield
    ray.shutdown()


def test_one_secret_per_cluster(ray_local):
    secret = cluster_secret()
    assert len(secret) >= 32 and cluster_secret() == secret
    assert ray.get(ray.remote(cluster_secret).remote()) == secret  # another process reads the same


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_standalone_router_carries_the_secret(ray_local, tls, certs, prompt_ids, references):
    network = _tls(certs) if tls else NetworkConfig()
    engine = EngineConfig(dtype="float32", proposer="ngram", num_speculative_tokens=4, network=network)
    cluster = TandemCluster(ClusterConfig(engine=engine, pipeline_depth=2))
    try:
        replica = cluster.router.replicas[0]
        host, port = replica.address.rsplit(":", 1)
        assert (replica.endpoint.root_certificates is not None) == tls
        # one machine: the verifier binds loopback only
        rank0 = cluster.replicas[0].ranks[0]
        assert host == LOOPBACK and listening_hosts(ray.get(rank0.pid.remote()), int(port)) == {LOOPBACK}
        for ids in prompt_ids:
            assert cluster.generate(ids, SamplingParams(max_tokens=MAX_TOKENS)).token_ids == references[tuple(ids)]
        with grpc.insecure_channel(replica.address) as channel:  # a caller without the secret
            assert status_code(lambda: rpc.VerifierStub(channel).Health(pb.HealthRequest(), timeout=10)) == \
                (UNAVAILABLE if tls else UNAUTHENTICATED)
    finally:
        cluster.shutdown()


def test_serve_lease_carries_a_tls_endpoint(ray_local, certs, model_dir, tokenizer, prompt_ids, references):
    from ray import serve
    from transformers import AutoConfig

    from deployments.leases import ServeVerifierPool
    from deployments.pools import VerifierPool

    engine = EngineConfig(dtype="float32", proposer="none", network=_tls(certs)).model_dump(mode="json")
    serve.start(proxy_location="Disabled")
    try:
        handle = serve.run(serve.deployment(VerifierPool).options(ray_actor_options={"num_cpus": 1})
                           .bind(engine, 1, {}), name="auth-test", route_prefix=None)
        pool = ServeVerifierPool(handle)
        lease = pool.acquire("probe")
        endpoint = lease.replica.endpoint
        lease.release()
        assert endpoint.root_certificates == Path(certs["verifier"][0]).read_bytes()
        assert "Bearer" not in repr(endpoint) and cluster_secret() not in repr(endpoint)
        tls_only = grpc.ssl_channel_credentials(endpoint.root_certificates)  # TLS, but no secret
        with grpc.secure_channel(endpoint.address, tls_only) as channel:
            assert status_code(lambda: rpc.VerifierStub(channel).Health(pb.HealthRequest(), timeout=10)) == \
                UNAUTHENTICATED
        eos = AutoConfig.from_pretrained(model_dir).eos_token_id
        router = Router(pool, None, tokenizer, [eos], num_speculative_tokens=0, pipeline_depth=1)
        for ids in prompt_ids:
            assert router.generate(ids, SamplingParams(max_tokens=MAX_TOKENS)).token_ids == references[tuple(ids)]
    finally:
        serve.shutdown()


def test_unreadable_certificates_fail_the_start(ray_local, certs, tmp_path):
    network = NetworkConfig(tls=TLSConfig(cert_file=certs["verifier"][0], key_file=str(tmp_path / "missing.key")))
    engine = EngineConfig(dtype="float32", proposer="none", network=network)
    with pytest.raises(ray.exceptions.RayActorError, match=r"network\.tls\.key_file: cannot read"):
        TandemCluster(ClusterConfig(engine=engine, placement_timeout_s=30))
