"""Start the distributed runtime on Ray: a drafter actor, a pool of verifier replicas, a router.

Each verifier replica is one placement group of `tensor_parallel_size` bundles (STRICT_PACK), one
actor per rank; rank 0 serves the `Verifier` gRPC service on its node's address and reports its
endpoint (`cluster.wire.transport`: address, TLS root, never the secret). On one machine everything
binds loopback only: `init_local_ray` starts Ray on 127.0.0.1, so that is every node's address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid

import ray
from pydantic import ConfigDict, Field, ValidationError, model_validator
from ray._private import ray_constants
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import cluster
from cluster import GRPC_FORK_ENV, TELEMETRY_OFF
from cluster.core.config import EngineConfig, PlacementConfig, check_tp_placement
from cluster.core.errors import ConfigError, validation_message
from cluster.model import models
from cluster.model.gemm import fast_linears
from cluster.model.runner import TorchModelRunner
from cluster.model.tensor_parallel import TPLeaderRunner, follow, load_tp_model
from cluster.model.verifier import VerifierEngine
from cluster.ray.drafter import launch_drafter
from cluster.ray.router import Router
from cluster.ray.startup import startup_report
from cluster.session.loop import LoopConfig
from cluster.wire.transport import LOOPBACK, Endpoint, advertised_endpoint, bind_host, server_credentials
from cluster.wire.verifier_pool import VerifierReplicaHandle
from cluster.wire.verifier_server import serve
from drafts.routing import target_feature_layers

log = logging.getLogger(__name__)


class ClusterConfig(LoopConfig):
    """The distributed runtime: one drafter, `num_verifier_replicas` TP groups, a router
    (scheduling fields from `LoopConfig`, shared with the Serve application's config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Models, proposer, γ, dtype, threads per actor.")
    num_verifier_replicas: int = Field(1, ge=1, le=64, description="Verifier replicas in the pool.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Target ranks per verifier replica.")
    drafter: PlacementConfig = Field(default_factory=PlacementConfig, description="Where the drafter runs (a cheap GPU).")
    verifier_rank: PlacementConfig = Field(default_factory=PlacementConfig, description="Where each verifier rank runs (a large GPU).")
    placement_timeout_s: float = Field(60.0, gt=0, description="How long to wait for resources before failing.")
    max_verifier_restarts: int = Field(-1, ge=-1, description="Ray restarts of a verifier replica (-1: unlimited).")

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        if self.engine.backend != "torch":
            raise ValueError(f"engine.backend={self.engine.backend!r}: the Ray runtime's verifiers run 'torch' "
                             "(`tandem generate --engine vllm --distributed` runs vLLM with the drafter actor)")
        check_tp_placement(self.tensor_parallel_size, self.engine, self.verifier_rank, "verifier_rank")
        return self

    @classmethod
    def build(cls, **kwargs) -> "ClusterConfig":
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise ConfigError(validation_message(e)) from None


def init_local_ray(num_cpus: int | None = None, num_gpus: int | None = None,
                   resources: dict[str, float] | None = None) -> None:
    """A Ray head on this machine, loopback only. `num_gpus` may fake GPUs for placement tests."""
    if ray.is_initialized():
        return
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # Ray read that variable when it was imported; a process that imported ray before `cluster` would
    # otherwise put the node on the machine's own address (Ray resolves 127.0.0.1 to it)
    ray_constants.ENABLE_RAY_CLUSTER = False
    if cluster.GRPC_FORK_HANDLERS_ON:
        log.warning("grpcio runs its fork handlers in this process (imported before `cluster`, or "
                    "GRPC_ENABLE_FORK_SUPPORT set on): a Ray process started here may die before it starts "
                    "(grpc/grpc#43055; see cluster/__init__.py)")
    # CPUs are logical here: actors are mostly waiting, and each pins its own torch threads.
    env = {**LOOPBACK_ONLY_ENV, **serve_environment(local=True), **local_ray_environment(),
           **_environment_kept(GRPC_FORK_ENV)}  # Ray's workers import grpcio (Serve's) before any module of ours
    with environment(env):  # what Ray's processes (started here) inherit
        try:
            ray.init(num_cpus=num_cpus or max(16, os.cpu_count() or 1), num_gpus=num_gpus, resources=resources,
                     include_dashboard=False, _node_ip_address=LOOPBACK, log_to_driver=True,
                     runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", **env}})
        except Exception as e:
            log.error("Ray did not start on this machine: %s\n%s", e, startup_report())
            raise


# Ray Serve's throughput-optimized mode (`RAY_SERVE_THROUGHPUT_OPTIMIZED`, Serve's own documented setting, read
# when each process imports Serve): handles and proxy reach replicas over gRPC instead of Ray actor calls and the
# object store, user code on the replica's own event loop (no hop between threads per streamed chunk),
# request-path logs buffered, the garbage collector frozen after start-up. Measured through
# `tandem serve` at one stream, side by side: 26-27 ms a token against 33 without it (vLLM alone 20);
# BENCHMARKS.md, "Serve's throughput mode". Three of its parts are left as they were: direct ingress (each
# ingress replica binds ports of its own, past the proxy: on one machine only, `LOCAL_SERVE_ENV`), replica logs on
# stderr (errors stay visible in the console; measured no slower) and the handles' router in a loop of its own
# (the torch router's sessions lease from the pools in worker threads, outside any event loop, which a handle
# routed on the replica's loop refuses). Serve's controller loop runs each 1 s, not 0.1 s
# (`RAY_SERVE_CONTROL_LOOP_INTERVAL_S`): its idle CPU 3.1% -> 0.8% of a core, 3-5% faster through `tandem serve`
# at 1 and 16 streams than the 0.1 s loop (with it, against vLLM alone: BENCHMARKS.md, "On an Intel Xeon with
# AMX"); it reacts to a dead replica up to 1 s later.
# A value already in the environment is kept
# (`RAY_SERVE_THROUGHPUT_OPTIMIZED=0 tandem serve`: Serve as it was).
SERVE_THROUGHPUT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
                        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_LOG_TO_STDERR": "1",
                        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1"}


# On one machine Serve's direct ingress is on as well: each ingress replica (the vLLM verifier replica that serves
# the API itself, `vllm.direct_ingress`; the torch path's `Ingress`) also answers HTTP on a port of its own
# (Serve's range, from 30000, on the configured host, 127.0.0.1), past the proxy. The proxy's port works as
# before for every replica. A client of one replica that calls the replica's own port saves the proxy's hop:
# 2.2 ms of CPU a token in all at one stream (0.75 in the proxy and replica), 4-5% more tokens/s at 1 and 16
# streams here, the same server read both ways (BENCHMARKS.md, "Serve's direct ingress"). `tandem serve` prints
# those addresses (`deployments.serving.direct_urls`). No external load balancer has to deregister a stopping
# replica here, so it drains without Serve's 30 s minimum. Clusters keep it off (the manifests): there an
# operator fronts the replicas with Serve's proxy or HAProxy.
LOCAL_SERVE_ENV = {**SERVE_THROUGHPUT_ENV, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                   "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


# A Ray on this machine alone starts no idle workers ahead of need. Ray's raylet prestarts Python workers for the
# first driver (`RAY_prestart_worker_first_driver`, `RAY_enable_worker_prestart`); with the logical CPUs tandem
# declares they wait as `ray::IDLE` processes for the server's life, each polling about 0.6% of a core on a machine
# whose two cores run vLLM's OpenMP threads (BENCHMARKS.md, "The plain path's last 10%"). An actor then starts
# its worker when it is created, as it does once the prestarted ones are used. A value already in the environment is kept.
LOCAL_RAY_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}


def _environment_kept(defaults: dict[str, str]) -> dict[str, str]:
    """`defaults`, with any of its variables already set in this process's environment kept (the operator's)."""
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def local_ray_environment() -> dict[str, str]:
    return _environment_kept(LOCAL_RAY_ENV)


def serve_environment(local: bool = False) -> dict[str, str]:
    """`SERVE_THROUGHPUT_ENV` (`LOCAL_SERVE_ENV` for a Ray on this machine alone), with any of its variables
    already set in this process's environment kept."""
    return _environment_kept(LOCAL_SERVE_ENV if local else SERVE_THROUGHPUT_ENV)


# A single-machine Ray's processes reach nothing but loopback. Ray's dashboard asks the cloud metadata
# services (169.254.169.254, metadata.google.internal) which cloud it runs on whatever the usage-stats
# setting says (`ray._common.usage.usage_lib.get_cluster_config_to_report`); Python's HTTP clients
# (requests, urllib, httpx, aiohttp) send anything not on loopback to this proxy instead, a port on
# loopback where nothing listens, so the attempt fails at once on this machine. gRPC reads only the
# lower-case variables, so Ray's and tandem's own gRPC are untouched. tests/test_loopback.py watches it.
REFUSING_PROXY = "http://127.0.0.1:9"
LOOPBACK_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **TELEMETRY_OFF,
                     "HTTP_PROXY": REFUSING_PROXY, "HTTPS_PROXY": REFUSING_PROXY,
                     "NO_PROXY": "localhost,127.0.0.1,::1"}


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """`values` set in os.environ for the block (what processes started in it inherit), then restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_tensor_parallel(tensor_parallel_size: int, kv_heads: int) -> None:
    """transformers' TP plan does not check this at load: refuse it here."""
    if kv_heads % tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} must divide the target's "
                          f"num_key_value_heads={kv_heads}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class VerifierRank:
    """One rank of a verifier replica (the Ray actor body). Rank 0 serves gRPC."""

    def __init__(self, engine_config: dict, replica: str, rank: int = 0, world_size: int = 1,
                 master_port: int = 0):
        import torch

        config = EngineConfig(**engine_config)
        if rank == 0 and config.network.tls is not None:  # unreadable certificates fail before the model loads
            server_credentials(config.network.tls)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.replica, self.rank, self.world_size = replica, rank, world_size
        path = models.resolve_model_path(config.target, config.cache_dir)
        if world_size > 1:
            model = load_tp_model(path, config.dtype, rank, world_size, master_port)
        else:
            model = models.load_causal_lm(path, config.dtype, config.device)
            fast_linears(model, f"{replica}/rank{rank}", onednn=config.onednn, gemm=config.fp32_gemm)
        if config.cuda_graphs and world_size > 1:
            log.warning("cuda_graphs ignored with tensor parallelism (the ranks' collectives are not captured)")
        runner = TorchModelRunner(model, name=f"{replica}/rank{rank}",
                                  cuda_graphs=config.cuda_graphs if world_size == 1 else 0,
                                  feature_layers=target_feature_layers(config),
                                  prompt_cache_tokens=config.prompt_cache_tokens)
        self.port, self._endpoint = None, None
        if world_size > 1:
            if rank != 0:
                threading.Thread(target=follow, args=(runner,), daemon=True, name="tp-follower").start()
                return
            runner = TPLeaderRunner(runner)
        self.engine = VerifierEngine(runner)
        host = bind_host(config.network)
        self.server, self.port = serve(self.engine, replica, host, 0, world_size, network=config.network)
        self._endpoint = advertised_endpoint(replica, host, self.port, config.network)

    def endpoint(self) -> Endpoint | None:
        """Where and how routers reach this replica (rank 0 only)."""
        return self._endpoint

    def broken(self) -> str | None:
        """Why this rank's tensor-parallel group cannot serve any more (None while it can)."""
        engine = getattr(self, "engine", None)
        return getattr(engine.runner, "broken", None) if engine is not None else None

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class VerifierReplica:
    """A placement group with one actor per rank.

    TP = 1: Ray restarts the one rank in place. TP > 1: the ranks share a torch.distributed group that
    cannot take a restarted member back, so when a rank dies (or rank 0's collectives fail) `resolve`
    rebuilds the whole group: new placement group, new actors, new rendezvous port.
    """

    def __init__(self, name: str, config: ClusterConfig):
        self.name, self.config = name, config
        self.restarts = 0
        self._closed = False
        self._lock = threading.Lock()
        self._spawn()

    def _spawn(self) -> None:
        config = self.config
        tp = config.tensor_parallel_size
        self.placement_group = placement_group([config.verifier_rank.bundle() for _ in range(tp)],
                                               strategy="STRICT_PACK", name=f"tandem-{self.name}")
        port = free_port() if tp > 1 else 0
        actor_cls = ray.remote(VerifierRank)
        self.ranks = []
        for rank in range(tp):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
            self.ranks.append(actor_cls.options(
                num_cpus=config.verifier_rank.num_cpus, num_gpus=config.verifier_rank.num_gpus,
                resources=config.verifier_rank.resources or None, scheduling_strategy=strategy,
                max_restarts=config.max_verifier_restarts if tp == 1 else 0, max_task_retries=0,
                name=f"tandem-{self.name}-rank{rank}" + (f"-r{self.restarts}" if self.restarts else ""),
            ).remote(config.engine.model_dump(), self.name, rank, tp, port))

    def _group_lost(self, timeout_s: float) -> str | None:
        """Why a TP group must be rebuilt: a rank that does not answer, or rank 0's broken collectives."""
        try:
            ray.get([rank.pid.remote() for rank in self.ranks], timeout=timeout_s)
            return ray.get(self.ranks[0].broken.remote(), timeout=timeout_s)
        except Exception as e:  # dead, unreachable or not answering: either way the group cannot serve
            return f"a rank is lost ({type(e).__name__}: {str(e)[:200]})"

    def restart(self) -> None:
        """Replace every rank (a TP group that lost one)."""
        self._kill()
        self.restarts += 1
        self._spawn()
        if self._closed:  # shut down while rebuilding
            self._kill()
            raise RuntimeError(f"verifier replica {self.name} was shut down")
        try:
            ray.get(self.placement_group.ready(), timeout=self.config.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"verifier replica {self.name}: cannot place the rebuilt group in "
                              f"{self.config.placement_timeout_s:.0f}s") from None

    def resolve(self, timeout_s: float = 300.0) -> Endpoint:
        """Rank 0's gRPC endpoint, waiting while Ray (re)starts it, rebuilding a TP group that lost a rank."""
        deadline = time.time() + timeout_s
        with self._lock:  # one rebuild at a time, however many sessions noticed the failure
            if self._closed:
                raise RuntimeError(f"verifier replica {self.name} was shut down")
            if len(self.ranks) > 1:
                lost = self._group_lost(max(1.0, deadline - time.time()))
                if lost:
                    log.error("verifier replica %s: %s; rebuilding its %d ranks (rebuild %d)", self.name, lost,
                              len(self.ranks), self.restarts + 1)
                    self.restart()
            while True:
                try:
                    endpoint = ray.get(self.ranks[0].endpoint.remote(), timeout=max(1.0, deadline - time.time()))
                    break
                except ray.exceptions.ActorUnavailableError:  # restarting
                    if time.time() > deadline:
                        raise
                    time.sleep(0.25)
        if endpoint is None:
            raise RuntimeError(f"verifier replica {self.name} has no endpoint")
        return endpoint

    def _kill(self) -> None:
        for actor in self.ranks:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass  # already gone
        remove_placement_group(self.placement_group)

    def kill(self) -> None:
        self._closed = True  # no rebuild after this, whoever asks
        self._kill()


