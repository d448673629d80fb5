"""tandem's distributed runtime.

On one machine everything stays on loopback: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is
imported, so it is set here, before any module imports ray (set it to 1 yourself to join a real
multi-node cluster). The model hub is never contacted, and neither Ray nor vLLM reports usage
(`TELEMETRY_OFF`: vLLM posts usage statistics to its server by default, Ray's usage module asks cloud
metadata services; `cluster.ray.runtime.init_local_ray` also fences off what Ray's dashboard asks
regardless).
"""

import os

# what every process tandem starts (Ray's, vLLM's servers the benchmarks start) is given
TELEMETRY_OFF = {"RAY_USAGE_STATS_ENABLED": "0", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
                 "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
for _name, _value in TELEMETRY_OFF.items():
    os.environ.setdefault(_name, _value)
