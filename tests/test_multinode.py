"""Two Ray nodes on one machine: a head on 127.0.0.1 (the driver, hence the router) and a second node
process on 127.0.0.2 with a custom resource that only it has, so the verifier replica lands there.
The verifier binds and advertises its node's address (not 127.0.0.1), serves over TLS with a
configured certificate, and the router reaches it across nodes with the target's exact output."""

from __future__ import annotations

import os
import shutil
import tempfile

import grpc
import pytest
import ray

from cluster.core.config import EngineConfig, NetworkConfig, PlacementConfig, TLSConfig
from cluster.core.sampling import SamplingParams
from cluster.ray.runtime import LOOPBACK_ONLY_ENV, ClusterConfig, TandemCluster, environment
from cluster.wire.transport import bind_host
from protos import pb, rpc
from tests.net_helpers import listening_hosts, self_signed, status_code

MAX_TOKENS = 24
PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("Once upon a time, in a small village by the sea,", False),
    ("What is the capital of France?", True),
]
HEAD, SECOND = "127.0.0.1", "127.0.0.2"  # both loopback on Linux
SERVER_NAME = "verifier.tandem.internal"  # the certificate names no IP: routers check this name


@pytest.fixture(scope="module")
def two_nodes():
    """A head and a second node, in their own Ray temp dir (other Ray instances on this machine stay unseen)."""
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="tmn", dir="/tmp")  # short: Ray's socket paths must fit
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    os.environ.update(RAY_TMPDIR=temp, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    # the nodes' processes get what init_local_ray gives its own: no probe of cloud metadata services
    # (tests/test_loopback.py watches the whole machine, this module's nodes included)
    with environment(LOOPBACK_ONLY_ENV):
        cluster = Cluster(initialize_head=True, head_node_args={"node_ip_address": HEAD, "num_cpus": 8,
                                                                "include_dashboard": False})
    try:
        with environment(LOOPBACK_ONLY_ENV):
            second = cluster.add_node(node_ip_address=SECOND, num_cpus=4, resources={"verifier_node": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield second
    finally:
        ray.shutdown()
        cluster.shutdown()  # stops exactly the processes of these two nodes
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        shutil.rmtree(temp, ignore_errors=True)


def test_bind_address_follows_the_node(two_nodes):
    @ray.remote(num_cpus=0, resources={"verifier_node": 0.01})
    def on_second_node(network: NetworkConfig) -> str:
        return bind_host(network)

    assert ray.get(on_second_node.remote(NetworkConfig())) == SECOND
    assert ray.get(on_second_node.remote(NetworkConfig(bind="loopback"))) == HEAD
    assert bind_host(NetworkConfig()) == HEAD  # the driver is on the head


def test_router_reaches_a_verifier_on_another_node(two_nodes, tmp_path, prompt_ids, references):
    assert sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]) == [HEAD, SECOND]
    cert_file, key_file = self_signed(tmp_path, ips=(), dns=(SERVER_NAME,))
    network = NetworkConfig(tls=TLSConfig(cert_file=cert_file, key_file=key_file, server_name=SERVER_NAME))
    engine = EngineConfig(dtype="float32", proposer="draft", num_speculative_tokens=4, network=network)
    cluster = TandemCluster(ClusterConfig(engine=engine, pipeline_depth=2,
                                          verifier_rank=PlacementConfig(resources={"verifier_node": 1})))
    try:
        rank0 = cluster.replicas[0].ranks[0]
        assert ray.get(rank0.node_id.remote()) == two_nodes.node_id  # the verifier runs on the second node
        replica = cluster.router.replicas[0]
        host, port = replica.address.rsplit(":", 1)
        assert host == SECOND  # ... and advertises that node's address, which the router dials
        assert listening_hosts(ray.get(rank0.pid.remote()), int(port)) == {SECOND}  # bound there only

        for ids in prompt_ids:
            result = cluster.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
            assert result.token_ids == references[tuple(ids)], f"diverged on {ids[:6]}..."
        assert cluster.router.metrics.rounds > 0 and cluster.router.metrics.replays == 0

        # nothing answers on the head's loopback at that port; on the node's address, TLS is required
        with grpc.insecure_channel(f"{HEAD}:{port}") as channel:
            assert status_code(lambda: rpc.VerifierStub(channel).Health(pb.HealthRequest(), timeout=5)) == \
                grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(replica.address) as channel:
            assert status_code(lambda: rpc.VerifierStub(channel).Health(pb.HealthRequest(), timeout=5)) == \
                grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.shutdown()
