"""Router failover: a client's stream outlives the router replica that carried it.

The router owns each session's committed tokens, so its death would lose every session it carries.
Nothing the session needs is lost with it, though: the ingress still holds the request (prompt,
sampling parameters with a concrete seed; sampling is keyed by position, so a resumed session
draws the same numbers) and everything it has already sent (token ids, text, speculation figures).
`resumable_stream` re-submits the session to a live router replica as that prefix (Serve starts a
replacement when none is left) and continues the same stream: no text repeated or missing, stop
strings seen across the resume point, the same final `usage`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import ray.exceptions
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.util import metrics

from cluster.core.sampling import SamplingParams
from deployments.chunks import Chunk, ErrorChunk, PromptChunk, SessionProgress, TokensChunk

log = logging.getLogger(__name__)

# What a call to a router replica raises when the replica (not the request) failed.
ROUTER_DEATHS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ReplicaUnavailableError,
                 DeploymentUnavailableError)


class FailoverMetrics:
    def __init__(self, model_id: str):
        self.failovers = metrics.Counter("tandem_router_failovers",
                                         "Sessions resumed on another router replica after theirs died.", ("model",))
        self.failovers.set_default_tags({"model": model_id})


async def resumable_stream(router, prompt_ids: list[int], params: SamplingParams, max_speculative_tokens: int | None,
                           max_resumes: int, resume_delay_s: float, failover_metrics: FailoverMetrics | None = None,
                           timeout_s: float | None = None) -> AsyncIterator[Chunk]:
    """The router's chunks for one request, resumed on another router replica when the one carrying it
    dies (at most `max_resumes` times; then one `ErrorChunk` of type "service_unavailable").
    Past the routers' queue bound: one `ErrorChunk` of type "overloaded"; past `timeout_s`: "timeout".
    Cancelled (its router session with it) when the caller goes away. `params` carry their seed
    (`SamplingParams.with_seed`, at the ingress): every attempt draws the same numbers."""
    progress = SessionProgress()
    attempt = 0
    prompt_sent = False  # the prompt's logprobs (a PromptChunk) reached the caller: a resume does not score again
    deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
    while True:
        stream = None
        try:
            step = params.model_copy(update={"prompt_logprobs": None}) if prompt_sent else params
            stream = router.options(stream=True).generate.remote(
                prompt_ids, step, max_speculative_tokens, progress if attempt else None)
            chunks = aiter(stream)
            while True:
                # the deadline covers the wait for the next chunk only: a timeout scope held across the
                # `yield` would cancel the caller's task wherever it is (writing the HTTP stream, say),
                # and the response would be cut off instead of ending with the "timeout" error event
                async with asyncio.timeout_at(deadline):
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        return
                if isinstance(chunk, TokensChunk):
                    progress.add(chunk)
                elif isinstance(chunk, PromptChunk):
                    prompt_sent = True
                yield chunk
        except BackPressureError:
            stream = None  # never assigned to a replica: nothing to cancel (cancel() would raise it again)
            yield ErrorChunk("overloaded", "the server is at capacity (its request queue is full); retry shortly")
            return
        except TimeoutError:
            yield ErrorChunk("timeout", f"the request did not finish within this server's limit of {timeout_s:g} s "
                                        f"({len(progress.token_ids)} tokens sent)")
            return
        except ROUTER_DEATHS as e:
            stream = None  # its replica is gone
            attempt += 1
            if attempt > max_resumes:
                log.error("request gave up after %d router failures; last: %s", attempt, e)
                yield ErrorChunk("service_unavailable", f"the router carrying this request failed {attempt} times "
                                                        f"(last: {type(e).__name__}); try again")
                return
            log.warning("router replica died mid-session (%s) after %d tokens: resuming on another replica "
                        "(%d of %d)", type(e).__name__, len(progress.token_ids), attempt, max_resumes)
            if failover_metrics is not None:
                failover_metrics.failovers.inc()
            await asyncio.sleep(resume_delay_s)
        finally:
            if stream is not None:
                stream.cancel()
