"""The multi-node configs (KubeRay RayService, cluster launcher) agree with ray_config.yaml and with
their own worker groups: same application, only placements and scaling differ, and every placement
the Serve config asks for exists on some node type, with room for the autoscaling bounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from deployments.serving import DEFAULT_CONFIG, load_config

ROOT = Path(__file__).resolve().parent.parent
RAYSERVICE = ROOT / "cluster" / "kuberay" / "rayservice.yaml"
LAUNCHER = ROOT / "cluster" / "launcher" / "tandem-cluster.yaml"
LAUNCHER_SERVE = ROOT / "cluster" / "launcher" / "serve.yaml"
CLUSTER_ONLY = {"placement", "autoscaling", "num_replicas", "tensor_parallel_size", "max_ongoing_requests",
                "max_queued_requests"}  # what a cluster changes


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in CLUSTER_ONLY}
    return value


def _kuberay_serve(tmp_path):
    serve = yaml.safe_load(yaml.safe_load(RAYSERVICE.read_text())["spec"]["serveConfigV2"])
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(serve))
    return serve, load_config(path)


def test_same_application_as_ray_config(tmp_path):
    local_raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cluster_raw, cluster = _kuberay_serve(tmp_path)
    assert cluster_raw == yaml.safe_load(LAUNCHER_SERVE.read_text()), "launcher serve.yaml drifted from KubeRay's"
    assert cluster_raw["grpc_options"]["grpc_servicer_functions"] == local_raw["grpc_options"]["grpc_servicer_functions"]
    (local_app,), (cluster_app,) = local_raw["applications"], cluster_raw["applications"]
    for key in ("name", "route_prefix", "import_path"):
        assert local_app[key] == cluster_app[key]
    assert _strip(local_app["args"]) == _strip(cluster_app["args"])
    local = load_config(DEFAULT_CONFIG).app_configs["tandem"]
    remote = cluster.app_configs["tandem"]
    # the same models and speculation; the cluster scales out
    assert local.engine == remote.engine and local.speculation == remote.speculation
    assert remote.verifier.autoscaling.max_replicas > 1 and remote.drafter.autoscaling.max_replicas > 1


def _group_resources(group: dict) -> dict[str, float]:
    params = group["rayStartParams"].get("resources", '"{}"')
    resources = json.loads(json.loads(params))
    gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", "0")
    return {**resources, "GPU": float(gpus)}


def _fits(placement, node: dict[str, float], count: int = 1) -> int:
    """How many groups of `count` actors with `placement` fit on one node."""
    need = {"GPU": placement.num_gpus, **placement.resources}
    if placement.accelerator_type:
        need[f"accelerator_type:{placement.accelerator_type}"] = 0.001
    fits = [node.get(key, 0) // (amount * count) for key, amount in need.items() if amount > 0]
    return int(min(fits)) if fits else 0


def test_kuberay_worker_groups_fit_the_placements(tmp_path):
    spec = yaml.safe_load(RAYSERVICE.read_text())["spec"]
    _, cluster = _kuberay_serve(tmp_path)
    app = cluster.app_configs["tandem"]
    groups = {g["groupName"]: g for g in spec["rayClusterConfig"]["workerGroupSpecs"]}
    draft, target = _group_resources(groups["draft-nodes"]), _group_resources(groups["target-nodes"])
    tp = app.tensor_parallel_size
    per_target_node = _fits(app.verifier.placement, target, tp)
    assert per_target_node >= 1, "a verifier replica (tensor_parallel_size ranks, STRICT_PACK) must fit one target node"
    assert _fits(app.verifier.placement, draft, tp) == 0, "verifier replicas must not land on draft nodes"
    per_draft_node = _fits(app.drafter.placement, draft)
    assert per_draft_node >= 1 and _fits(app.drafter.placement, target) == 0
    assert groups["target-nodes"]["maxReplicas"] * per_target_node >= app.verifier.autoscaling.max_replicas
    assert groups["draft-nodes"]["maxReplicas"] * per_draft_node >= app.drafter.autoscaling.max_replicas
    assert spec["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_launcher_node_types_fit_the_placements(tmp_path):
    launcher = yaml.safe_load(LAUNCHER.read_text())
    _, cluster = _kuberay_serve(tmp_path)
    app = cluster.app_configs["tandem"]
    types = launcher["available_node_types"]
    target, draft = types["target_node"], types["draft_node"]
    per_target_node = _fits(app.verifier.placement, target["resources"], app.tensor_parallel_size)
    per_draft_node = _fits(app.drafter.placement, draft["resources"])
    assert per_target_node >= 1 and per_draft_node >= 1
    assert target["max_workers"] * per_target_node >= app.verifier.autoscaling.max_replicas
    assert draft["max_workers"] * per_draft_node >= app.drafter.autoscaling.max_replicas
    assert launcher["max_workers"] >= target["max_workers"] + draft["max_workers"]


def test_auto_backend_is_chosen_deterministically_and_logged(monkeypatch, caplog):
    """engine.backend 'auto': vLLM when it is installed and can serve the config (not a feature-fed
    draft), else the torch runner; the choice and its reason are logged."""
    import importlib.util
    import logging

    from deployments.config import TandemAppConfig

    real_find_spec = importlib.util.find_spec
    for installed in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (real_find_spec("yaml") if installed else None) if name == "vllm"
                            else real_find_spec(name, *a))
        with caplog.at_level(logging.INFO, logger="deployments.config"):
            caplog.clear()
            config = TandemAppConfig.build({"engine": {"backend": "auto", "proposer": "ngram"}})
        assert config.engine.backend == ("vllm" if installed else "torch")
        assert f"engine.backend auto: {config.engine.backend}" in caplog.text
        assert TandemAppConfig.build({"engine": {"backend": "auto", "proposer": "ngram"}}) == config  # deterministic
        feature = TandemAppConfig.build({"engine": {"backend": "auto", "draft": "feature"}})
        assert feature.engine.backend == "torch"  # vLLM cannot feed a feature draft
        with caplog.at_level(logging.INFO, logger="deployments.config"):
            caplog.clear()
            auto = TandemAppConfig.build({"engine": {"backend": "auto", "proposer": "auto"}})
        # the proposer follows the engine: vLLM's EAGLE-3 method with tandem's matches on the shipped draft on vLLM,
        # the hybrid on the torch runner
        assert auto.engine.proposer == ("eagle3" if installed else "hybrid")
        if installed:
            assert auto.engine.draft == "eagle3" and auto.engine.eagle3_matches
        assert f"engine.proposer auto: {auto.engine.proposer}" in caplog.text
    assert TandemAppConfig.build({"engine": {"backend": "torch"}}).engine.backend == "torch"  # explicit stays


def test_every_node_runs_serve_as_a_local_start_does():
    """Serve's settings (`SERVE_THROUGHPUT_ENV`: its throughput mode) and grpcio's fork switch (`GRPC_FORK_ENV`)
    are read by each process when it imports Serve, so each node must carry them: every KubeRay container and
    every launcher `ray start`."""
    from cluster import GRPC_FORK_ENV
    from cluster.ray.runtime import SERVE_THROUGHPUT_ENV as SERVE_ENV

    SERVE_THROUGHPUT_ENV = {**SERVE_ENV, **GRPC_FORK_ENV}

    spec = yaml.safe_load(RAYSERVICE.read_text())["spec"]["rayClusterConfig"]
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    containers = [c for t in templates for c in t["spec"]["containers"]]
    assert len(containers) == 1 + len(spec["workerGroupSpecs"])
    for container in containers:
        env = {e["name"]: e["value"] for e in container["env"]}
        assert {k: env.get(k) for k in SERVE_THROUGHPUT_ENV} == SERVE_THROUGHPUT_ENV, container["name"]
    launcher = yaml.safe_load(LAUNCHER.read_text())
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in launcher[key]
              if "ray start" in c]
    assert len(starts) == 2
    for command in starts:
        assert all(f"{k}={v} " in command for k, v in SERVE_THROUGHPUT_ENV.items()), command


def test_an_operators_serve_setting_is_kept(monkeypatch):
    from cluster.ray.runtime import SERVE_THROUGHPUT_ENV, serve_environment

    for key in SERVE_THROUGHPUT_ENV:
        monkeypatch.delenv(key, raising=False)
    assert serve_environment() == SERVE_THROUGHPUT_ENV
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")
    assert serve_environment() == {**SERVE_THROUGHPUT_ENV, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}


# A process with busy gRPC channels (a client thread calling a server of its own) starts children through fork +
# exec with a `preexec_fn`, as Ray starts its raylet; it prints its grpcio fork-handler flag and how many children
# failed to run `true`. `{first}` is imported first.
FORKING = textwrap.dedent("""
    import {first}, {second}
    import subprocess, threading
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{{port}}"))
    done = threading.Event()
    def busy():
        while not done.is_set():
            stub.Check(health_pb2.HealthCheckRequest())
    thread = threading.Thread(target=busy)
    thread.start()
    failed = sum(subprocess.Popen(["true"], preexec_fn=lambda: None, stderr=subprocess.DEVNULL).wait() != 0
                 for _ in range(200))
    done.set()
    thread.join()
    server.stop(None)
    print(cluster.GRPC_FORK_HANDLERS_ON, failed)
