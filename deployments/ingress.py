"""The ingress: OpenAI-compatible HTTP API (FastAPI) and the public gRPC `Generation` service.

Everything a client can get wrong is checked here, before a stream starts (HTTP bodies are read and
validated by `deployments/openai_api.py`): HTTP answers 4xx with an OpenAI-style error body, gRPC
answers INVALID_ARGUMENT, whatever the input. Generation itself happens in the router
deployment (on vLLM: the verifier replicas, which drive their sessions); this replica tokenizes,
applies the chat template, and formats results.
"""


import asyncio
import logging
import secrets
import time
import uuid
from typing import Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from jinja2.exceptions import TemplateError
from ray import serve

from cluster.core import grammar
from cluster.core.errors import InvalidRequestError
from cluster.core.sampling import SamplingParams, prediction_seed
from cluster.core.validation import validate_request
from cluster.model import models
from deployments import openai_tools
from deployments.chunks import ErrorChunk
from deployments.config import TandemAppConfig
from deployments.failover import FailoverMetrics, resumable_stream
from deployments.ingress_app import app, unauthorized
from deployments.ingress_compat import CompatRoutes
from deployments.ingress_grpc import ERROR_STATUS, GrpcRoutes
from deployments.openai_api import CompletionRequest, parse_request
from deployments.openai_body import ApiError, ErrorResponse, error_response, read_body
from deployments.openai_chat import ChatCompletionRequest
from deployments.openai_choices import Answer, Echo, choice_params, collect, echo_chat, open_choices, sse
from deployments.openai_logprobs import LogprobFormat
from deployments.openai_responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    ResponseEvent,
    ResponseObject,
    route_docs,
)
from deployments.openai_response_events import ResponseBuilder, collect_response, response_events
from deployments.openai_responses_api import ResponsesRequest

log = logging.getLogger(__name__)


# ---- the ingress deployment -----------------------------------------------------------------------


