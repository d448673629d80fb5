"""The OpenAI-compatible HTTP API's requests: the fields every generation route shares, the completions request,
and how a raw body becomes a request (the body's reading and the error body: `deployments/openai_body.py`; the
chat request: `openai_chat.py`; the Responses API's: `openai_responses_api.py`; answers: `openai_responses.py`).

Policy (README, "Serving"): what tandem can honour is served; fields that change nothing it serves are
accepted and ignored (each name logged once per process), unknown fields too, as vLLM does; what it
cannot honour (beam search, ...) is accepted only at its default value and refused
otherwise with a 400 that says why. No input reaches a layer that cannot hold it: integers and floats
are bounded here to what protobuf and the verifier take (floats rounded to float32).
"""

from __future__ import annotations

import logging
import struct
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_validator

from cluster.core.processors import tokenize_bad_words
from cluster.core.sampling import MAX_LOGPROBS, LogprobsMode
from deployments.openai_body import ApiError, parse_json_object
from deployments.openai_prediction import Prediction
from deployments.openai_structured import StructuredFields

log = logging.getLogger(__name__)

MAX_UINT32 = 2**32 - 1  # protobuf's uint32 (max_tokens, top_k, token ids)
MIN_POSITIVE_FLOAT = 1e-6  # smallest positive temperature or top_p (protobuf's float would round some to 0)
NOT_SERVED = "Not supported: "  # the description prefix of fields accepted only at their default
MAX_STOP = 16  # stop strings per request (cluster.core.sampling.SamplingParams)
MAX_TOKEN_LIST = 1024  # logit_bias entries, stop_token_ids (cluster.core.sampling.MAX_TOKEN_LIST)
MAX_N = 16  # choices per request (n, best_of)
MAX_PROMPTS = 64  # prompts in one completions request (a batch)
MAX_SESSIONS = 64  # prompts x n: sessions one request opens
MAX_BAD_WORDS = 64  # bad_words strings (each may tokenize two ways: at most SamplingParams' 128 sequences)

