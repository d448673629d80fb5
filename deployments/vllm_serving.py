"""Serving with vLLM as the target engine (`engine.backend: vllm`): the same OpenAI and gRPC APIs.

The verifier pool's replicas are Ray Serve LLM's `LLMServer` (its `LLMConfig`, builder, placement group
per replica and vLLM engine startup, reused as they are) extended by `TandemLLMServer`. vLLM owns the
decoding loop, so the replica also drives its sessions (`TandemLLMServer.generate`: text deltas, stop
strings, metrics, resumes after a failover): no router deployment. By default the replicas serve the API
themselves (`deployments.vllm_app.DirectVLLMServer`); with `vllm.direct_ingress: false` the ingress
deployment calls them (BENCHMARKS.md measured each hop's CPU per token). Streams are paced
(`deployments.pacing`).

- vLLM owns the target and its decoding loop; tandem's drafter proposes through the custom proposer
  class (`cluster.vllm.proposer.TandemProposer`), a client of the replica's `Drafter` actor.
- Each replica has its own drafter actor (`drafter.placement`: the cheap accelerator), outside the
  replica's placement group: vLLM's proposer runs in the engine's worker process and must know its
  drafter before requests arrive, so drafters are paired with verifier replicas.
- `generate_tokens` is the session's way into vLLM: it registers the prompt with the drafter
  (the draft's prefill runs while the target prefills), submits the request with the session id as
  vLLM's request id (the proposer keys the drafter's session by it), streams the committed tokens,
  and ends the drafter's session when the request ends, finished, failed or cancelled (vLLM does not
  tell the proposer).
- The proposer's counters (hits, misses, plain `[]` rows, drafter failures) are Prometheus counters
  (`tandem_vllm_proposer_rows{kind=...}`), recorded by the replica at each of Serve's health checks.

Placement: `verifier.placement` per rank; `tensor_parallel_size` ranks use vLLM's own tensor
parallelism inside the replica's placement group (on GPUs through Ray; on CPU vLLM's processes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import asdict

from cluster.core.config import EAGLE3
from cluster.core.logprobs import TokenLogprob
from cluster.core.sampling import SamplingParams
from cluster.core.stopping import eos_ids
from cluster.model import models
from cluster.ray.drafter import launch_drafter
from cluster.session.speculate import SpeculationStats
from cluster.vllm import reaper
from cluster.vllm.eagle3 import checked_eagle3_dir, eagle3_speculative_config
from cluster.vllm.engine import from_vllm_logprobs, to_vllm_params, to_vllm_prompt
from cluster.vllm.openmp import engine_processes_on_intel_openmp
from cluster.vllm.proposer import PROPOSER_CLASS
from cluster.vllm.protocol import (DrafterSpec, InlineMatches, RayDrafter, RequestKey, engine_draft_tokens,
                                   inline_matches, salt_group)
from cluster.vllm.worker import WORKER_EXTENSION
from deployments.chunks import ErrorChunk, FinishChunk, PromptChunk, SessionProgress, StepFinish, StepTokens, TokensChunk
from deployments.config import TandemAppConfig
from deployments.metrics import StatsGate, TandemMetrics
from deployments.pacing import StreamPacing, paced
from deployments.router import IncrementalText
from deployments.vllm_replica import LOCAL_MODEL_CALLBACK, skip_llm_telemetry_actor

log = logging.getLogger(__name__)
PROPOSER_STATS_TIMEOUT_S = 5.0  # the proposer-counter RPC made at each health check (metrics only)

PROPOSER_KINDS = ("hits", "misses", "matched_rows", "drafted_rows", "empty_rows", "empty_late", "empty_failed", "drafter_failures",
                  "proposer_errors", "pooled_rows", "pool_outputs", "eagle_rows", "prediction_rows",
                  "prediction_tokens", "prediction_accepted")


def llm_config(config: TandemAppConfig):
    """Ray Serve LLM's `LLMConfig` for the verifier replicas of `config` (engine.backend vllm)."""
    from ray.serve.llm import LLMConfig

    engine, vllm = config.engine, config.vllm
    path = models.resolve_model_path(engine.target, engine.cache_dir)
    on_gpu = config.verifier.placement.num_gpus > 0
    bundle = {"GPU": 1.0, "CPU": 1.0} if on_gpu else config.verifier.placement.bundle()
    engine_kwargs = {"dtype": engine.dtype, "max_model_len": vllm.max_model_len, "seed": 0,
                     "tensor_parallel_size": config.tensor_parallel_size, "enforce_eager": not vllm.compile,
                     "worker_extension_cls": WORKER_EXTENSION, "disable_log_stats": False}
    eagle3_matches = config.speculative and engine.proposer == EAGLE3 and engine.eagle3_matches
    if config.speculative and engine.proposer == EAGLE3:  # vLLM's own method on the exported draft, in its step
        draft_dir = checked_eagle3_dir(engine.draft, "engine.draft", engine.target, engine.cache_dir)
        engine_kwargs["speculative_config"] = eagle3_speculative_config(
            str(draft_dir), engine.num_speculative_tokens, inline_matches(engine) if eagle3_matches else None)
        if eagle3_matches:  # drafts of any length per row (tandem's matches): vLLM's synchronous scheduler
            engine_kwargs["async_scheduling"] = False
    elif config.speculative:
        engine_kwargs["speculative_config"] = {"method": "custom_class", "model": PROPOSER_CLASS,
                                               "num_speculative_tokens": engine_draft_tokens(engine)}
    schedule = vllm.schedule_for(engine_kwargs["speculative_config"]["method"]) if config.speculative else None
    if schedule and not eagle3_matches:  # γ by batch size (vLLM's dynamic speculative decoding; with tandem's
        engine_kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] = schedule  # matches: theirs)
    if config.speculative:
        engine_kwargs["per_request_spec_decode_metrics"] = "summary"  # each request's drafted / accepted
    engine_kwargs.update(vllm.engine_kwargs)
    env = {"VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP", "127.0.0.1"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": f"{vllm.kv_cache_space_gib:g}"}
    if config.tensor_parallel_size > 1 and not on_gpu:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(config.tensor_parallel_size))
    spec = config.verifier
    # the replicas drive their sessions (no router): the routers' admission bound applies to them
    queued = spec.max_queued_requests if spec.max_queued_requests != -1 else config.router.max_queued_requests
    deployment = {"max_ongoing_requests": spec.max_ongoing_requests, "max_queued_requests": queued,
                  # Serve LLM's own health-check timeout is 10 s: a CPU replica busy stepping (a drafter being
                  # replaced, another job on the machine) can take longer to answer, and three misses stop it
                  "health_check_period_s": spec.health_check_period_s, "health_check_timeout_s": 60, "ray_actor_options": {"num_cpus": 0},
                  "graceful_shutdown_wait_loop_s": spec.graceful_shutdown_wait_loop_s,
                  **spec.replica_options()}
    return LLMConfig(model_loading_config={"model_id": config.model_id, "model_source": str(path)},
                     callback_config={"callback_class": LOCAL_MODEL_CALLBACK},
                     placement_group_config={"bundles": [bundle] * config.tensor_parallel_size,
                                             "strategy": "STRICT_PACK"},
                     engine_kwargs=engine_kwargs, runtime_env={"env_vars": env}, deployment_config=deployment)


