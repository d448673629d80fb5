"""The OpenAI-compatible HTTP API's responses: JSON bodies, streamed chunks, and the OpenAPI document
that describes them with the request models (`deployments/openai_api.py`).

Streams are documented as OpenAPI 3.2 describes server-sent events: `text/event-stream` with an
`itemSchema` per event whose `data` is a JSON chunk (or an error) and, last, `[DONE]`; schema-driven
tools (schemathesis) check each event against it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from deployments.openai_body import ErrorBody, ErrorResponse
from protos import MAX_REQUEST_BYTES

FinishReason = Literal["stop", "length", "tool_calls"]
FINISH = "`stop`: end of sequence or a stop string; `length`: max_tokens; `tool_calls` (chat): the model called tools."
TOKEN_IDS = "Extension (with `return_token_ids`): the generated token ids."
PROMPT_IDS = "Extension (vLLM, with `return_token_ids`): the prompt's token ids."


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens of the prompt (after the chat template).")
    completion_tokens: int = Field(description="Tokens generated (so far, in a streamed chunk).")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")


class Speculation(BaseModel):
    """Extension: this request's speculation figures (DESIGN.md's vocabulary)."""

    drafted: int = Field(description="Draft tokens proposed.")
    accepted: int = Field(description="Draft tokens the target accepted.")
    acceptance_rate: float = Field(description="accepted / drafted.")
    mean_accepted_length: float = Field(description="Tokens committed per verification round.")
    rounds: int = Field(description="Verification rounds.")
    accepted_per_position: list[int] = Field(description="Accepted tokens at each draft position.")
    drafted_per_position: list[int] = Field(description="Drafted tokens at each draft position.")
    gamma_counts: list[int] = Field(description="Rounds that drafted γ tokens, indexed by γ.")


class TopLogprob(BaseModel):
    token: str = Field(description="The token, decoded alone.")
    logprob: float = Field(description="Its log probability (-9999.0: none, a logits processor masks it).")
    bytes: list[int] = Field(description="The token string's UTF-8 bytes.")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="The `top_logprobs` most likely tokens at this position, best first.")


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(description="One per generated token (in a streamed chunk: those whose text it carries).")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(description="The generated tokens, each decoded alone (with `echo`, the prompt's first).")
    token_logprobs: list[float | None] = Field(description="Each token's log probability (null: the echoed prompt's first token, which has none).")
    top_logprobs: list[dict[str, float] | None] = Field(description="Per token: it and the `logprobs` most likely tokens -> log probability (null: the echoed prompt's first token).")
    text_offset: list[int] = Field(description="Each token's offset in the text, counted over the token strings.")


class PromptLogprob(BaseModel):
    logprob: float = Field(description="The target's raw log probability of the token at this prompt position.")
    rank: int | None = Field(description="Tokens at least as likely (1: the most likely).")
    decoded_token: str = Field(description="The token, decoded alone.")


LOGPROBS = ("With `logprobs`: the target's log probabilities (`logprobs_mode`) of the generated tokens; "
            "else null.")


class CompletionChoice(BaseModel):
    index: int = Field(description="The choice (0 .. n-1).")
    text: str = Field(description="The generated text (with `echo`, after the prompt's).")
    finish_reason: FinishReason = Field(description=FINISH)
    logprobs: CompletionLogprobs | None = Field(None, description=LOGPROBS + " With `echo`, the prompt's tokens come first.")
    token_ids: list[int] | None = Field(None, description=TOKEN_IDS)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, description="Extension (vLLM), with `prompt_logprobs` (or `echo` with `logprobs`): per prompt token (the first null) its token id and the N most likely ones -> their log probability, rank and text.")
    prompt_token_ids: list[int] | None = Field(None, description=PROMPT_IDS)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(description="Unix time.")
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculation: Speculation


class FunctionCall(BaseModel):
    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments as JSON text.")


class ToolCallOut(BaseModel):
    id: str = Field(description="The call's id (`call_...`), for the tool message that answers it.")
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCallOut):
    index: int = Field(description="The call's place among the choice's calls (each comes whole, in one delta).")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="The generated text; null when the whole output is tool calls.")
    tool_calls: list[ToolCallOut] | None = Field(None, description="With `tools`: the calls parsed out of the output.")


class ChatChoice(BaseModel):
    index: int = Field(description="The choice (0 .. n-1).")
    message: AssistantMessage
    finish_reason: FinishReason = Field(description=FINISH)
    logprobs: ChatLogprobs | None = Field(None, description=LOGPROBS)
    token_ids: list[int] | None = Field(None, description=TOKEN_IDS)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(description="Unix time.")
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: Speculation
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, description="Extension (vLLM), with `prompt_logprobs`: per token of the templated prompt (the first null) its token id and the N most likely ones -> their log probability, rank and text.")
    prompt_token_ids: list[int] | None = Field(None, description=PROMPT_IDS + " The templated prompt's.")
    prompt_text: str | None = Field(None, description="Extension (vLLM), with `return_prompt_text`: the templated prompt's text.")


class ModelCard(BaseModel):
    id: str = Field(description="The name to pass as `model`.")
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time the server started.")
    owned_by: str
    max_model_len: int = Field(description="The model's context length in tokens.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"


# ---- streamed chunks (one per server-sent event) ----------------------------------------------------


class CompletionChunkChoice(BaseModel):
    index: int = Field(description="The choice (0 .. n-1).")
    text: str = Field(description="New text since the previous chunk.")
    finish_reason: FinishReason | None = Field(description=f"Set on the last chunk: {FINISH}")
    logprobs: CompletionLogprobs | None = Field(None, description=f"{LOGPROBS} Those of the tokens whose text this chunk carries.")
    token_ids: list[int] | None = Field(None, description=f"{TOKEN_IDS} New ones since the previous chunk.")
    prompt_token_ids: list[int] | None = Field(None, description=PROMPT_IDS + " In the choice's first chunk.")


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(description="Unix time.")
    model: str
    choices: list[CompletionChunkChoice] = Field(description="One choice; empty in the usage-only last chunk.")
    usage: Usage | None = Field(None, description="With `stream_options.include_usage`: in a last chunk; with `continuous_usage_stats`: in every chunk.")
    speculation: Speculation | None = Field(None, description="On the chunk that carries the finish reason.")


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="On the first chunk.")
    content: str | None = Field(None, description="New text since the previous chunk.")
    tool_calls: list[ToolCallDelta] | None = Field(None, description="With `tools`: the choice's calls, before its finish.")


class ChatChunkChoice(BaseModel):
    index: int = Field(description="The choice (0 .. n-1).")
    delta: Delta
    finish_reason: FinishReason | None = Field(description=f"Set on the last chunk: {FINISH}")
    logprobs: ChatLogprobs | None = Field(None, description=f"{LOGPROBS} Those of the tokens whose text this chunk carries.")
    token_ids: list[int] | None = Field(None, description=f"{TOKEN_IDS} New ones since the previous chunk.")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(description="Unix time.")
    model: str
    choices: list[ChatChunkChoice] = Field(description="One choice; empty in the usage-only last chunk.")
    prompt_token_ids: list[int] | None = Field(None, description=PROMPT_IDS + " The templated prompt's, in the first chunk.")
    prompt_text: str | None = Field(None, description="Extension (vLLM), with `return_prompt_text`: the templated prompt's text, in the first chunk.")
    usage: Usage | None = Field(None, description="With `stream_options.include_usage`: in a last chunk; with `continuous_usage_stats`: in every chunk.")
    speculation: Speculation | None = Field(None, description="On the chunk that carries the finish reason.")


# ---- the Responses API (/v1/responses; deployments/openai_responses_api.py) ------------------------------


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = Field(description="The generated text (so far, in a streamed part).")
    annotations: list = Field(description="Always empty.")
    logprobs: list[ChatTokenLogprob] = Field(description="With `include: ['message.output_text.logprobs']`: each token's.")


class ResponseOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText] = Field(description="One text part (none yet when the stream announces the item).")


class ResponseFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str = Field(description="What the call's `function_call_output` item refers to.")
    name: str
    arguments: str = Field(description="The arguments as JSON text.")
    status: Literal["in_progress", "completed"]


class ResponseUsage(BaseModel):
    input_tokens: int = Field(description="Tokens of the prompt (after the chat template).")
    input_tokens_details: dict[str, int] = Field(description="`cached_tokens`: 0.")
    output_tokens: int = Field(description="Tokens generated.")
    output_tokens_details: dict[str, int] = Field(description="`reasoning_tokens`: 0.")
    total_tokens: int


class ResponseObject(BaseModel):
    """A response: the Responses API's envelope of one assistant message."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(description="Unix time.")
    status: Literal["in_progress", "completed", "incomplete"] = Field(description="`incomplete`: `max_output_tokens` ended it.")
    error: None = None
    incomplete_details: dict[str, str] | None = Field(description="`{'reason': 'max_output_tokens'}` when incomplete.")
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[ResponseOutputMessage | ResponseFunctionCall] = Field(description="The assistant's message, or its function calls (after a message of the text before them, if any); empty until the stream adds them.")
    parallel_tool_calls: bool
    previous_response_id: None = None
    temperature: float
    top_p: float
    top_logprobs: int
    tool_choice: Literal["none", "auto", "required"] | dict
    tools: list = Field(description="The request's.")
    text: dict = Field(description="`{'format': ...}` as the request gave it (`{'type': 'text'}` by default).")
    truncation: Literal["auto", "disabled"] = "disabled"
    store: Literal[False] = Field(False, description="Nothing is stored.")
    background: Literal[False] = False
    metadata: dict[str, str]
    user: str | None = None
    usage: ResponseUsage | None = Field(description="Once the response is done.")
    speculation: Speculation | None = Field(None, description="Once the response is done.")


