"""Sampling parameters, logits processing and position-keyed random numbers.

The same `probabilities()` is applied to the target's logits (p) and the draft's logits (q), so the
rejection test compares like with like. Random numbers come from (request seed, token position,
stream): a seeded request draws the same numbers at a position however its tokens are grouped into rounds,
so it is reproducible wherever the same positions are drafted with the same drafts (in process, and plain
decoding everywhere); where drafting overlaps verification, timing decides which positions are drafted (a
late draft becomes a plain step), and the tokens follow the target's distribution without repeating.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Sequence
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.core.errors import InvalidRequestError, validation_message
from cluster.core.grammar import StructuredOutputs

MAX_TOKEN_LIST = 1024  # logit_bias entries, stop_token_ids
MAX_PREDICTION = 1 << 15  # tokens of a prediction (OpenAI's Predicted Outputs)
MAX_LOGPROBS = 20  # most likely alternatives returned per token (OpenAI's and vLLM's bound)
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]  # vLLM's names (`cluster.core.logprobs`)


FLOAT32_MAX = torch.finfo(torch.float32).max  # what a logit past float32's range is kept at (processors, probabilities)


class SamplingParams(BaseModel):
    """How one request is decoded. `temperature == 0` is greedy decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(64, ge=0, description="Most tokens to generate (the stop reason is then 'length'); 0 generates none: the prompt is only prefilled and scored (`prompt_logprobs`), no decoding loop runs.")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="Softmax temperature; 0 means greedy (argmax).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep the smallest set of tokens with this much probability.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens; 0 keeps all.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seed for reproducible sampling; random when unset.")
    stop: list[str] = Field(default_factory=list, max_length=16, description="Stop strings; the text ends before the first one.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    # logits processors (`cluster.core.processors`; vLLM's names, ranges and semantics); the defaults are off
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from a token's logit once it is in the output.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from a token's logit per occurrence in the output.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0, description="A token of the prompt or output has its logit divided by this when positive, multiplied when negative; 1 is off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p times the most likely one (after temperature).")
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(default_factory=dict, max_length=MAX_TOKEN_LIST, description="Token id -> added to its logit (-100 .. 100).")
    min_tokens: int = Field(0, ge=0, description="Hold back EOS and stop_token_ids until the output has this many tokens.")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=MAX_TOKEN_LIST, description="Token ids that end generation (kept in the output, as EOS).")
    bad_words: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=64)]] = Field(default_factory=list, max_length=128, description="Token sequences never generated: a sequence's last token is masked where the output ends with the rest of it.")
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1, max_length=1 << 20, description="Only these token ids may be generated.")
    structured_outputs: StructuredOutputs | None = Field(None, description="A grammar the output follows (JSON schema, JSON object, regex, choice, EBNF): a token mask at every position (`cluster.core.grammar`).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Return each output token's log probability and its this many most likely alternatives; None: none (nothing computed).")
    logprobs_mode: LogprobsMode = Field("raw_logprobs", description="Which distribution `logprobs` come from (vLLM's names): `raw_logprobs`, the target's raw logits; `processed_logprobs`, the one the token was drawn from (processors, temperature, min_p, top-k, top-p).")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Return each prompt token's log probability (all but the first) and its this many most likely alternatives, computed by the verifier as it prefills the prompt; always the log-softmax of the target's raw logits (vLLM's prompt logprobs skip the processors in any mode); None: none.")
    cache_salt: str | None = Field(None, min_length=1, max_length=128, description=(
        "vLLM's prefix-cache salt: prefill KV is reused only from requests with the same salt (the torch backend's "
        "prompt cache and shared prefills, vLLM's prefix cache); None: only from unsalted ones. Output is unchanged. "
        "vLLM's rule: at most 128 characters, none of @ / \\ or NUL."))
    prediction: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1, max_length=MAX_PREDICTION, description=(
        "OpenAI's Predicted Outputs: token ids the output is expected to repeat (a file being edited): drafts "
        "wherever the served configuration speculates (`drafts.prediction`). Output is unchanged."))
    # how the output's text is written (the tokens are the same either way; vLLM's names)
    include_stop_str_in_output: bool = Field(False, description="The text keeps the stop string that ended it (and a final stop token id's or EOS's text), as vLLM does.")
    skip_special_tokens: bool = Field(True, description="Special tokens' text is left out of the output text.")
    # set by the decoding engine for a session, not by clients (`for_session`)
    prompt_length: int | None = Field(None, ge=0, description="Internal: how many leading committed tokens are the prompt (None: those a session opens with).")
    eos_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=64, description="Internal: the model's end-of-sequence ids (held back by min_tokens).")

    @field_validator("cache_salt")
    @classmethod
    def _salt_as_vllm(cls, salt: str | None) -> str | None:
        if salt is not None and any(c in salt for c in "@/\\\0"):
            raise ValueError("must not contain '@', '/', '\\' or NUL (vLLM's rule)")
        return salt

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str]) -> list[str]:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p")
    @classmethod
    def _finite(cls, value: float) -> float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("must be a finite number")
        return value

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether any processor of `cluster.core.processors` acts (min_p acts in `probabilities`)."""
        return bool(self.penalizes or self.logit_bias or self.min_tokens or self.bad_words
                    or self.allowed_token_ids is not None or self.structured_outputs is not None)

    @property
    def vllm_refused_fields(self) -> list[str]:
        """The set processor fields the vLLM backend does not serve: vLLM refuses `min_p` and `logit_bias`
        with speculative decoding (`SamplingParams._validate_spec_decode`). The torch backend serves both."""
        return [name for name, on in (("min_p", self.min_p > 0.0), ("logit_bias", bool(self.logit_bias))) if on]

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id the processors name lies in the vocabulary (InvalidRequestError otherwise)."""
        for name in ("logit_bias", "stop_token_ids", "allowed_token_ids", "bad_words", "prediction"):
            value = getattr(self, name) or ()
            ids = [t for word in value for t in word] if name == "bad_words" else list(value)
            if any(t >= vocab_size for t in ids):
                raise InvalidRequestError(f"{name}: token ids must lie in [0, {vocab_size})")

    def for_session(self, prompt_length: int, eos_token_ids) -> "SamplingParams":
        """A copy carrying what the processors need of the session (its prompt length, the model's EOS ids);
        itself when no processor acts. Set by whoever opens the session on the verifier and the drafter."""
        if not self.processes_logits:
            return self
        return self.model_copy(update={"prompt_length": prompt_length, "eos_token_ids": sorted(set(eos_token_ids))})

    @classmethod
    def build(cls, **kwargs) -> "SamplingParams":
        """Validate user input; errors become one clear `InvalidRequestError` line. Done once per request
        where it enters (the Serve ingress, the in-process CLI) and on the verifier's gRPC port; every
        hop between carries the validated object as it is (pickled through Serve and Ray)."""
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise InvalidRequestError(validation_message(e)) from None

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed (drawn from the OS when unset), fixed for the whole request; itself
        when it has one. Not validated again (`model_copy`)."""
        if self.seed is not None:
            return self
        return self.model_copy(update={"seed": int.from_bytes(os.urandom(8), "little") >> 1})


def prediction_token_ids(text: str, tokenizer) -> list[int] | None:
    """A prediction's text as the target's token ids, tokenized as an answer's text (no special tokens), where a
    request enters (the HTTP API, the CLI); None when empty. InvalidRequestError past `MAX_PREDICTION` tokens."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
    if len(ids) > MAX_PREDICTION:
        raise InvalidRequestError(f"prediction: {len(ids)} tokens is more than this server's {MAX_PREDICTION}")
    return ids or None


