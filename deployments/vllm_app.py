"""The application for `engine.backend: vllm` (`build_vllm_app`): the verifier replicas
(`deployments.vllm_serving.TandemLLMServer`) behind the `Ingress` deployment, or, by default
(`vllm.direct_ingress`), replicas that are the ingress themselves (`DirectVLLMServer`: Ray Serve LLM's
"direct streaming" pattern with tandem's API routes, `deployments.ingress.IngressRoutes`)."""

from __future__ import annotations

import asyncio

from cluster.vllm.protocol import INLINE_ONLY, inline_matches
from deployments.assembly import ingress_deployment
from deployments.config import TandemAppConfig
from deployments.ingress import IngressRoutes
from deployments.ingress_app import app as ingress_app
from deployments.vllm_serving import TandemLLMServer, llm_config

DIRECT_MAX_ONGOING = 1024  # a direct-ingress replica takes every request; its own bound refuses the excess (503)


class _OwnSessions:
    """What `deployments.failover.resumable_stream` calls a router handle with, for a replica that serves its
    own API: `options(stream=True).generate.remote(...)` runs `server.generate` in this process. Past the
    admission bound (the verifier's `max_ongoing_requests` + its queue) a session is refused as "overloaded",
    as Serve's handle would refuse it."""

    def __init__(self, server: "TandemLLMServer", limit: int):
        self.server, self.limit = server, limit

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, *args):
        if self.server.open_sessions >= self.limit:
            from ray.serve.exceptions import BackPressureError

            raise BackPressureError(num_queued_requests=self.server.open_sessions, max_queued_requests=self.limit)
        return _OwnStream(self.server.generate(*args))


class _OwnStream:
    def __init__(self, chunks):
        self.chunks = chunks

    def __aiter__(self):
        return self.chunks

    def cancel(self) -> None:  # the caller stopped reading: the session's own cleanup (vLLM aborts the request)
        asyncio.get_running_loop().create_task(self.chunks.aclose())


class DirectVLLMServer(TandemLLMServer, IngressRoutes):
    """A verifier replica that is also the application's ingress (`vllm.direct_ingress`): the OpenAI and gRPC
    routes run in the replica that holds vLLM's engine client, as vLLM's own server runs them beside its
    engine (Ray Serve LLM's "direct streaming" pattern, with tandem's API). A streamed chunk crosses no Serve
    hop between the ingress and the session; a replica's death ends its streams (no resume on another
    replica: the `Ingress` deployment's failover needs the two apart)."""

    async def __init__(self, llm_config, *, tandem: dict, **kwargs):
        await TandemLLMServer.__init__(self, llm_config, tandem=tandem, **kwargs)
        config = TandemAppConfig.build(tandem["config"])
        queued = max(0, config.verifier.max_queued_requests if config.verifier.max_queued_requests != -1
                     else config.router.max_queued_requests)
        IngressRoutes.__init__(self, tandem["config"], _OwnSessions(self, config.verifier.max_ongoing_requests + queued))

    async def __serve_build_asgi_app__(self):
        return ingress_app  # its routes call IngressRoutes' methods on this replica


def build_vllm_app(config: TandemAppConfig):
    """The application for `engine.backend: vllm`: ingress → vLLM verifier replicas."""
    from ray import serve
    from ray.serve.llm import build_llm_deployment

    plain = config.model_dump(mode="json")
    engine = config.engine.model_dump(mode="json")
    engine.update(backend="torch")  # the drafter's own models run on tandem's runner
    matches = inline_matches(config.engine)
    tandem = {"config": plain, "speculative": config.speculative, "engine": engine,
              # proposers ngram and suffix draft in vLLM's step only; the hybrid's long matches too, its other rounds remotely
              "drafter": config.engine.proposer not in INLINE_ONLY, "max_k": config.engine.num_speculative_tokens,
              "matches": matches.model_dump(mode="json") if matches else None,
              "drafter_placement": config.drafter.placement.model_dump(mode="json"),
              "overlap": config.vllm.overlap, "wait_s": config.vllm.wait_s, "on_miss": config.vllm.on_miss,
              "wait_first": config.vllm.wait_first}
    if config.vllm.direct_ingress:  # the replicas are the ingress: Serve's proxy calls them directly
        options = llm_config(config).deployment_config
        return build_llm_deployment(llm_config(config), name_prefix="Verifier:", bind_kwargs={"tandem": tandem},
                                    deployment_cls=serve.ingress()(DirectVLLMServer),
                                    override_serve_options={"max_ongoing_requests": DIRECT_MAX_ONGOING,
                                                            "max_queued_requests": -1,
                                                            "health_check_timeout_s": options["health_check_timeout_s"]})
    verifier = build_llm_deployment(llm_config(config), name_prefix="Verifier:", deployment_cls=TandemLLMServer,
                                    bind_kwargs={"tandem": tandem})
    return ingress_deployment(config, plain, verifier)  # the replicas drive their sessions: no router