class ResponseEvent(BaseModel):
    """One event of a streamed response (its `type` is also the SSE event's name)."""

    type: Literal["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.function_call_arguments.delta",
                  "response.function_call_arguments.done", "response.output_item.done", "response.completed", "error"]
    sequence_number: int = Field(description="0, 1, 2, ... within the stream.")
    response: ResponseObject | None = Field(None, description="On `response.created`, `.in_progress` and `.completed` (whose status may be `incomplete`).")
    output_index: int | None = Field(None, description="0: the one message.")
    item: ResponseOutputMessage | ResponseFunctionCall | None = Field(None, description="On `response.output_item.*`.")
    item_id: str | None = None
    content_index: int | None = Field(None, description="0: the one text part.")
    part: ResponseOutputText | None = Field(None, description="On `response.content_part.*`.")
    delta: str | None = Field(None, description="On `response.output_text.delta`: new text; on `response.function_call_arguments.delta`: the arguments.")
    arguments: str | None = Field(None, description="On `response.function_call_arguments.done`.")
    name: str | None = Field(None, description="On `response.function_call_arguments.done`: the function.")
    text: str | None = Field(None, description="On `response.output_text.done`: the whole text.")
    logprobs: list[ChatTokenLogprob] | None = Field(None, description="On text deltas and done: those of the tokens the text carries (with logprobs asked).")
    code: str | None = Field(None, description="On `error`.")
    message: str | None = Field(None, description="On `error`.")
    param: str | None = None
    error: ErrorBody | None = Field(None, description="On `error` (as the chat streams carry it).")


