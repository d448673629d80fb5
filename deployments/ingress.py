"""The ingress: OpenAI-compatible HTTP API (FastAPI) and the public gRPC `Generation` service.

Everything a client can get wrong is checked here, before a stream starts: HTTP answers 4xx with an
OpenAI-style error body, gRPC answers INVALID_ARGUMENT. Generation itself happens in the router
deployment; this replica tokenizes, applies the chat template, and formats results.
"""


import json
import logging
import secrets
import time
import uuid
from typing import Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import models
from cluster.errors import InvalidRequestError
from cluster.sampling import SamplingParams
from cluster.speculate import validate_request
from deployments.config import TandemAppConfig
from protos import pb

log = logging.getLogger(__name__)

# ---- request bodies (OpenAI's fields; what tandem cannot honour is refused, not ignored) ----------


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The served model id (see GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="Extension: keep the k most likely tokens (0 keeps all).")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None, description="Up to 16 stop strings.")
    n: int = Field(1, ge=1, le=1, description="Only n = 1 is served.")
    stream: bool = False
    stream_options: dict[Literal["include_usage"], bool] | None = None
    ignore_eos: bool = Field(False, description="Extension: keep generating past the end-of-sequence token.")
    num_speculative_tokens: int | None = Field(None, ge=0, le=32, description="Extension: cap on γ for this request; 0 = plain decoding.")
    return_token_ids: bool = Field(False, description="Extension: include the generated token ids in each choice.")
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported (must be 0).")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported (must be 0).")
    logprobs: None = Field(None, description="Not supported.")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="Not supported.")

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] = Field(description="A string, a one-string list, or token ids.")
    echo: bool = Field(False, le=False, description="Not supported.")
    best_of: int | None = Field(None, ge=1, le=1, description="Only 1.")
    suffix: None = Field(None, description="Not supported.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is served (send one request per prompt)")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str | list[dict[Literal["type", "text"], str]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or "text" not in part:
                raise InvalidRequestError("messages: only text content parts ({'type': 'text', 'text': ...}) are served")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens.")


# ---- errors ---------------------------------------------------------------------------------------


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "param": param,
                                                               "code": code}})


def _validation_error(e: RequestValidationError | ValidationError) -> JSONResponse:
    first = e.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {first.get('msg')}")
    field = ".".join(loc) or "body"
    return error_response(400, f"{field}: {first['msg']}", param=field)


app = FastAPI(title="tandem", description="OpenAI-compatible API over lossless pipelined speculative decoding.")


@app.exception_handler(RequestValidationError)
async def _on_validation_error(request: Request, e: RequestValidationError):
    return _validation_error(e)


@app.exception_handler(StarletteHTTPException)
async def _on_http_error(request: Request, e: StarletteHTTPException):
    return error_response(e.status_code, str(e.detail), type_="invalid_request_error")


def _usage(final: dict) -> dict:
    return {"prompt_tokens": final["prompt_tokens"], "completion_tokens": final["completion_tokens"],
            "total_tokens": final["prompt_tokens"] + final["completion_tokens"]}


def _speculation(stats: dict) -> dict:
    """The extension field: speculation figures of this request, in the project's vocabulary."""
    return {key: stats[key] for key in ("drafted", "accepted", "acceptance_rate", "mean_accepted_length", "rounds",
                                        "accepted_per_position", "drafted_per_position", "gamma_counts")}


# ---- the ingress deployment -----------------------------------------------------------------------


