"""The router deployment: drives sessions (cluster.ray.router.Router) over the drafter and verifier pools.

Each request runs the router's loop in a worker thread; committed tokens come back through a queue
as they are verified and leave as text deltas. When the caller goes away (client disconnect), the
generator is cancelled, the session stops after its current round and its KV is released on the
verifier and the drafter.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from cluster.core.errors import InvalidRequestError, TandemError
from cluster.core.sampling import SamplingParams
from cluster.core.stats import GenerationResult, SpeculationStats
from cluster.core.stopping import output_text, text_options
from cluster.model import models
from cluster.ray.router import Router
from deployments.chunks import Chunk, ErrorChunk, FinishChunk, PromptChunk, SessionProgress, TokensChunk
from deployments.config import TandemAppConfig
from deployments.leases import ServeDrafterPool, ServeVerifierPool
from deployments.metrics import TandemMetrics
from deployments.pacing import StreamPacing, paced

log = logging.getLogger(__name__)


class IncrementalText:
    """Text deltas of a growing output that never take back what they sent: an incomplete UTF-8
    character and anything that may still turn into a stop string are held back until settled."""

    def __init__(self, tokenizer, stop: list[str], sent: str = "", stop_token_ids=(), min_tokens: int = 0,
                 options: dict | None = None):
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)  # a stop token id ends the output; its text is left out (vLLM)
        self.options = options or {}  # `cluster.core.stopping.text_options`: how the text is written
        # text that may still turn into a stop string is held back, unless the stop string is kept anyway
        self.holdback = 0 if self.options.get("include_stop") else max((len(s) for s in stop), default=1) - 1
        self.stop = stop
        self.min_tokens = min_tokens
        self.sent = sent
        self._settled = 0  # leading tokens whose text is wholly sent (`settled`)

    def full(self, token_ids: list[int]) -> str:
        """The whole text of `token_ids`, cut at the first stop string."""
        return self._text(token_ids)

    def _text(self, token_ids: list[int]) -> str:
        return output_text(self.tokenizer, token_ids, self.stop, self.stop_token_ids, self.min_tokens, **self.options)

    @classmethod
    def of(cls, tokenizer, params: SamplingParams, eos_token_ids, sent: str = "") -> "IncrementalText":
        """The text of a request decoded with `params` by a model whose EOS ids are `eos_token_ids`."""
        return cls(tokenizer, params.stop, sent=sent, stop_token_ids=params.stop_token_ids,
                   min_tokens=params.min_tokens, options=text_options(params, eos_token_ids))

    def update(self, token_ids: list[int]) -> str:
        text = self._text(token_ids)
        end = len(text) - self.holdback
        while end > len(self.sent) and text[end - 1] == "\ufffd":
            end -= 1
        return self._emit(text[:end])

    def settled(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the text sent so far covers: a token whose text is held
        back, or that ends in an incomplete character, is not covered yet."""
        for n in range(self._settled + 1, len(token_ids) + 1):
            text = self._text(token_ids[:n])
            if len(text.rstrip("\ufffd")) > len(self.sent):
                break
            if not text.endswith("\ufffd") and len(text) <= len(self.sent):
                self._settled = n
        return self._settled

    def finish(self, final_text: str) -> str:
        return self._emit(final_text)

    def _emit(self, text: str) -> str:
        if not text.startswith(self.sent):  # not seen with byte-level BPE; never take text back
            log.warning("detokenization changed already-streamed text; sending only what follows it")
        delta = text[len(self.sent):]
        if delta:
            self.sent = text
        return delta


@dataclass(frozen=True)
class _Committed:
    """Session thread -> the request's stream: tokens just committed and the figures at that point."""

    token_ids: list[int]
    stats: dict
    logprobs: list | None  # where asked: those of token_ids


