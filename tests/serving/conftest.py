"""One Serve application for the package's modules (test_serving, test_vllm_fields, test_fuzz, then test_failover):
started once, stopped after the package's last test (a package-scoped fixture), one application start and stop fewer
than a module each (~40 CPU-seconds on 2 cores)."""

from __future__ import annotations

import pytest
import yaml

from deployments.serving import DEFAULT_CONFIG
from tests.helpers import serve_app
from tests.serving import API_KEY, HEALTH_CHECK_PERIOD_S, MAX_RESUMES


@pytest.fixture(scope="package")
def server():
    # γ pinned (the policy has its own tests): under load the adaptive policy may rightly choose plain decoding for
    # a whole short request, and test_serving asserts that speculation figures travel. Each part checked each
    # HEALTH_CHECK_PERIOD_S and a stream resumed MAX_RESUMES times at most: test_failover's kills
    args = yaml.safe_load(DEFAULT_CONFIG.read_text())["applications"][0]["args"]
    checks = {part: {**args[part], "health_check_period_s": HEALTH_CHECK_PERIOD_S}
              for part in ("ingress", "router", "drafter", "verifier")}
    with serve_app(engine={"dtype": "float32", "proposer": "draft", "num_speculative_tokens": 3, "threads": 1},
                   api_keys=[API_KEY], speculation={"adaptive": False},
                   failover={"max_resumes": MAX_RESUMES, "resume_delay_s": 0.2}, **checks) as endpoints:
        yield endpoints