""")


def _forking(first: str, second: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", FORKING.format(first=first, second=second)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return out[0], int(out[1])


def test_children_started_beside_busy_grpc_channels_all_run():
    """`cluster.GRPC_FORK_ENV`: with grpcio imported after `cluster` (as in every tandem process), every child
    started through fork + exec runs. A CI run lost a test module's Ray to grpcio's fork handlers (grpc/grpc#43055:
    the raylet died between its fork and its exec; here 38 of 300 such children, measured, with them on)."""
    assert _forking("cluster", "grpc") == ("False", 0)
    # grpcio imported first runs its handlers: the flag `init_local_ray` warns on
    assert _forking("grpc", "cluster")[0] == "True"


def test_a_failed_ray_start_says_what_its_session_logs_show(tmp_path, monkeypatch, caplog):
    """`init_local_ray` logs, with Ray's error, what the newest Ray session of this process wrote: here a GCS
    log and no raylet log (as in the two lost starts), while another process's newer session is left out."""
    import logging

    import ray

    from cluster.ray import runtime, startup

    ours = tmp_path / f"session_2026-12-06_08-50-08_737980_{os.getpid()}" / "logs"
    (tmp_path / f"session_2026-12-06_08-41-00_689028_{os.getpid()}" / "logs").mkdir(parents=True)  # an earlier one
    other = tmp_path / "session_2026-12-06_08-50-09_000000_1" / "logs"
    for logs in (ours, other):
        logs.mkdir(parents=True)
        (logs / "gcs_server.out").write_text("GcsServer server started\n")
    (other / "raylet.out").write_text("Setting cluster ID\n")
    report = startup.startup_report(str(tmp_path))
    assert ours.parent.name in report and other.parent.name not in report
    assert "gcs_server.out: written" in report and "raylet.out: none" in report
    assert "the raylet wrote no log" in report
    (ours / "raylet.err").write_text("".join(f"line {i}\n" for i in range(30)))
    report = startup.startup_report(str(tmp_path))
    assert "line 29" in report and "line 10" in report and "line 9\n" not in report  # its last 20 lines
    assert "no Ray session of this process" in startup.startup_report(str(tmp_path / "none"))

    def init(**kwargs):
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(runtime, "startup_report", lambda: report)
    with caplog.at_level(logging.ERROR, logger=runtime.__name__), pytest.raises(Exception, match="timed out"):
        runtime.init_local_ray()
    assert "Ray did not start on this machine: The current node timed out" in caplog.text
    assert report in caplog.text
