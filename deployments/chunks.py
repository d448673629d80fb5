"""The messages of one request's stream, router deployment -> ingress, and what the ingress has sent of it.

A router (`deployments/router.py`; on vLLM the verifier replica, `TandemLLMServer.generate`) yields,
where the request asks for prompt logprobs, one `PromptChunk` first, then `TokensChunk`s as tokens are
committed (paced: `deployments.pacing`), then one `FinishChunk`; a refused or failed request yields
one `ErrorChunk` instead (or after the tokens it sent).
The ingress and its failover tell them apart by type. They cross Serve handles (pickled), so they are
plain frozen dataclasses of builtins. Inside a vLLM verifier replica, the engine's side of a session
(`generate_tokens`) yields the `PromptChunk` (where asked), `StepTokens`, then `StepFinish` (or an
`ErrorChunk`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cluster.core.logprobs import TokenLogprob
from cluster.core.stats import SpeculationStats


@dataclass(frozen=True)
class PromptChunk:
    """The prompt's logprobs (`SamplingParams.prompt_logprobs`): one per prompt token after the first, the
    target's raw log-softmax with the token's rank (`cluster.core.logprobs.prompt_logprobs`). Sent once,
    before any token (a resumed session does not send it again)."""

    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class TokensChunk:
    """Tokens committed since the previous chunk, the text they settle (an incomplete character or a
    possible stop string is held back), and the speculation figures so far (`SpeculationStats` fields).
    Where the request asks for logprobs: those of `token_ids`, and how many of the session's output tokens
    the text sent so far covers (`settled`: the ingress sends a token's logprob with the chunk that
    carries its text, the rest with the finish)."""

    token_ids: list[int]
    text: str
    stats: dict
    logprobs: list[TokenLogprob] | None = None
    settled: int = 0


@dataclass(frozen=True)
class FinishChunk:
    """The last chunk of a request that ran to its end: the text held back until then, why it ended
    (`stop`, `length`, ...), its final figures (`SpeculationStats` fields, `acceptance_rate` and
    `mean_accepted_length` included) and its usage."""

    finish_reason: str
    text: str
    stats: dict
    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, finish_reason: str, text: str, stats: SpeculationStats, prompt_tokens: int,
           completion_tokens: int) -> "FinishChunk":
        return cls(finish_reason, text, {**asdict(stats), "acceptance_rate": stats.acceptance_rate,
                                         "mean_accepted_length": stats.mean_accepted_length},
                   prompt_tokens, completion_tokens)


@dataclass(frozen=True)
class ErrorChunk:
    """A refused or failed request. `type`: `invalid_request_error`, `server_error`, `overloaded`,
    `service_unavailable` or `timeout` (the ingress maps it to an HTTP status and a gRPC code)."""

    type: str
    message: str


Chunk = PromptChunk | TokensChunk | FinishChunk | ErrorChunk


@dataclass(frozen=True)
class StepTokens:
    """A vLLM verifier replica -> its router: the tokens one engine step committed (and their logprobs,
    where asked)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class StepFinish:
    """A vLLM verifier replica -> its router: the request ended; vLLM's speculation figures of it."""

    finish_reason: str
    drafted: int = 0
    accepted: int = 0


@dataclass
class SessionProgress:
    """What the client has been sent of one session: the router's starting point on a resume (failover)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stats: dict | None = None  # the speculation figures so far (SpeculationStats fields)

    def add(self, chunk: TokensChunk) -> None:
        self.token_ids += chunk.token_ids
        self.text += chunk.text
        self.stats = chunk.stats