class RouterDeployment:
    def __init__(self, config: dict, drafter_handle, verifier_handle):
        from transformers import AutoConfig

        self.config = TandemAppConfig.build(config)
        engine = self.config.engine
        path = models.resolve_model_path(engine.target, engine.cache_dir)
        self.tokenizer = models.load_tokenizer(path)
        model_config = AutoConfig.from_pretrained(path)
        drafter = ServeDrafterPool(drafter_handle) if drafter_handle is not None else None
        self.router = Router.from_config(self.config, engine, ServeVerifierPool(verifier_handle), drafter,
                                         self.tokenizer, model_config)
        self.max_context = model_config.max_position_embeddings
        slots = self.config.router.max_ongoing_requests
        self.executor = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="session")
        self.metrics = TandemMetrics(self.config.model_id)
        self._waiting = 0
        self._active = 0
        self.pacing = StreamPacing(self.config.stream_messages_per_s, self.sessions)
        self._last_counts = self._router_counts()

    def _router_counts(self) -> dict[str, int]:
        m = self.router.metrics
        return {"pipeline_stalls": m.pipeline_stalls, "bubble_fills": m.bubble_fills, "replays": m.replays,
                "drafter_fallbacks": m.drafter_fallbacks, "bubble_fill_hits": m.bubble_fill_hits,
                "stale_rounds": m.stale_rounds, "tree_rounds": m.tree_rounds, "tree_branch_hits": m.tree_branch_hits,
                "own_match_rounds": m.own_match_rounds, "own_match_accepted": m.own_match_accepted,
                "prediction_rounds": m.prediction_rounds, "prediction_accepted": m.prediction_accepted,
                "grammar_cut_drafts": m.grammar_cut_drafts}

    def _record_router_metrics(self) -> None:
        counts = self._router_counts()
        self.metrics.record_router({k: counts[k] - self._last_counts[k] for k in counts})
        self._last_counts = counts
        self.metrics.queue_depth.set(self._waiting)
        self.metrics.active_sessions.set(self._active)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, max_speculative_tokens: int | None = None,
                       resume: SessionProgress | None = None) -> AsyncIterator[Chunk]:
        """The session's chunks (`_session`), paced (`deployments.pacing`)."""
        async for chunk in paced(self._session(prompt_ids, params, max_speculative_tokens, resume), self.pacing.interval_s):
            yield chunk

    async def _session(self, prompt_ids: list[int], params: SamplingParams, max_speculative_tokens: int | None,
                       resume: SessionProgress | None) -> AsyncIterator[Chunk]:
        """Yields a `PromptChunk` first where `params.prompt_logprobs` asks for one, `TokensChunk`s, then a
        `FinishChunk`; a failed request yields an `ErrorChunk` instead of raising. `params`: as the ingress
        validated them, with their seed (not checked again here).
        `resume`: what the client was sent of this session by a router replica that died (the session
        goes on from there)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[PromptChunk | _Committed | GenerationResult | Exception] = asyncio.Queue()
        cancelled = threading.Event()
        t_start = time.perf_counter()
        first_token_s: list[float] = []
        resume = resume or SessionProgress()
        stats = SpeculationStats(**resume.stats) if resume.stats else SpeculationStats(num_prompt_tokens=len(prompt_ids))

        def on_tokens(tokens: list[int], logprobs: list | None) -> None:
            if not first_token_s:
                first_token_s.append(time.perf_counter() - t_start)
            loop.call_soon_threadsafe(queue.put_nowait, _Committed(tokens, asdict(stats), logprobs))

        def on_prompt(logprobs: list) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, PromptChunk(logprobs))

        def run() -> None:
            self._waiting -= 1
            self._active += 1
            try:
                result = self.router.generate(prompt_ids, params, on_tokens=on_tokens, cancelled=cancelled,
                                              max_speculative_tokens=max_speculative_tokens,
                                              output_prefix=resume.token_ids, stats=stats, validated=True,
                                              on_prompt=on_prompt)
                loop.call_soon_threadsafe(queue.put_nowait, result)
            except Exception as e:  # reported to the caller as data; logged here
                log.exception("request failed")
                loop.call_soon_threadsafe(queue.put_nowait, e)
            finally:
                self._active -= 1

        self._waiting += 1
        self.executor.submit(run)
        text = IncrementalText.of(self.tokenizer, params, self.router.eos_token_ids, sent=resume.text)
        output: list[int] = list(resume.token_ids)
        try:
            while True:
                match await queue.get():
                    case PromptChunk() as prompt:
                        yield prompt
                    case _Committed(tokens, snapshot, logprobs):
                        output.extend(tokens)
                        delta = text.update(output)
                        yield TokensChunk(tokens, delta, snapshot, logprobs,
                                          0 if logprobs is None else text.settled(output))
                    case GenerationResult() as result:
                        stats = result.stats
                        decode_s = stats.total_s - (first_token_s[0] if first_token_s else stats.total_s)
                        inter_token = decode_s / (len(output) - 1) if len(output) > 1 else None
                        self.metrics.record_request(stats, result.finish_reason,
                                                    first_token_s[0] if first_token_s else None, inter_token)
                        self._record_router_metrics()
                        yield FinishChunk.of(result.finish_reason, text.finish(result.text), stats, len(prompt_ids),
                                             len(result.token_ids))
                        return
                    case error:
                        kind = "invalid_request_error" if isinstance(error, InvalidRequestError) else "server_error"
                        self.metrics.errors.inc(1, {"kind": kind})
                        message = str(error) if isinstance(error, TandemError) else f"generation failed: {error!r}"
                        yield ErrorChunk(kind, message)
                        return
        finally:
            cancelled.set()  # a no-op when finished; stops the session when the caller went away

    def sessions(self) -> int:
        """Requests this replica is generating or holding for a session thread."""
        return self._active + self._waiting

    def check_health(self) -> None:
        self._record_router_metrics()