def _resumed(sampling: SamplingParams, done: int, remaining: int) -> SamplingParams | None:
    """The params of a session that goes on from prompt + `done` output tokens: vLLM sees those as
    prompt, so `min_tokens` counts on from them. Presence and frequency penalties count the output only,
    which vLLM cannot tell from the prompt any more: None (the caller fails loudly rather than differ)."""
    if done and (sampling.presence_penalty or sampling.frequency_penalty):
        return None
    return sampling.model_copy(update={"max_tokens": remaining, "min_tokens": max(0, sampling.min_tokens - done)})


def _delta_params(params: SamplingParams):
    """vLLM's params for a streamed request: each output carries only the new tokens. `prompt_logprobs` go
    through (vLLM serves them with speculative decoding: the prefill's logits, `logprobs_mode` aside); a
    scoring-only request (max_tokens 0) asks vLLM for one token, as vLLM's own server does, and drops it."""
    from vllm.sampling_params import RequestOutputKind

    if params.max_tokens == 0:
        params = params.model_copy(update={"max_tokens": 1})
    return to_vllm_params(params, output_kind=RequestOutputKind.DELTA, prompt_logprobs=params.prompt_logprobs)


def _prompt_logprobs(prompt_ids: list[int], entries, top: int) -> list[TokenLogprob]:
    """vLLM's prompt logprobs (None for the first token, then as a completion token's, with its rank)."""
    return from_vllm_logprobs(prompt_ids[1:], entries[1:], top, ranks=True)


def _server_base():
    from ray.serve.llm.deployment import LLMServer

    return LLMServer


