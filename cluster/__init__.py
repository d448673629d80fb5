"""tandem's distributed runtime.

On one machine everything stays on loopback: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is
imported, so it is set here, before any module imports ray (set it to 1 yourself to join a real
multi-node cluster). The model hub is never contacted, and neither Ray nor vLLM reports usage
(`TELEMETRY_OFF`: vLLM posts usage statistics to its server by default, Ray's usage module asks cloud
metadata services; `cluster.ray.runtime.init_local_ray` also fences off what Ray's dashboard asks
regardless).
"""

import os
import sys

# what every process tandem starts (Ray's, vLLM's servers the benchmarks start) is given
TELEMETRY_OFF = {"RAY_USAGE_STATS_ENABLED": "0", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
                 "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}

# gRPC's fork handlers off (grpcio's own switch, read once, when grpcio is imported: here, before any module
# imports it). Since grpcio 1.81 a process whose gRPC channels are busy starts a child through fork + exec
# (`subprocess.Popen` with a `preexec_fn`, as Ray starts its raylet, GCS and agents) with gRPC's poller thread
# restarted in the child, where Popen's closing of descriptors breaks it: the child dies before its exec
# (grpc/grpc#43055). Measured here (grpcio 1.85.1): 38 of 300 such children died with them on, 0 of 300 off. A
# CI run lost a test module's Ray that way (its raylet never started: "The current node timed out during
# startup"). Nothing tandem runs uses gRPC in a forked child that does not exec. A value already set is kept.
GRPC_FORK_ENV = {"GRPC_ENABLE_FORK_SUPPORT": "false"}
# whether this process's grpcio runs its fork handlers (`cluster.ray.runtime.init_local_ray` warns): the switch as
# set before this package, or, unset, whether grpcio was imported already (it then read no switch)
_GRPC_FORK_SWITCH = os.environ.get("GRPC_ENABLE_FORK_SUPPORT")
GRPC_FORK_HANDLERS_ON = ("grpc" in sys.modules if _GRPC_FORK_SWITCH is None
                         else _GRPC_FORK_SWITCH.lower() not in ("false", "0", "no"))

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
for _name, _value in {**TELEMETRY_OFF, **GRPC_FORK_ENV}.items():
    os.environ.setdefault(_name, _value)