def prediction_seed(seed: int | None, temperature: float, prediction: Sequence[int] | None) -> int | None:
    """The seed a request with a `prediction` samples with: a sampled request's seed mixed with its prediction,
    so its random numbers are independent of its drafts even where the prediction is an earlier output of the
    same seed (verification's acceptance and recovery would otherwise draw the numbers that made those drafts,
    and the output would not follow the target's distribution). The same request gives the same seed; greedy
    or unseeded requests (a seed drawn later, from the OS) keep theirs. Applied once, where a request enters."""
    if seed is None or temperature == 0.0 or not prediction:
        return seed
    digest = hashlib.sha256(f"{seed}:{','.join(map(str, prediction))}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p (vLLM's place for it), then top-k, then top-p (transformers' order), then
    softmax. `logits` are processed already (`cluster.core.processors`) where processors act.

    logits  # [n, vocab_size] -> probs  # [n, vocab_size], float32
    """
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.repetition_penalty < 1.0:  # processed logits up to FLOAT32_MAX (a penalty near 0): kept finite after
        logits = logits.clamp(max=FLOAT32_MAX)  # the temperature too (+inf would make the softmax NaN)
    if params.min_p > 0.0:
        probs = logits.softmax(dim=-1)  # [n, vocab_size]
        threshold = probs.amax(dim=-1, keepdim=True) * params.min_p  # [n, 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


class RandomStream(enum.IntEnum):
    """Independent random streams at one token position."""

    ACCEPT = 1  # the uniform of the acceptance test
    TARGET = 2  # a recovered or bonus token (and plain target sampling)
    DRAFT = 3  # the draft model's own sample


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_generator(seed: int, position: int, stream: RandomStream) -> torch.Generator:
    """A CPU generator determined by (seed, position, stream) alone."""
    key = _splitmix64(_splitmix64(_splitmix64(seed) ^ position) ^ int(stream))
    return torch.Generator().manual_seed(key >> 1)


def uniform(seed: int, position: int, stream: RandomStream) -> float:
    return torch.rand((), generator=position_generator(seed, position, stream)).item()


def sample(probs: torch.Tensor, seed: int, position: int, stream: RandomStream) -> int:
    """Draw one token id from `probs  # [vocab_size]` by inverse CDF with a position-keyed uniform."""
    cdf = probs.double().cumsum(dim=-1)  # [vocab_size]
    u = uniform(seed, position, stream) * cdf[-1].item()
    index = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64, device=cdf.device), right=True).item())
    index = min(index, probs.shape[-1] - 1)
    while probs[index] <= 0 and index > 0:  # never land on a zero-probability id through rounding
        index -= 1
    return index
