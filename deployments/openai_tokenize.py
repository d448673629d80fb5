"""vLLM's tokenizer routes, as its server answers them: `POST /tokenize` (a prompt, or a conversation through
the model's chat template, as the generation routes build their prompts) and `POST /detokenize`, and
`GET /version`. Clients written for `vllm serve` count tokens with them before they send a request."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from cluster.core.errors import InvalidRequestError
from deployments.openai_api import MAX_UINT32, _Lenient
from deployments.openai_chat import ChatMessage, TemplateFields
from deployments.openai_tools import MAX_TOOLS, ToolDef


class TokenizeRequest(_Lenient, TemplateFields):
    """POST /tokenize: `prompt` (completions' text) or `messages` (chat's conversation), one of them."""

    model: str | None = Field(None, description="The served model id; optional, as in vLLM.")
    prompt: str | None = Field(None, description="A text, tokenized as /v1/completions tokenizes a prompt.")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="A conversation, through the model's chat template as /v1/chat/completions applies it.")
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS, description="With `messages`: the tools the template lists.")
    add_special_tokens: bool = Field(True, description="With `prompt`: the tokenizer's special tokens (BOS) where it adds any.")
    return_token_strs: bool = Field(False, description="Also each token as the tokenizer spells it.")

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int = Field(description="How many tokens.")
    max_model_len: int = Field(description="The served context length.")
    tokens: list[int]
    token_strs: list[str] | None = Field(None, description="With `return_token_strs`.")


class DetokenizeRequest(_Lenient):
    """POST /detokenize."""

    model: str | None = Field(None, description="The served model id; optional, as in vLLM.")
    tokens: list[Annotated[int, Field(ge=0, le=MAX_UINT32)]] = Field(description="Token ids of the served model's vocabulary.")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="The tokens' text (special tokens included).")


class Version(BaseModel):
    version: str = Field(description="tandem's version.")


def tandem_version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def tokenize(body: TokenizeRequest, tokenizer, chat_ids, context: int) -> dict:
    """`chat_ids(messages, tools, template options)`: the generation routes' chat prompt."""
    if body.messages is not None:
        ids = chat_ids([m.template_message() for m in body.messages], body.tools, body.template_options())
    else:
        ids = list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs}


def detokenize(body: DetokenizeRequest, tokenizer, vocab_size: int) -> dict:
    """InvalidRequestError for an id outside the vocabulary."""
    bad = next((t for t in body.tokens if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"tokens: {bad} is not a token id of this model (its vocabulary has {vocab_size})")
    return {"prompt": tokenizer.decode(body.tokens)}