# ---- the OpenAPI document ---------------------------------------------------------------------------

_ERRORS = {400: "A malformed or unsupported request.", 401: "A missing or wrong API key.",
           404: "An unknown model.", 413: f"A body of more than {MAX_REQUEST_BYTES} bytes.",
           503: "The server cannot carry the request now (its queue is full: see Retry-After; or its router "
                "kept failing); try again.",
           504: "The request ran past the server's `request_timeout_s`."}
_DOCUMENTED_ELSEWHERE: list[type[BaseModel]] = []  # the models `route_docs` refers to by name


def _ref(models: type[BaseModel] | tuple[type[BaseModel], ...]) -> dict:
    """The schema of a model, or of any of several (a route that takes and answers more than one kind)."""
    if isinstance(models, tuple):
        return {"anyOf": [_ref(m) for m in models]}
    return {"$ref": f"#/components/schemas/{models.__name__}"}


Models = type[BaseModel] | tuple[type[BaseModel], ...]


def route_docs(request: Models, response: Models, chunk: Models | None,
               description: str = "The completion; with `stream`, server-sent events: one chunk each, then `[DONE]`.",
               error: type[BaseModel] = ErrorResponse) -> dict:
    """FastAPI route keywords that document a route whose handler reads the raw body itself (so
    that the size, depth and encoding bounds apply before parsing); `chunk`: a streamed event's body
    (None: the route does not stream); `error`: the error body. A tuple of models: any one of them."""
    named = [m for group in (request, chunk, response if isinstance(response, tuple) else None,
                             error if error is not ErrorResponse else None) if group is not None
             for m in (group if isinstance(group, tuple) else (group,))]
    _DOCUMENTED_ELSEWHERE.extend(m for m in dict.fromkeys(named) if m not in _DOCUMENTED_ELSEWHERE)
    ok: dict = {"description": description}
    if isinstance(response, tuple):  # FastAPI documents one model; several are documented here
        ok["content"] = {"application/json": {"schema": _ref(response)}}
    else:
        ok["model"] = response
    if chunk is not None:
        chunks = chunk if isinstance(chunk, tuple) else (chunk,)
        event = {"type": "object", "required": ["data"], "properties": {"event": {"type": "string"}, "data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [*(_ref(c) for c in chunks), _ref(error)]}}]}}}
        ok.setdefault("content", {})["text/event-stream"] = {"itemSchema": event}
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}}},
        "responses": {200: ok, **{status: {"model": error, "description": text} for status, text in _ERRORS.items()}},
    }


def openapi_document(app) -> dict:
    """FastAPI's document plus the request and chunk models that `route_docs` refers to."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        _, schemas = models_json_schema([(model, "validation") for model in _DOCUMENTED_ELSEWHERE],
                                        ref_template="#/components/schemas/{model}")
        document.setdefault("components", {}).setdefault("schemas", {}).update(schemas["$defs"])
        app.openapi_schema = document
    return app.openapi_schema
