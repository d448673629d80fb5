"""Schema-driven fuzzing of the HTTP API: schemathesis reads the live /openapi.json of the package's Serve
application (tests/serving/conftest.py: no per-request deadline, so a slow generated case is not cut short) and sends
what it generates, valid (positive) and invalid (negative) requests, with the application's API key. No response may
be a 5xx, and every response must match the status codes, content types and bodies the document states. It runs
before test_failover's kills (tests/conftest.py, LONGEST_FIRST).

Bounded and deterministic: at most MAX_CASES (220) cases (derandomized Hypothesis, no example database)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.serving import API_KEY, MODEL

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_TOKENS = 4  # positive cases generate at most this many tokens, so that generation stays quick
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
LIMITS = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_tokens", "/v1/responses": "max_output_tokens",
          "/invocations": "max_tokens"}  # a generating body without a limit gets one (the app's default is 256)
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# (method, path, generation mode, cases): MAX_CASES at most; positive cases generate, so fewer of them
MAX_CASES = 220
OPERATIONS = [("POST", "/v1/completions", POSITIVE, 18), ("POST", "/v1/completions", NEGATIVE, 28),
              ("POST", "/v1/chat/completions", POSITIVE, 18), ("POST", "/v1/chat/completions", NEGATIVE, 28),
              ("POST", "/v1/responses", POSITIVE, 12), ("POST", "/v1/responses", NEGATIVE, 20),
              ("POST", "/v1/messages", POSITIVE, 10), ("POST", "/v1/messages", NEGATIVE, 16),
              ("POST", "/v1/messages/count_tokens", POSITIVE, 4), ("POST", "/v1/messages/count_tokens", NEGATIVE, 6),
              ("POST", "/invocations", POSITIVE, 6), ("POST", "/invocations", NEGATIVE, 10),
              ("POST", "/tokenize", POSITIVE, 8), ("POST", "/tokenize", NEGATIVE, 12),
              ("POST", "/detokenize", POSITIVE, 4), ("POST", "/detokenize", NEGATIVE, 6),
              ("GET", "/v1/models", POSITIVE, 3), ("GET", "/v1/models/{model}", POSITIVE, 3),
              ("GET", "/health", POSITIVE, 2), ("GET", "/ping", POSITIVE, 2), ("POST", "/ping", POSITIVE, 2),
              ("GET", "/version", POSITIVE, 2)]
assert sum(cases for *_, cases in OPERATIONS) <= MAX_CASES


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(server.http + "/openapi.json")


def _servable(case, vocab_size: int) -> None:
    """Point a valid body at the served model, with token ids in its vocabulary and a small max_tokens (given
    where the case has none), so that positive cases reach generation (a random `model` would only ever get 404)."""
    body = case.body
    body["model"] = MODEL
    for key in ("prompt", "tokens"):  # completions' token-id prompt, /detokenize's ids
        if isinstance(body.get(key), list) and all(isinstance(t, (int, float)) for t in body[key]):
            body[key] = [int(t) % vocab_size for t in body[key]]
    limits = [key for key in LIMIT_FIELDS if isinstance(body.get(key), (int, float))]
    for key in limits:
        body[key] = min(int(body[key]), MAX_TOKENS)
    if not limits and case.operation.path in LIMITS:
        body[LIMITS[case.operation.path]] = MAX_TOKENS
    if isinstance(body.get("n"), (int, float)):  # n choices are n sessions: at most 2 here
        body["n"] = min(int(body["n"]), 2)
        if body.get("best_of") is not None:
            body["best_of"] = body["n"]


@pytest.mark.parametrize("method,path,mode,examples", OPERATIONS, ids=[f"{m} {p} {g.value}" for m, p, g, _ in OPERATIONS])
def test_fuzz_http_api(server, api, tokenizer, method, path, mode, examples):
    operation = api[path][method]

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        if mode == POSITIVE and isinstance(case.body, dict):
            _servable(case, len(tokenizer))
        response = case.call(base_url=server.http, headers=HEADERS, timeout=120)
        case.validate_response(response, checks=CHECKS)

    check()