class TandemLLMServer(_server_base()):
    """A verifier replica on vLLM: Ray Serve LLM's `LLMServer` plus tandem's drafter, and the sessions the
    ingress sends it (`generate`). `tandem`: the application's config (`config`, a `TandemAppConfig` as a
    dict) and what the replica's drafter and proposer need."""

    async def __init__(self, llm_config, *, tandem: dict, **kwargs):
        import ray
        from ray import serve
        from ray.util import metrics
        from transformers import AutoConfig

        config = TandemAppConfig.build(tandem["config"])
        path = models.resolve_model_path(config.engine.target, config.engine.cache_dir)
        self.tokenizer = models.load_tokenizer(path)
        self.eos_token_ids = eos_ids(AutoConfig.from_pretrained(path).eos_token_id)  # a final EOS's text is left out
        self.metrics = TandemMetrics(config.model_id)
        self.pacing = StreamPacing(config.stream_messages_per_s, lambda: self.open_sessions)
        self.drafter = None
        self.speculative = bool(tandem.get("speculative"))  # the rest of `tandem` is there when speculative
        # vLLM's own method (proposer 'eagle3'): no tandem proposer in the worker, no drafter, one γ for all requests
        self.vllm_method = None if not self.speculative else "eagle3" if config.engine.proposer == EAGLE3 else "custom_class"
        matches = InlineMatches.model_validate(tandem["matches"]) if tandem.get("matches") else None
        # tandem's matches in vLLM's EAGLE-3 proposer (cluster.vllm.eagle_matches): its counters, per-request caps
        self.eagle3_matches = self.vllm_method == "eagle3" and matches is not None
        name = None
        if self.tandem_proposer and tandem.get("drafter", True):  # the drafter loads its model while vLLM starts

            context = serve.get_replica_context()
            name = f"tandem-vllm-drafter-{context.app_name}-{context.replica_id.unique_id}"
            placement = tandem["drafter_placement"]
            self.drafter = launch_drafter(
                tandem["engine"], name=name, num_cpus=placement.get("num_cpus", 1),
                num_gpus=placement.get("num_gpus", 0), accelerator_type=placement.get("accelerator_type"),
                resources=placement.get("resources"), scheduling_strategy="DEFAULT",  # not in the replica's group
                max_restarts=-1)
        skip_llm_telemetry_actor()
        sockets = reaper.socket_files()  # the reaper removes the IPC socket files the engine's start leaves
        # vLLM's engine core and workers, started in super().__init__, inherit it; this process does not load it
        with engine_processes_on_intel_openmp(config.vllm.intel_openmp and config.verifier.placement.num_gpus == 0):
            await super().__init__(llm_config, **kwargs)
        # a replica Ray kills (a shutdown past its timeout, ray.kill, the OOM killer) takes its engine with it
        self.reaper = reaper.watch_engine(sockets_before=sockets)
        if self.tandem_proposer:
            tuning = {k: tandem[k] for k in ("overlap", "wait_s", "on_miss", "wait_first", "max_k")}
            if self.drafter is not None:
                await self.drafter.ready.remote()
                runtime = ray.get_runtime_context()
                spec = DrafterSpec(ray=RayDrafter(actor=name, namespace=runtime.namespace,
                                                  address=runtime.gcs_address, auth_mode=os.environ.get("RAY_AUTH_MODE")),
                                   registered=True, matches=matches, **tuning)
            else:  # free drafts only (proposers ngram, suffix): made in vLLM's step, no drafter
                spec = DrafterSpec(matches=matches, **tuning)
            await self.collective_rpc("tandem_configure", args=(spec.wire(),))
        elif self.eagle3_matches:
            await self.collective_rpc("tandem_eagle_matches", args=(
                matches.model_dump(mode="json"), config.engine.num_speculative_tokens, config.vllm.schedule_for("eagle3")))
        self.fix = (await self.collective_rpc("tandem_apply_fixes"))[0]  # every worker, before requests
        self.open_sessions = 0
        self.stats_gate = StatsGate()  # the proposer counters are read only when they can have moved
        self.proposer_rows = metrics.Counter(
            "tandem_vllm_proposer_rows", "vLLM proposer rows by outcome: hits (a draft continued the committed "
            "tokens), misses, drafted_rows, empty_rows (plain steps) and why (late, failed), drafter failures; "
            "pooled_rows (drafted from finished requests' outputs) and pool_outputs (outputs pooled); with vLLM's "
            "EAGLE-3 method, eagle_rows (its drafts kept) and matched_rows (a match's drafts instead); "
            "prediction_rows, _tokens and _accepted (drafted from requests' predictions, OpenAI's Predicted Outputs).",
            ("model", "kind"))
        self.proposer_rows.set_default_tags({"model": llm_config.model_id})
        self._last_stats: dict[str, int] = {}
        log.info("vLLM verifier replica: speculative %s (%s), rejection-sampler fix %s", self.speculative,
                 self.vllm_method, self.fix.get("state"))

    @property
    def tandem_proposer(self) -> bool:
        """Whether vLLM's worker runs tandem's proposer (`custom_class`): its drafter, configuration and counters."""
        return self.vllm_method == "custom_class"

    async def generate_tokens(self, session: str, prompt_ids: list[int], sampling: SamplingParams,
                              max_speculative_tokens: int | None = None):
        """Yields `StepTokens` per engine step, then `StepFinish`; a request this engine refuses yields one
        `ErrorChunk` instead. `sampling`: as the ingress validated them. `max_speculative_tokens` caps this
        request's drafts (0: plain decoding, no drafter session)."""
        if self.speculative and not sampling.greedy and self.fix.get("state") not in ("applied", "not needed"):
            yield ErrorChunk("invalid_request_error", f"sampled speculative decoding is refused on this vLLM "
                                                      f"({self.fix}); use temperature 0")
            return
        if self.vllm_method == "eagle3" and not self.eagle3_matches and max_speculative_tokens is not None \
                and sampling.max_tokens != 0:
            yield ErrorChunk("invalid_request_error", "num_speculative_tokens: this server drafts with vLLM's eagle3 "
                                                      "method, whose draft length is fixed for every request; leave it out")
            return
        self.open_sessions += 1
        self.stats_gate.open()
        started = None
        scoring = sampling.max_tokens == 0  # the prompt scored only: vLLM's one token is dropped, no drafts
        # vLLM's request id and the drafter's session
        session = str(RequestKey(session, 0 if scoring else max_speculative_tokens, salt_group(sampling.cache_salt)))
        # the draft's prefill runs while the target's does
        if self.drafter is not None and max_speculative_tokens != 0 and not scoring:
            started = self.drafter.start.remote(session, list(prompt_ids), sampling)
        try:
            finish, spec = None, None
            async for out in self.engine._engine_client.generate(to_vllm_prompt(prompt_ids, sampling),
                                                                  _delta_params(sampling), request_id=session):
                if sampling.prompt_logprobs is not None and out.prompt_logprobs:  # the first output only (DELTA)
                    yield PromptChunk(_prompt_logprobs(prompt_ids, out.prompt_logprobs, sampling.prompt_logprobs))
                completion = out.outputs[0]
                if scoring:
                    continue
                if completion.token_ids:
                    logprobs = None if sampling.logprobs is None else \
                        from_vllm_logprobs(completion.token_ids, completion.logprobs, sampling.logprobs)
                    yield StepTokens(list(completion.token_ids), logprobs)
                finish = completion.finish_reason or finish
                spec = getattr(completion, "spec_decode_metrics", None) or spec
            reason = "stop" if finish == "stop" else "length"
            if spec is None:
                yield StepFinish(reason)
            else:  # vLLM's per-request figures: steps by accepted draft tokens, drafts proposed
                yield StepFinish(reason, spec.num_draft_tokens, sum(j * n for j, n in enumerate(spec.histogram)))
        finally:
            self.open_sessions -= 1
            if started is not None:  # released after it started (a threaded actor may reorder the two calls)
                try:
                    await started
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - a dead drafter holds nothing; a
                    pass  # disconnect's cancellation may reach this wait too: the release must still be sent
                self.drafter.release.remote(session)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, max_speculative_tokens: int | None = None,
                       resume: SessionProgress | None = None):
        """The ingress's session: the same chunk protocol as `RouterDeployment.generate` (the ingress and its
        failover are shared): a `PromptChunk` where asked, `TokensChunk`s, then a `FinishChunk` (or an
        `ErrorChunk`), paced (`deployments.pacing`). `sampling`: as the ingress validated them (against
        vLLM's max_model_len too), with their seed. `resume`: what the client was sent by a replica that
        died (the session goes on from there)."""
        async for chunk in paced(self._session(prompt_ids, sampling, max_speculative_tokens, resume),
                                 self.pacing.interval_s):
            yield chunk

    async def _session(self, prompt_ids: list[int], sampling: SamplingParams, max_speculative_tokens: int | None,
                       resume: SessionProgress | None):
        resume = resume or SessionProgress()
        output = list(resume.token_ids)
        stats = SpeculationStats(**resume.stats) if resume.stats else SpeculationStats(num_prompt_tokens=len(prompt_ids))
        remaining = sampling.max_tokens - len(output)
        text = IncrementalText.of(self.tokenizer, sampling, self.eos_token_ids, sent=resume.text)
        session = f"tandem-{uuid.uuid4().hex}"
        t_start = time.perf_counter()
        first_token_s = None
        finish = "length"
        stream = None  # generate_tokens, while it runs
        try:
            if remaining > 0 or sampling.prompt_logprobs is not None:  # (a resume never scores the prompt again)
                # a resumed session goes on from prompt + what was sent (sampling is keyed by position)
                step = _resumed(sampling, len(output), remaining)
                if step is None:
                    self.metrics.errors.inc(1, {"kind": "server_error"})
                    yield ErrorChunk("server_error", "a session with presence or frequency penalties cannot be "
                                     "resumed exactly on the vLLM backend after a replica failed; retry the request")
                    return
                stream = self.generate_tokens(session, list(prompt_ids) + output, step, max_speculative_tokens)
                async for chunk in stream:
                    match chunk:
                        case ErrorChunk():
                            self.metrics.errors.inc(1, {"kind": chunk.type})
                            yield chunk
                            return
                        case PromptChunk():
                            yield chunk
                        case StepFinish():
                            finish = chunk.finish_reason
                            stats.drafted += chunk.drafted
                            stats.accepted += chunk.accepted
                        case StepTokens():
                            if first_token_s is None:
                                first_token_s = time.perf_counter() - t_start
                            output.extend(chunk.token_ids)
                            stats.num_generated_tokens = len(output)
                            delta = text.update(output)
                            yield TokensChunk(chunk.token_ids, delta, asdict(stats), chunk.logprobs,
                                              0 if chunk.logprobs is None else text.settled(output))
            stream = None
            stats.total_s += time.perf_counter() - t_start
            stats.num_generated_tokens = len(output)
            stats.rounds = max(0, len(output) - stats.accepted)  # a step commits its accepted drafts + 1
            final_text = text.full(output)
            decode_s = stats.total_s - (first_token_s or stats.total_s)
            self.metrics.record_request(stats, finish, first_token_s,
                                        decode_s / (len(output) - 1) if len(output) > 1 else None)
            yield FinishChunk.of(finish, text.finish(final_text), stats, len(prompt_ids), len(output))
        except Exception as e:  # reported to the caller as data; logged here
            log.exception("request failed")
            self.metrics.errors.inc(1, {"kind": "server_error"})
            yield ErrorChunk("server_error", f"generation failed: {e!r}")
        finally:
            if stream is not None:  # the caller went away (or failed): vLLM aborts the request
                await stream.aclose()

    async def _record_proposer(self) -> None:
        if not (self.tandem_proposer or self.eagle3_matches) or not self.stats_gate.due(self.open_sessions):
            return
        opened = self.stats_gate.opened
        try:  # bounded: the engine answers between steps, and a health check must not wait on metrics
            stats = (await asyncio.wait_for(self.collective_rpc("tandem_stats"), PROPOSER_STATS_TIMEOUT_S))[0]
        except Exception:  # noqa: BLE001 - metrics must not fail a request or a health check
            log.debug("tandem_stats", exc_info=True)
            return
        self.stats_gate.mark_read(opened)
        for kind in PROPOSER_KINDS:
            delta = int(stats.get(kind, 0)) - self._last_stats.get(kind, 0)
            if delta > 0:
                self.proposer_rows.inc(delta, {"kind": kind})
            self._last_stats[kind] = int(stats.get(kind, 0))

    async def proposer_stats(self) -> dict:
        return (await self.collective_rpc("tandem_stats"))[0] if self.tandem_proposer or self.eagle3_matches else {}

    async def drafter_stats(self) -> dict:
        return await self.drafter.stats.remote() if self.drafter is not None else {}

    def sessions(self) -> int:
        return self.open_sessions

    def processes(self) -> dict:
        """This replica's pid, its vLLM engine core's and the pid of the reaper that stops the engine if the replica
        is killed (`cluster.vllm.reaper`)."""
        return {"replica": os.getpid(), "engine": reaper.engine_cores(),
                "reaper": self.reaper.pid if self.reaper else None}

    async def check_health(self) -> None:
        # the engine only: a drafter that died or is restarting means plain steps, not a failed replica
        await super().check_health()
        await self._record_proposer()  # periodically (Serve's health checks), off the requests' path
        self.metrics.active_sessions.set(self.open_sessions)