class IngressRoutes(GrpcRoutes, CompatRoutes):
    """The API's routes and checks, on whatever replica serves them: the `Ingress` deployment (sessions on
    the router deployment or the vLLM verifier replicas, through `router_handle`), or a vLLM verifier replica
    that is its own ingress (`deployments.vllm_serving.DirectVLLMServer`: `router_handle` calls the replica
    itself). FastAPI's routes call these methods on the replica's servable object."""

    def __init__(self, config: dict, router_handle):
        from transformers import AutoConfig

        self.config = TandemAppConfig.build(config)
        path = models.resolve_model_path(self.config.engine.target, self.config.engine.cache_dir)
        self.tokenizer = models.load_tokenizer(path)
        self.max_context = AutoConfig.from_pretrained(path).max_position_embeddings
        # the longest session the verifiers take: on vLLM, its replicas' max_model_len
        self.context_limit = min(self.max_context, self.config.vllm.max_model_len) \
            if self.config.engine.backend == "vllm" else self.max_context
        self.vocab_size = len(self.tokenizer)
        self.router = router_handle
        self.created = int(time.time())
        self.failover_metrics = FailoverMetrics(self.config.model_id)

    # -- shared checks ---------------------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        return self._key_accepted(request.headers.get("authorization", ""), request.headers.get("x-api-key", ""))

    def _key_accepted(self, authorization: str, x_api_key: str) -> bool:
        """Whether `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's) carries one of
        `api_keys` (HTTP headers, or gRPC metadata of the same names); any request when none is configured."""
        if not self.config.api_keys:
            return True
        key = authorization[7:] if authorization.lower().startswith("bearer ") else x_api_key
        return any(secrets.compare_digest(key, k) for k in self.config.api_keys)

    def _sampling(self, prompt_ids: list[int], max_tokens: int | None, **fields) -> SamplingParams:
        """The request's one validated `SamplingParams`, with its seed: what every later hop carries as
        it is (router deployment, `Router`, a resume on another router replica), unchecked again."""
        if max_tokens is None:
            max_tokens = max(1, min(self.config.default_max_tokens, self.max_context - len(prompt_ids)))
        limit = self.config.max_tokens_limit
        if limit is not None and max_tokens > limit:
            raise InvalidRequestError(f"max_tokens: {max_tokens} exceeds this server's limit of {limit}")
        fields["seed"] = prediction_seed(fields.get("seed"), fields.get("temperature", 0.0), fields.get("prediction"))
        params = SamplingParams.build(max_tokens=max_tokens, **fields)
        validate_request(prompt_ids, params, self.context_limit, self.tokenizer, self.vocab_size)
        if self.config.engine.backend == "vllm" and params.vllm_refused_fields:
            raise InvalidRequestError(f"{', '.join(params.vllm_refused_fields)}: not served on the vLLM backend "
                                      "(engine.backend: vllm; vLLM refuses min_p and logit_bias with speculative "
                                      "decoding); the torch backend serves them")
        served = self.config.vllm.engine_kwargs.get("logprobs_mode", "raw_logprobs")
        if self.config.engine.backend == "vllm" and params.logprobs is not None and params.logprobs_mode != served:
            raise InvalidRequestError(f"logprobs_mode: {params.logprobs_mode} is not served here: vLLM's logprobs_mode "
                                      f"is per server, and this one was started with {served} "
                                      "(vllm.engine_kwargs.logprobs_mode); the torch backend serves both")
        return params.with_seed()  # fixed here: a resumed session (failover) draws the same numbers

    def _http_params(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                     max_tokens: int | None) -> SamplingParams:
        return self._sampling(prompt_ids, max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos,
                              include_stop_str_in_output=body.include_stop_str_in_output,
                              skip_special_tokens=body.skip_special_tokens, structured_outputs=body.structured(),
                              cache_salt=body.cache_salt,
                              prediction=body.prediction.token_ids(self.tokenizer) if body.prediction else None,
                              **body.processor_fields(self.tokenizer), **body.logprob_fields())

    def _chat_ids(self, messages: list[dict], tools=None, tool_mode: str | None = None,
                  options: dict | None = None, special_tokens: bool = False) -> list[int]:
        """The prompt of a conversation (OpenAI-shaped message dicts), with the tools where they are in play;
        `options`: the request's chat template options (`TemplateFields.template_options`); `special_tokens`:
        the templated text tokenized with the tokenizer's special tokens added (vLLM's `add_special_tokens`)."""
        if not messages:
            raise InvalidRequestError("messages: at least one message is required")
        messages, listed = openai_tools.template_messages(messages, tools, tool_mode, self.tokenizer.chat_template or "")
        options = options or {"add_generation_prompt": True}
        try:
            if special_tokens:
                text = self.tokenizer.apply_chat_template(messages, tools=listed, tokenize=False, **options)
                return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
            return list(self.tokenizer.apply_chat_template(messages, tools=listed, tokenize=True, return_dict=False,
                                                           **options))
        except (TemplateError, ValueError) as e:  # a template may refuse an order of roles, or a message to continue
            raise InvalidRequestError(f"messages: the model's chat template refused them: {e}") from None

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """A chat completions request's prompt ids."""
        return self._chat_ids([m.template_message() for m in body.messages], body.tools, body.tool_mode(),
                              body.template_options(), body.add_special_tokens)

    def _run(self, prompt_ids: list[int], params: SamplingParams, max_speculative_tokens: int | None):
        """The router's chunks (an error arrives as one `ErrorChunk`), resumed on another router
        replica when the one carrying the session dies; cancelled when the caller goes away."""
        failover = self.config.failover
        return resumable_stream(self.router, prompt_ids, params, max_speculative_tokens, failover.max_resumes,
                                failover.resume_delay_s, self.failover_metrics, self.config.request_timeout_s)

    def _error(self, error: ErrorChunk):
        """An error that came before anything was sent, as an HTTP response."""
        response = error_response(ERROR_STATUS.get(error.type, (500,))[0], error.message, type_=error.type,
                                  code=error.type if error.type in ERROR_STATUS else None)
        if error.type == "overloaded":
            response.headers["Retry-After"] = str(self.config.retry_after_s)
        return response

    # -- HTTP --------------------------------------------------------------------------------------

    @app.get("/health", responses={200: {"model": Health}})
    async def health(self):
        return {"status": "ok"}

    @app.get("/v1/models", responses={200: {"model": ModelList}, 401: {"model": ErrorResponse}})
    async def list_models(self, request: Request):
        if not self._authorized(request):
            return unauthorized()
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}", responses={200: {"model": ModelCard}, 401: {"model": ErrorResponse},
                                                   404: {"model": ErrorResponse}})
    async def retrieve_model(self, request: Request, model: str):
        """OpenAI's retrieve (`client.models.retrieve`): the served model's card, or 404 for any other."""
        if not self._authorized(request):
            return unauthorized()
        try:
            self._check_model(model)
        except ApiError as e:
            return e.response()
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.config.model_id, "object": "model", "created": self.created, "owned_by": "tandem",
                "max_model_len": self.max_context}

    @app.post("/v1/completions", **route_docs(CompletionRequest, CompletionResponse, CompletionChunk))
    async def completions(self, request: Request):
        return await self.http(request, "completion")

    @app.post("/v1/chat/completions", **route_docs(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(self, request: Request):
        return await self.http(request, "chat")

    @app.post("/v1/responses", **route_docs(ResponsesRequest, ResponseObject, ResponseEvent,
                                            "The response; with `stream`, OpenAI's response events."))
    async def responses(self, request: Request):
        checked = await self._checked(request, ResponsesRequest,
                                      lambda b: [self._chat_ids(b.messages(), b.chat_tools(), b.tool_mode())],
                                      ResponsesRequest.max_new_tokens)
        if not isinstance(checked, tuple):
            return checked
        body, [prompt_ids], [params] = checked
        refused, chunks = await open_choices([self._run(prompt_ids, params, body.num_speculative_tokens)])
        if refused is not None:
            return self._error(refused)
        builder = ResponseBuilder(body, len(prompt_ids), self.tokenizer)
        if body.stream:
            return StreamingResponse(response_events(chunks, builder), media_type="text/event-stream")
        try:
            result = await collect_response(chunks, builder)
        finally:
            await chunks.aclose()
        return self._error(result) if isinstance(result, ErrorChunk) else result

    async def _checked(self, request: Request, model: type, prompts_of, max_tokens_of, raw: bytes | None = None):
        """(body, its prompts' ids, their params) of a valid request to a generation route (`prompts_of`: the
        body's prompts, tokenized; `raw`: the body, where the route has read it), or the error response to send."""
        if not self._authorized(request):
            return unauthorized()
        try:
            body = parse_request(raw if raw is not None else await read_body(request), model)
            self._check_model(body.model)
            prompts = [body.truncated(ids, self.context_limit, self.tokenizer.truncation_side)
                       for ids in prompts_of(body)]
            params = [self._http_params(body, ids, max_tokens_of(body)) for ids in prompts]
            if params[0].structured_outputs is not None:  # a schema, regex or grammar xgrammar refuses is a 400 here
                await asyncio.to_thread(grammar.check, params[0].structured_outputs, self.vocab_size)
        except ApiError as e:
            return e.response()
        except InvalidRequestError as e:
            return error_response(400, str(e))
        return body, prompts, params

    def _check_model(self, name: str) -> None:
        if name != self.config.model_id:
            raise ApiError(404, f"the model `{name}` does not exist; this server serves `{self.config.model_id}`",
                           param="model", code="model_not_found")

    def _completion_ids(self, body: CompletionRequest) -> list[list[int]]:
        return [list(self.tokenizer(p, add_special_tokens=body.add_special_tokens)["input_ids"])
                if isinstance(p, str) else p for p in body.prompts()]

    async def http(self, request: Request, kind: Literal["completion", "chat"], raw: bytes | None = None,
                   chat_ids: list[int] | None = None):
        """A generation route's answer (`raw`: the body, where the route has read it; `chat_ids`: a chat body's
        prompt ids, where the route has built them)."""
        if kind == "completion":
            checked = await self._checked(request, CompletionRequest, self._completion_ids, lambda b: b.max_tokens,
                                          raw)
        else:
            checked = await self._checked(request, ChatCompletionRequest, lambda b: [chat_ids or self._chat_prompt(b)],
                                          lambda b: b.max_completion_tokens or b.max_tokens, raw)
        if not isinstance(checked, tuple):
            return checked
        body, prompts, params = checked  # choice p * n + j: prompt p's choice j (vLLM's order)
        streams = [self._run(ids, choice_params(prm, j), body.num_speculative_tokens)
                   for ids, prm in zip(prompts, params) for j in range(body.n)]
        refused, chunks = await open_choices(streams)
        if refused is not None:  # a refusal (queue full, ...) still gets its status code, not a 200 stream
            return self._error(refused)
        # the body's request_id, else an X-Request-Id header (Serve's proxy sets its request's id there when the
        # client did not; vLLM lets a header win, but behind Serve a header is always there), else random
        request_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-" \
                     f"{body.request_id or request.headers.get('x-request-id') or uuid.uuid4().hex}"
        choices, prompt_tokens = len(streams), sum(len(ids) for ids in prompts)
        logprobs = LogprobFormat(self.tokenizer, kind, body.return_tokens_as_token_ids) \
            if params[0].logprobs is not None else None
        answer = Answer(choices, kind, request_id, body.model, prompt_tokens, body.return_token_ids,
                        [ids for ids in prompts for _ in range(body.n)], self._echoes(kind, body, prompts),
                        self._prompt_text(kind, body, prompts[0]), params[0].prediction)
        tools = body.tool_mode() if kind == "chat" else None  # tool calls parsed out of each choice's text
        if body.stream:
            events = sse(chunks, answer, body.usage_options(), logprobs)
            return StreamingResponse(openai_tools.stream(events, tools), media_type="text/event-stream")
        try:
            result = await collect(chunks, answer, logprobs, LogprobFormat(self.tokenizer, kind))
        finally:
            await chunks.aclose()
        if isinstance(result, ErrorChunk):
            return self._error(result)
        return echo_chat(openai_tools.apply(result, tools), answer.echo) if kind == "chat" else result

    def _echoes(self, kind: str, body, prompts: list[list[int]]) -> list[Echo] | None:
        """Each choice's `echo` (None: none): a completion's prompt text (its ids decoded where they were cut),
        scored where its prompt logprobs are asked; chat's, the last message's text (`echo_text`)."""
        if kind == "chat":
            text = body.echo_text()
            return [Echo(text, 0, False)] * body.n if text else None
        if not body.echo:
            return None
        scored = body.num_prompt_logprobs() is not None
        return [Echo(body.echo_text(p if body.truncate_prompt_tokens is None else ids, self.tokenizer), ids[0],
                     scored) for p, ids in zip(body.prompts(), prompts) for _ in range(body.n)]

    def _prompt_text(self, kind: str, body, ids: list[int]) -> str | None:
        """Chat's `return_prompt_text`: the templated prompt's text (its ids decoded); None: not asked."""
        return self.tokenizer.decode(ids) if kind == "chat" and body.return_prompt_text else None


@serve.ingress(app)  # at import, so every process that unpickles a replica class sees the same routes (bound to
class Ingress(IngressRoutes):  # IngressRoutes' methods, called on the replica's servable object)
    """The ingress deployment."""
