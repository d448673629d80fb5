"""The routes `vllm serve` answers for hosts, as it answers them: `GET`/`POST /ping` (its health check under
SageMaker's name) and `POST /invocations` (SageMaker's one generation route: a chat body or a completions body,
told apart by its fields). vLLM's `GET /load` (requests in flight) is not served: counted by an ASGI middleware
around the routes, a stream through Serve's replica was sometimes no longer counted while it still sent tokens."""

from __future__ import annotations

from typing import Literal

from deployments.openai_body import ApiError, parse_json_object


def invocation_kind(raw: bytes) -> Literal["chat", "completion"]:
    """Which route a SageMaker invocation's body is for: chat with `messages`, completions with `prompt`
    (vLLM tries chat's request type first, then completions'; a body with both is chat here too)."""
    body = parse_json_object(raw)
    if "messages" in body:
        return "chat"
    if "prompt" in body:
        return "completion"
    raise ApiError(400, "body: an invocation is a chat completions body (`messages`) or a completions body "
                        "(`prompt`); it has neither", param="body")