# Exact schemas of the fields whose before-validators give their own messages (a pydantic union would
# report each member's failure); the token ids' upper bound is the model's vocabulary, checked later.
_STOP_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                          {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP}]}
_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_UINT32}, "minItems": 1}
_PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS_SCHEMA,
                            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                             "maxItems": MAX_PROMPTS},
                            {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": MAX_PROMPTS}]}
_TEMPERATURE_SCHEMA = {"anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_POSITIVE_FLOAT, "maximum": 2}]}


def not_served_reasons(model: type[BaseModel], prefix: str = "", depth: int = 3) -> dict[str, str]:
    """Field path (`n`, `messages.function_call`: list indices left out) -> why tandem cannot honour it, for
    `model`'s `not_served` fields and those of the models its fields hold."""
    out = {}
    for name, info in model.model_fields.items():
        if (info.description or "").startswith(NOT_SERVED):
            out[prefix + name] = info.description.removeprefix(NOT_SERVED)
        for t in _types_in(info.annotation):
            if depth > 1 and isinstance(t, type) and issubclass(t, BaseModel):
                out.update(not_served_reasons(t, f"{prefix}{name}.", depth - 1))
    return out


def _types_in(annotation: Any) -> list:
    args = get_args(annotation)
    return [annotation] if not args else [t for a in args for t in _types_in(a)]


def validation_error(e: ValidationError, reasons: dict[str, str]) -> ApiError:
    """The first problem of a pydantic error as one line naming the field; a field tandem cannot
    honour (`reasons`: `not_served_reasons`, by field path) says why instead of pydantic's wording."""
    first = e.errors()[0]
    loc = first.get("loc", ())
    field = ".".join(str(x) for x in loc) or "body"
    path = [str(x) for x in loc if not isinstance(x, int)]  # list indices out; the longest field path that names
    reason = next((reasons[key] for k in range(len(path), 0, -1)  # one (a union's member tags may follow it)
                   if (key := ".".join(path[:k])) in reasons), None)
    if reason is not None:
        return ApiError(400, f"{field}: not supported by this server: {reason}", param=field,
                        code="unsupported_parameter")
    message = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]
    return ApiError(400, f"{field}: {message}", param=field)


def first_bad_item(value: Any, model: type[BaseModel], noun: str = "item") -> Any:
    """A before-validator's check of a list of `model`s: the first bad one named, with its own first problem worded
    as `validation_error` words it (pydantic's error for a `str | list[...]` union would speak of the string)."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            try:
                model.model_validate(item)
            except ValidationError as e:
                where = validation_error(e, {}).message.removeprefix("body")  # "body": the item as a whole
                raise ValueError(f"{noun} {i}{'' if where.startswith(':') else '.'}{where}") from None
    return value


MAX_WARNED = 100  # distinct ignored field names logged; random names from a fuzzer must not fill logs
_warned: set[str] = set()  # ignored field names already logged by this process


def _warn_once(names: list[str]) -> None:
    for name in names:
        if name not in _warned and len(_warned) < MAX_WARNED:
            _warned.add(name)
            log.warning("request field %r is accepted and ignored (logged once per process%s)", name,
                        "; no more names will be logged" if len(_warned) == MAX_WARNED else "")


def parse_request(raw: bytes, model: type[BaseModel]):
    """A validated request from a raw body; ApiError (400) otherwise. Ignored fields are logged."""
    try:
        body = model.model_validate(parse_json_object(raw))
    except ValidationError as e:
        raise validation_error(e, not_served_reasons(model)) from None
    _warn_once(body.ignored_fields())
    return body


# ---- requests ---------------------------------------------------------------------------------------


def not_served(default: Any, reason: str, **constraints) -> Any:
    """A field tandem cannot honour: accepted only at its default (the type and `constraints` say
    which values mean the default); any other value is refused with `reason`."""
    return Field(default, description=NOT_SERVED + reason, **constraints)


def ignored(description: str) -> Any:
    """A field that changes nothing tandem serves: accepted, logged once, ignored."""
    return Field(None, description=f"Accepted and ignored: {description}")


class _Lenient(BaseModel):
    """Unknown fields are kept in `model_extra` (then logged and ignored); `null` means the default,
    as in OpenAI's API."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """Names of the fields this request sent that change nothing: unknown ones and `ignored(...)` ones."""
        names = [prefix + k for k in self.model_extra or {}]
        for name, info in type(self).model_fields.items():
            if name not in self.model_fields_set:
                continue
            if (info.description or "").startswith("Accepted and ignored"):
                names.append(prefix + name)
            value = getattr(self, name)
            items, inner = (value, f"{prefix}{name}[].") if isinstance(value, list) else ([value], f"{prefix}{name}.")
            for item in items:
                if isinstance(item, _Lenient):
                    names += item.ignored_fields(inner)
        return sorted(set(names))


class StreamOptions(_Lenient):
    include_usage: bool = Field(False, description="Send a last chunk carrying the request's usage.")
    continuous_usage_stats: bool = Field(False, description="vLLM extension: every chunk carries the usage so far.")


class _VllmFields(BaseModel):
    """vLLM's request extensions beyond the sampling ones: the prompt's truncation and the answer's ids are served;
    what tandem cannot honour is refused unless at its default; what changes nothing here is ignored."""

    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_UINT32, description="Extension (vLLM): keep this many tokens of the prompt (-1: as many as the context holds less one), cut on `truncation_side`; more than the context is a 400.")
    truncation_side: Literal["left", "right"] | None = Field(None, description="Extension (vLLM): with `truncate_prompt_tokens`, `left` keeps the last tokens, `right` the first (default: the tokenizer's side).")
    request_id: str | None = Field(None, min_length=1, max_length=256, description="Extension (vLLM): the answer's id is `cmpl-` / `chatcmpl-` and this (default: the `X-Request-Id` header, which Serve's proxy sets when the client does not).")
    return_tokens_as_token_ids: bool = Field(False, description="Extension (vLLM): logprobs name each token as `token_id:N` (tokens whose text is not valid UTF-8 stay identifiable).")
    cache_salt: str | None = Field(None, min_length=1, max_length=128, description="Extension (vLLM): a request reuses prefill KV (the prompt cache, prefix sharing, vLLM's prefix cache) only from requests of the same salt, so a tenant cannot learn from timing what another sent; at most 128 characters, none of @ / \\ or NUL (vLLM's rule).")
    priority: Literal[0] = not_served(0, "priority scheduling (vLLM refuses a priority other than 0 too unless started with a priority policy)")
    logprob_token_ids: None = not_served(None, "logprobs of chosen token ids (use logprobs / top_logprobs)")
    repetition_detection: None = not_served(None, "ending on detected repetition (it would change the output)")
    watermarking: Literal[False] = not_served(False, "watermarking (it would change the output)")
    kv_transfer_params: None = not_served(None, "KV transfer (disaggregated prefill connectors)")
    ec_transfer_params: None = not_served(None, "encoder-cache transfer")
    mm_payload: None = not_served(None, "multimodal input (the target is a text model)")
    length_penalty: float | None = ignored("beam search's length penalty (beam search is not served).")
    spaces_between_special_tokens: bool | None = ignored("the target's fast tokenizer writes special tokens' text as it is.")
    stream_interval: int | None = ignored("tokens per streamed chunk (tandem streams each round's tokens).")
    session_id: str | None = ignored("a session identity across requests.")
    vllm_xargs: dict | None = ignored("arguments of custom logits processors (none are installed).")
    return_token_offsets: bool | None = ignored("vLLM serves it on its render routes only.")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, keep: int | None) -> int | None:
        if keep == 0:
            raise ValueError("must be -1 (as much as the context holds) or at least 1 (a prompt cannot be empty)")
        return keep

    def truncated(self, ids: list[int], context: int, tokenizer_side: str) -> list[int]:
        """The prompt's ids cut as `truncate_prompt_tokens` asks (vLLM's rule; ApiError past the context)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep > context:
            raise ApiError(400, f"truncate_prompt_tokens: {keep} is more than the context of {context} tokens",
                           param="truncate_prompt_tokens")
        keep = context - 1 if keep == -1 else keep
        if len(ids) <= keep:
            return ids
        return ids[-keep:] if (self.truncation_side or tokenizer_side) == "left" else ids[:keep]


class _Common(_Lenient, _VllmFields, StructuredFields):
    """Fields of both endpoints; `null` for any field means its default."""

    model: str = Field(description="The served model id (see GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1, le=MAX_UINT32, description="Most tokens to generate (default: the server's `default_max_tokens`, within the context length).")
    temperature: Annotated[float, WithJsonSchema(_TEMPERATURE_SCHEMA)] = Field(1.0, ge=0.0, le=2.0, description=f"Softmax temperature; 0 is greedy decoding, else at least {MIN_POSITIVE_FLOAT}.")
    top_p: float = Field(1.0, ge=MIN_POSITIVE_FLOAT, le=1.0, description="Nucleus sampling: keep the most likely tokens holding this much probability.")
    top_k: int = Field(0, ge=-1, le=MAX_UINT32, description="Extension: keep the k most likely tokens (0 or -1 keeps all).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Seed of a reproducible sample (random when unset).")
    stop: Annotated[str | list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = Field(None, description=f"Up to {MAX_STOP} non-empty stop strings; the text ends before the first one.")
    stream: bool = Field(False, description="Answer with server-sent events, one per group of new tokens.")
    stream_options: StreamOptions | None = Field(None, description="With `stream`: usage reporting.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past the end-of-sequence token.")
    num_speculative_tokens: int | None = Field(None, ge=0, le=32, description="Extension: cap on γ (draft length) for this request; 0 is plain decoding.")
    return_token_ids: bool = Field(False, description="Extension: each choice also carries the generated token ids.")
    prediction: Prediction | None = Field(None, description="OpenAI's Predicted Outputs (on completions too, an extension): text the answer is expected to repeat in large part, drafted where the server speculates; the answer is the same with or without it, and usage's `completion_tokens_details` says how much of it the answer holds.")
    n: int = Field(1, ge=1, le=MAX_N, description=f"Choices to generate (at most {MAX_N}): choice i is its own session with seed + i; usage counts the prompt once.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from the logit of every token already in the output (-2 .. 2).")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from a token's logit once per occurrence in the output (-2 .. 2).")
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0, description="Extension (vLLM): a token of the prompt or output has its logit divided by this when positive, multiplied when negative; 1 is off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Extension (vLLM): drop tokens less likely than min_p times the most likely one (served with speculation).")
    min_tokens: int = Field(0, ge=0, le=MAX_UINT32, description="Extension (vLLM): EOS and stop_token_ids are held back until this many tokens are generated (at most max_tokens).")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=MAX_TOKEN_LIST, description="Token id (a string, as OpenAI sends it) -> added to its logit (-100 .. 100); served with speculation.")
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_UINT32)]] | None = Field(None, max_length=MAX_TOKEN_LIST, description="Extension (vLLM): token ids that end generation (kept in `token_ids`).")
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_BAD_WORDS, description="Extension (vLLM): words never generated (each tokenized as vLLM does: as it is and after a space).")
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=MAX_UINT32)]] | None = Field(None, min_length=1, description="Extension (vLLM): only these token ids may be generated.")
    logprobs_mode: LogprobsMode = Field("raw_logprobs", description="Extension (vLLM's names): where `logprobs` come from: `raw_logprobs`, the target's raw logits; `processed_logprobs`, the distribution each token was drawn from (logits processors, then temperature, min_p, top_k, top_p; greedy: the processors alone). The vLLM backend serves its server's `logprobs_mode` only.")
    include_stop_str_in_output: bool = Field(False, description="Extension (vLLM): the text keeps the stop string that ended it (and the text of a final stop token id or EOS); streamed text is then not held back.")
    skip_special_tokens: bool = Field(True, description="Extension (vLLM): special tokens' text is left out of the output; false writes it (an ending EOS's text only with include_stop_str_in_output).")
    use_beam_search: Literal[False] = not_served(False, "beam search")
    user: str | None = ignored("an end-user id (OpenAI's abuse monitoring).")
    metadata: dict[str, str] | None = ignored("stored-completion tags.")
    store: bool | None = ignored("tandem stores no completions.")
    service_tier: str | None = ignored("there is one tier.")
    prompt_cache_key: str | None = ignored("a prompt-cache routing hint.")
    safety_identifier: str | None = ignored("an end-user id (OpenAI's abuse monitoring).")

    @field_validator("stop", mode="before")
    @classmethod
    def _strings(cls, stop: Any) -> Any:
        if isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            return stop
        raise ValueError("must be a string or a list of strings")

    @field_validator("top_k")
    @classmethod
    def _minus_one_keeps_all(cls, top_k: int) -> int:
        return 0 if top_k == -1 else top_k

    @field_validator("temperature", "top_p")
    @classmethod
    def _float32(cls, value: float) -> float:
        """The value protobuf's float carries, so that the drafter (reached through Ray) and the verifier
        (through protobuf) process p and q with the same number."""
        if 0.0 < value < MIN_POSITIVE_FLOAT:
            raise ValueError(f"must be 0 or at least {MIN_POSITIVE_FLOAT} (smaller values cannot be carried)")
        return struct.unpack("f", struct.pack("f", value))[0]

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()) or int(key) > MAX_UINT32:
                raise ValueError(f"keys must be token ids (non-negative integers as strings); got {key[:32]!r}")
        return bias

    def processor_fields(self, tokenizer) -> dict:
        """The logits processors' `SamplingParams` keywords (`bad_words` tokenized with `tokenizer`)."""
        return dict(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, min_p=self.min_p, min_tokens=self.min_tokens,
                    logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                    stop_token_ids=list(dict.fromkeys(self.stop_token_ids or [])),
                    bad_words=tokenize_bad_words(tokenizer, self.bad_words or []),
                    allowed_token_ids=self.allowed_token_ids)

    def logprob_fields(self) -> dict:
        """`SamplingParams.logprobs` (None: none asked) and `logprobs_mode`."""
        return dict(logprobs=self.num_logprobs(), logprobs_mode=self.logprobs_mode)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def usage_options(self) -> StreamOptions:
        return self.stream_options or StreamOptions()