class TandemCluster:
    """The whole runtime on the current Ray cluster (started on loopback when none is running)."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        init_local_ray()
        path = models.resolve_model_path(config.engine.target, config.engine.cache_dir)  # prepare once, here
        from transformers import AutoConfig

        tokenizer = models.load_tokenizer(path)
        model_config = AutoConfig.from_pretrained(path)
        check_tensor_parallel(config.tensor_parallel_size, model_config.num_key_value_heads)
        self.id = uuid.uuid4().hex[:6]  # several clusters may share one Ray
        self.replicas = [VerifierReplica(f"{self.id}-verifier{i}", config) for i in range(config.num_verifier_replicas)]
        self.drafter = None
        if config.engine.proposer != "none" and config.engine.num_speculative_tokens > 0:
            self.drafter_pg = placement_group([config.drafter.bundle()], name=f"tandem-{self.id}-drafter")
            self._wait_placed([self.drafter_pg], "the drafter", config.drafter.bundle())
            self.drafter = launch_drafter(
                config.engine, name=f"tandem-{self.id}-drafter", num_cpus=config.drafter.num_cpus,
                num_gpus=config.drafter.num_gpus, resources=config.drafter.resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.drafter_pg, 0))
        self._wait_placed([r.placement_group for r in self.replicas], "the verifier pool",
                          config.verifier_rank.bundle(), config.tensor_parallel_size)
        if self.drafter is not None:
            ray.get(self.drafter.ready.remote(), timeout=300)
        try:
            handles = [VerifierReplicaHandle(r.name, r.resolve) for r in self.replicas]
        except Exception:  # e.g. a verifier that could not start (unreadable certificates)
            self.shutdown()
            raise
        self.router = Router.from_config(config, config.engine, handles, self.drafter, tokenizer, model_config)
        self.tokenizer = tokenizer

    def _wait_placed(self, groups, what: str, bundle: dict, count: int = 1) -> None:
        deadline = time.time() + self.config.placement_timeout_s
        for group in groups:
            try:
                ray.get(group.ready(), timeout=max(0.1, deadline - time.time()))
            except ray.exceptions.GetTimeoutError:
                self.shutdown()
                raise ConfigError(
                    f"cannot place {what}: {len(groups)} group(s) of {count} bundle(s) {bundle} did not fit "
                    f"in {self.config.placement_timeout_s:.0f}s; cluster has {ray.available_resources()}") from None

    def generate(self, prompt_ids, params, timeline=None):
        return self.router.generate(prompt_ids, params, timeline)

    def shutdown(self) -> None:
        for replica in getattr(self, "replicas", []):
            try:
                replica.kill()
            except Exception:
                pass
        if getattr(self, "drafter", None) is not None:
            ray.kill(self.drafter, no_restart=True)
            remove_placement_group(self.drafter_pg)
