"""The Serve application's tests that share one application (tests/serving/conftest.py's `server`): the API surface
(test_serving, then test_vllm_fields) and the schema-driven fuzzing (test_fuzz) first, then failover
(test_failover), whose kills come last. `make test` runs the package on one worker as one unit (tests/conftest.py,
SHARED_PACKAGES)."""

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key"
METADATA = (("application", "tandem"), ("authorization", f"Bearer {API_KEY}"))  # gRPC: the app has api_keys
MAX_RESUMES = 1  # a stream is resumed once at most (test_failover's router dying on every attempt)
HEALTH_CHECK_PERIOD_S = 2.0  # Serve checks each replica every 2 s (its default is 10): a killed one is replaced sooner