def _is_integer(value: Any) -> bool:
    """An integer as JSON Schema counts them (1.0 is one), not a boolean."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: Annotated[str | list[int] | list[str] | list[list[int]], WithJsonSchema(_PROMPT_SCHEMA)] = Field(description=f"A string, token ids (each below the vocabulary size), or a batch of up to {MAX_PROMPTS} of either (choice p * n + j is prompt p's choice j, as in vLLM).")
    max_tokens: int | None = Field(None, ge=0, le=MAX_UINT32, description="Most tokens to generate (default: the server's `default_max_tokens`, within the context length); 0 only with `echo`: the prompt is scored, nothing generated (lm-evaluation-harness's loglikelihood: `echo`, `logprobs: 1`, `max_tokens: 0`).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=f"Each generated token's log probability, with a dict of it and the N (0 .. {MAX_LOGPROBS}) most likely tokens at its position (vLLM's answer); with `echo`, the prompt's tokens come first (the first one's logprob is null) and the prompt is scored with N top ones unless `prompt_logprobs` says otherwise.")
    echo: bool = Field(False, description="The prompt's text goes before each choice's text (with `logprobs`, its tokens' log probabilities before the generated ones': the target's raw log-softmax as it prefills the prompt).")
    add_special_tokens: bool = Field(True, description="Extension (vLLM): a text prompt is tokenized with the tokenizer's special tokens (BOS) where it adds any.")
    prompt_embeds: None = not_served(None, "prompt embeddings (send text or token ids)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=f"Extension (vLLM): each choice's `prompt_logprobs`, one entry per prompt token (the first null), each a dict token id -> {{logprob, rank, decoded_token}} of the prompt token and the N (0 .. {MAX_LOGPROBS}) most likely tokens at its position; always the target's raw log-softmax. Not with `stream` (N > 0), as vLLM.")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Served where it equals n (or is unset): ranking more candidates by log probability is not served.")

    @model_validator(mode="after")
    def _best_of_is_n(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, f"best_of: not supported by this server: best_of ({self.best_of}) must equal n "
                                f"({self.n}); ranking candidates by log probability is not served",
                           param="best_of", code="unsupported_parameter")
        return self

    @model_validator(mode="after")
    def _scoring(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens: 0 is served with echo only (the prompt scored, nothing generated); "
                                "else at least 1", param="max_tokens")
        if self.stream and self.prompt_logprobs:
            raise ApiError(400, "prompt_logprobs: not available with stream (as in vLLM); use echo with logprobs",
                           param="prompt_logprobs")
        return self
    suffix: str | None = not_served(None, "insertion (suffix); only an empty one is served", max_length=0)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """The prompt's logprobs to compute (vLLM's rule): `prompt_logprobs`, else with `echo` the `logprobs`
        (None: none; streamed, only what echo sends)."""
        if self.stream and not self.echo:
            return None
        return self.prompt_logprobs if self.prompt_logprobs is not None else self.logprobs if self.echo else None

    def logprob_fields(self) -> dict:
        return {**super().logprob_fields(), "prompt_logprobs": self.num_prompt_logprobs()}

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the batch's."""
        batch = isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int)
        return list(self.prompt) if batch else [self.prompt]

    @staticmethod
    def echo_text(prompt: str | list[int], tokenizer) -> str:
        """What `echo` puts before a choice's text: its prompt's text (token ids decoded)."""
        return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt: Any) -> Any:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return prompt[0] if len(prompt) == 1 else cls._batch(prompt)
        if isinstance(prompt, list) and all(_is_integer(t) for t in prompt):
            return [int(t) for t in prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(_is_integer(t) for t in p)
                                                       for p in prompt):
            ids = [[int(t) for t in p] for p in prompt]
            return ids[0] if len(ids) == 1 else cls._batch(ids)
        raise ValueError("must be a string, a list of token ids, or a list of (non-empty) strings or of token-id lists")

    @staticmethod
    def _batch(prompts: list) -> list:
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request (got {len(prompts)})")
        return prompts

    @model_validator(mode="after")
    def _sessions_bounded(self) -> "CompletionRequest":
        if len(self.prompts()) * self.n > MAX_SESSIONS:
            raise ApiError(400, f"n: {len(self.prompts())} prompts x n {self.n} is over this server's {MAX_SESSIONS} "
                                "sessions per request; send the batch in parts", param="n")
        return self
