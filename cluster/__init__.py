"""tandem's distributed runtime.

On one machine everything stays on loopback: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is
imported, so it is set here, before any module imports ray (set it to 1 yourself to join a real
multi-node cluster). The model hub is never contacted.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
