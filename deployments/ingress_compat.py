"""The routes beside OpenAI's chat, completions and Responses API that clients of `vllm serve` use, as methods of the
ingress replica (`deployments/ingress.py`'s `IngressRoutes` takes them from `CompatRoutes`): vLLM's routes for hosts
(`/ping`, SageMaker's `/invocations`: `deployments/openai_hosting.py`), Anthropic's Messages API (`/v1/messages`,
`/v1/messages/count_tokens`: `deployments/anthropic_api.py`), vLLM's tokenizer routes (`/tokenize`, `/detokenize`,
`/version`: `deployments/openai_tokenize.py`) and its Prometheus route (`/metrics`). Each runs on the ingress's
checks and sessions (`_authorized`, `_check_model`, `_chat_prompt`, `http`)."""

import asyncio
import functools

import httpx
import ray
from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from cluster.core.errors import InvalidRequestError
from deployments.anthropic_api import CountTokensRequest, MessagesRequest
from deployments.anthropic_events import (
    AnthropicError,
    CountTokens,
    MessageEvent,
    MessageObject,
    anthropic_answer,
    anthropic_error,
)
from deployments.ingress_app import app, unauthorized
from deployments.openai_api import CompletionRequest, parse_request
from deployments.openai_body import ApiError, ErrorResponse, error_response, read_body
from deployments.openai_chat import ChatCompletionRequest
from deployments.openai_hosting import invocation_kind
from deployments.openai_responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    Health,
    route_docs,
)
from deployments.openai_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    Version,
    detokenize,
    tandem_version,
    tokenize,
)


@functools.cache  # a node's agent keeps its port: one look at the cluster's node table per process, not per scrape
def node_metrics_url() -> str:
    """The Prometheus endpoint of the metrics agent on this process's Ray node (LookupError, not kept: none)."""
    node_id = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n.get("MetricsExportPort")), None)
    if node is None:
        raise LookupError(f"node {node_id} lists no metrics export port")
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


class CompatRoutes:
    """The routes; the ingress's state and checks come from the class that takes them (`IngressRoutes`)."""

    # vLLM's routes for hosts (deployments/openai_hosting.py)

    @app.get("/ping", responses={200: {"model": Health}}, operation_id="ping_get")
    @app.post("/ping", responses={200: {"model": Health}}, operation_id="ping_post")
    async def ping(self):
        """The health check under SageMaker's name (vLLM's `/ping`)."""
        return {"status": "ok"}

    @app.post("/invocations", **route_docs((ChatCompletionRequest, CompletionRequest),
                                           (ChatCompletionResponse, CompletionResponse),
                                           (ChatCompletionChunk, CompletionChunk),
                                           "SageMaker's route (vLLM's): a chat completions body (`messages`) is "
                                           "answered as /v1/chat/completions answers it, a completions body "
                                           "(`prompt`) as /v1/completions."))
    async def invocations(self, request: Request):
        if not self._authorized(request):  # before the body is read, as on every generation route
            return unauthorized()
        try:
            raw = await read_body(request)
            kind = invocation_kind(raw)
        except ApiError as e:
            return e.response()
        return await self.http(request, kind, raw)

    # Anthropic's Messages API, as vLLM serves it (deployments/anthropic_api.py): chat in other words

    @app.post("/v1/messages", **route_docs(MessagesRequest, MessageObject, MessageEvent, "The message; with `stream`, "
                                           "Anthropic's events.", error=AnthropicError))
    async def anthropic_messages(self, request: Request):
        checked = await self._anthropic(request, MessagesRequest)
        if not isinstance(checked, tuple):
            return checked
        body, prompt_ids = checked
        return anthropic_answer(await self.http(request, "chat", body.chat_body(), prompt_ids), body.stop_sequences,
                                self.tokenizer, len(prompt_ids))

    @app.post("/v1/messages/count_tokens", **route_docs(CountTokensRequest, CountTokens, None, "The prompt's "
                                                        "tokens.", error=AnthropicError))
    async def anthropic_count_tokens(self, request: Request):
        checked = await self._anthropic(request, CountTokensRequest)
        return {"input_tokens": len(checked[1])} if isinstance(checked, tuple) else checked

    async def _anthropic(self, request: Request, model: type):
        """(body, its prompt's ids) of a valid Messages request, or the Anthropic error response to send."""
        if not self._authorized(request):
            return anthropic_error(unauthorized())
        try:
            body = parse_request(await read_body(request), model)
            self._check_model(body.model)
            return body, self._chat_prompt(parse_request(body.chat_conversation(), ChatCompletionRequest))
        except ApiError as e:
            return anthropic_error(e.response())
        except InvalidRequestError as e:
            return anthropic_error(error_response(400, str(e)))

    # vLLM's tokenizer routes (deployments/openai_tokenize.py)

    @app.post("/tokenize", **route_docs(TokenizeRequest, TokenizeResponse, None, "The prompt's tokens."))
    async def tokenize(self, request: Request):
        def chat_ids(messages, tools, options):
            return self._chat_ids(messages, tools, "auto" if tools else None, options)

        return await self._tokenizer_route(request, TokenizeRequest,
                                           lambda b: tokenize(b, self.tokenizer, chat_ids, self.context_limit))

    @app.post("/detokenize", **route_docs(DetokenizeRequest, DetokenizeResponse, None, "The tokens' text."))
    async def detokenize(self, request: Request):
        return await self._tokenizer_route(request, DetokenizeRequest,
                                           lambda b: detokenize(b, self.tokenizer, self.vocab_size))

    @app.get("/version", responses={200: {"model": Version}})
    async def version(self):
        return {"version": tandem_version()}

    # vLLM's Prometheus route on the API port

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus' text format."},
                        503: {"model": ErrorResponse}})
    async def metrics(self):
        """This node's metrics in Prometheus' format, as Ray's metrics agent on the node exports them (tandem's,
        prefixed `ray_tandem_`, Serve's and Ray's): the agent's answer passed on, so a scraper configured for
        `vllm serve` finds them at the API port. Open without a key, as vLLM's. On a cluster each node's agent
        has the metrics of the replicas on that node: scrape every node's agent (README, Metrics)."""
        try:
            url = await asyncio.to_thread(node_metrics_url)
            async with httpx.AsyncClient(timeout=10) as agent:
                answer = await agent.get(url)
        except (httpx.HTTPError, LookupError) as e:
            return error_response(503, f"the node's metrics agent did not answer: {e!r}"[:300],
                                  type_="service_unavailable")
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type", "text/plain"))

    async def _tokenizer_route(self, request: Request, model: type, answer):
        if not self._authorized(request):
            return unauthorized()
        try:
            body = parse_request(await read_body(request), model)
            if body.model is not None:  # optional here, as in vLLM
                self._check_model(body.model)
            return answer(body)
        except ApiError as e:
            return e.response()
        except InvalidRequestError as e:
            return error_response(400, str(e))