@serve.ingress(app)  # at import, so every process that unpickles the class sees the same routes
class Ingress:
    def __init__(self, config: dict, router_handle):
        from transformers import AutoConfig

        self.config = TandemAppConfig.build(config)
        path = models.resolve_model_path(self.config.engine.target, self.config.engine.cache_dir)
        self.tokenizer = models.load_tokenizer(path)
        self.max_context = AutoConfig.from_pretrained(path).max_position_embeddings
        self.vocab_size = len(self.tokenizer)
        self.router = router_handle
        self.created = int(time.time())

    # -- shared checks ---------------------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        if not self.config.api_keys:
            return True
        header = request.headers.get("authorization", "")
        key = header[7:] if header.lower().startswith("bearer ") else ""
        return any(secrets.compare_digest(key, k) for k in self.config.api_keys)

    def _sampling(self, prompt_ids: list[int], max_tokens: int | None, **fields) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(1, min(self.config.default_max_tokens, self.max_context - len(prompt_ids)))
        limit = self.config.max_tokens_limit
        if limit is not None and max_tokens > limit:
            raise InvalidRequestError(f"max_tokens: {max_tokens} exceeds this server's limit of {limit}")
        params = SamplingParams.build(max_tokens=max_tokens, **fields)
        validate_request(prompt_ids, params, self.max_context, self.tokenizer, self.vocab_size)
        return params

    def _http_params(self, body: _Common, prompt_ids: list[int], max_tokens: int | None) -> SamplingParams:
        return self._sampling(prompt_ids, max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos)

    def _chat_ids(self, messages: list[tuple[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                                       add_generation_prompt=True, tokenize=True, return_dict=False))

    async def _run(self, prompt_ids: list[int], params: SamplingParams, max_speculative_tokens: int | None):
        """The router's chunks (an error arrives as one {"error": ...} chunk); cancelled when the caller goes away."""
        stream = self.router.options(stream=True).generate.remote(prompt_ids, params.model_dump(),
                                                                  max_speculative_tokens)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()

    # -- HTTP --------------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models(self, request: Request):
        if not self._authorized(request):
            return error_response(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
        return {"object": "list", "data": [{"id": self.config.model_id, "object": "model", "created": self.created,
                                            "owned_by": "tandem", "max_model_len": self.max_context}]}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.http(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.http(request, "chat")

    async def http(self, request: Request, kind: Literal["completion", "chat"]):
        if not self._authorized(request):
            return error_response(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
        raw = await request.body()
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            return error_response(400, "the request body is not valid UTF-8")
        except json.JSONDecodeError as e:
            return error_response(400, f"the request body is not valid JSON: {e}")
        if not isinstance(data, dict):
            return error_response(400, "the request body must be a JSON object")
        try:
            body = (CompletionRequest if kind == "completion" else ChatCompletionRequest).model_validate(data)
        except ValidationError as e:
            return _validation_error(e)
        if body.model != self.config.model_id:
            return error_response(404, f"the model `{body.model}` does not exist; this server serves "
                                       f"`{self.config.model_id}`", param="model", code="model_not_found")
        try:
            if kind == "completion":
                prompt = body.prompt
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                    prompt = prompt[0]
                prompt_ids = list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
                max_tokens = body.max_tokens
            else:
                prompt_ids = self._chat_ids([(m.role, m.text()) for m in body.messages])
                max_tokens = body.max_completion_tokens or body.max_tokens
            params = self._http_params(body, prompt_ids, max_tokens)
        except InvalidRequestError as e:
            return error_response(400, str(e))
        chunks = self._run(prompt_ids, params, body.num_speculative_tokens)
        request_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(chunks, kind, request_id, body.model, include_usage,
                                               body.return_token_ids),
                                     media_type="text/event-stream")
        text, token_ids, final = "", [], None
        async for chunk in chunks:
            if "error" in chunk:
                return error_response(400 if chunk["error"]["type"] == "invalid_request_error" else 500,
                                      chunk["error"]["message"], type_=chunk["error"]["type"])
            text += chunk["text"]
            token_ids += chunk["token_ids"]
            if "finish_reason" in chunk:
                final = chunk
        choice = {"index": 0, "finish_reason": final["finish_reason"], "logprobs": None}
        if body.return_token_ids:
            choice["token_ids"] = token_ids
        if kind == "completion":
            choice["text"] = text
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return {"id": request_id, "object": "text_completion" if kind == "completion" else "chat.completion",
                "created": int(time.time()), "model": body.model, "choices": [choice],
                "usage": _usage(final), "speculation": _speculation(final["stats"])}

    async def _sse(self, chunks, kind: str, request_id: str, model: str, include_usage: bool,
                   return_token_ids: bool):
        created = int(time.time())
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"

        def event(choices: list, **extra) -> str:
            return "data: " + json.dumps({"id": request_id, "object": obj, "created": created, "model": model,
                                          "choices": choices, **extra}) + "\n\n"

        def choice(text: str | None, finish: str | None, first: bool = False, token_ids=()) -> dict:
            if kind == "completion":
                out = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            else:
                delta = {} if text is None else {"content": text}
                if first:
                    delta["role"] = "assistant"
                out = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            if return_token_ids:
                out["token_ids"] = list(token_ids)
            return out

        if kind == "chat":
            yield event([choice("", None, first=True)])
        async for chunk in chunks:
            if "error" in chunk:
                yield "data: " + json.dumps({"error": {**chunk["error"], "param": None, "code": None}}) + "\n\n"
                break
            if chunk["text"] or (return_token_ids and chunk["token_ids"]):
                yield event([choice(chunk["text"], None, token_ids=chunk["token_ids"])])
            if "finish_reason" in chunk:
                extra = {"speculation": _speculation(chunk["stats"])}
                yield event([choice(None if kind == "chat" else "", chunk["finish_reason"])], **extra)
                if include_usage:
                    yield event([], usage=_usage(chunk))
        yield "data: [DONE]\n\n"

    # -- gRPC (Generation service through Serve's gRPC proxy) ----------------------------------------

    async def Generate(self, request, grpc_context=None):
        try:
            if request.WhichOneof("input") == "messages":
                prompt_ids = self._chat_ids([(m.role, m.content) for m in request.messages.messages])
            elif request.prompt:
                prompt_ids = list(self.tokenizer(request.prompt)["input_ids"])
            else:
                raise InvalidRequestError("prompt or messages is required")
            if request.model and request.model != self.config.model_id:
                raise InvalidRequestError(f"the model `{request.model}` does not exist; this server serves "
                                          f"`{self.config.model_id}`")
            p = request.params
            params = self._sampling(prompt_ids, p.max_tokens or None, temperature=p.temperature,
                                    top_p=p.top_p or 1.0, top_k=p.top_k, seed=p.seed if p.HasField("seed") else None,
                                    stop=list(p.stop), ignore_eos=p.ignore_eos)
        except InvalidRequestError as e:
            grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            grpc_context.set_details(str(e))
            raise  # Serve's proxy answers with the code set above
        gamma = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None
        async for chunk in self._run(prompt_ids, params, gamma):
            if "error" in chunk:
                grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT if chunk["error"]["type"] == "invalid_request_error"
                                      else grpc.StatusCode.INTERNAL)
                grpc_context.set_details(chunk["error"]["message"])
                raise InvalidRequestError(chunk["error"]["message"])
            response = pb.GenerateResponse(text=chunk["text"], token_ids=chunk["token_ids"],
                                           prompt_tokens=len(prompt_ids))
            if "finish_reason" in chunk:
                s = chunk["stats"]
                response.finish_reason = chunk["finish_reason"]
                response.completion_tokens = chunk["completion_tokens"]
                response.stats.CopyFrom(pb.SpeculationStats(
                    drafted=s["drafted"], accepted=s["accepted"], acceptance_rate=s["acceptance_rate"],
                    mean_accepted_length=s["mean_accepted_length"], rounds=s["rounds"],
                    accepted_per_position=s["accepted_per_position"], drafted_per_position=s["drafted_per_position"]))
            yield response

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1.Health/Check: SERVING once this replica runs (Serve only routes to live ones)."""
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
