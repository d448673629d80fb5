"""The router: places each session on a verifier replica and a drafter, runs its session loop
(`cluster.session.loop`) over a gRPC stream and a Ray drafter port, and replays it when a replica fails.

Faults: a dead drafter switches the session to plain target decoding (same output); a dead verifier
replica gets the session replayed from its committed tokens onto another (or the restarted) replica.
Both are logged and counted in the router's `LoopMetrics`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from cluster.core.errors import InvalidRequestError, TandemError
from cluster.core.sampling import SamplingParams
from cluster.core.stats import GenerationResult, SpeculationStats
from cluster.core.stopping import StopChecker, eos_ids
from cluster.core.validation import validate_request
from cluster.session.loop import CostEstimates, LoopConfig, LoopMetrics, RoundTiming, SessionLoop, SessionState
from cluster.wire.codec import features_from_pb, logprobs_from_pb, params_to_pb
from cluster.wire.remote_ports import GrpcVerifierPort, RayDrafterPort
from cluster.wire.verifier_pool import StaticDrafter, StaticVerifierPool, VerifierReplicaHandle
from drafts.policy import SpeculationPolicy, SpeculationPolicyConfig
from drafts.routing import needs_features, own_match
from drafts.suffix import OwnMatch
from protos import pb

log = logging.getLogger(__name__)

RouterMetrics = LoopMetrics  # the router's counters are its sessions' loop counters, plus replays


class Router:
    """`pool`: a list of replica handles or any object with `acquire(session) -> VerifierLease`;
    `drafter`: a drafter actor or any object with `acquire(session) -> (actor, release)`."""

    def __init__(self, pool, drafter=None, tokenizer=None,
                 eos_token_ids: Sequence[int] = (), num_speculative_tokens: int = 4,
                 pipeline_depth: int = LoopConfig.model_fields["pipeline_depth"].default,
                 max_context: int = 8192, max_replays: int = 3, balance_pipeline: bool = True,
                 policy: SpeculationPolicyConfig | None = None, fill_bubbles: bool = True,
                 pipeline_max_sessions: int = 1,
                 fill_min_redraft: float = 0.5, draft_features: bool = False, own_match: OwnMatch | None = None):
        """`policy` None: γ is not adaptive (drafts the maximum every round). `draft_features`: the drafter's
        proposer is feature-fed (sessions ask their verifier for the target's features). `own_match`: sequential
        rounds and the plain steps the policy chooses send a match of the session's own suffix when there is one,
        drafted by the router (`SessionLoop`)."""
        if pipeline_depth < 1:
            raise InvalidRequestError(f"{pipeline_depth=} must be >= 1")
        self.pool = StaticVerifierPool(pool) if isinstance(pool, (list, tuple)) else pool
        if drafter is not None and not hasattr(drafter, "acquire"):
            drafter = StaticDrafter(drafter)
        self.drafter = drafter
        self.draft_features = draft_features
        self.own_match = own_match if drafter is not None else None
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.num_speculative_tokens = num_speculative_tokens if drafter is not None else 0
        self.pipeline_depth = pipeline_depth
        self.max_context = max_context
        self.max_replays = max_replays
        # Rounds are pipelined only while at most `pipeline_max_sessions` sessions share the session's
        # verifier replica: beyond, sessions already overlap each other's drafting and verification, and
        # sequential rounds (each with its bonus token) commit more per verifier forward.
        self.loop_config = LoopConfig(pipeline_depth=pipeline_depth, balance_pipeline=balance_pipeline,
                                      fill_bubbles=fill_bubbles, pipeline_max_sessions=pipeline_max_sessions,
                                      fill_min_redraft=fill_min_redraft)
        # γ per session from the cost model; not adaptive unless configured (tests pin γ exactly)
        self.policy = SpeculationPolicy(policy or SpeculationPolicyConfig(adaptive=False),
                                        self.num_speculative_tokens, pipelined=pipeline_depth > 1)
        self.estimates = CostEstimates()
        self.metrics = LoopMetrics()
        self._ids = itertools.count()
        self._setup = ThreadPoolExecutor(max_workers=64, thread_name_prefix="session-setup")

    @classmethod
    def from_config(cls, config: LoopConfig, engine, pool, drafter, tokenizer, model_config) -> "Router":
        """The one way both runtimes (`TandemCluster`, the Serve router deployment) build their router:
        `config` a `LoopConfig` (or either runtime's config), `engine` the `EngineConfig`, `model_config`
        the target's transformers config."""
        return cls(pool, drafter, tokenizer, eos_ids(model_config.eos_token_id),
                   engine.num_speculative_tokens, config.pipeline_depth,
                   max_context=model_config.max_position_embeddings, balance_pipeline=config.balance_pipeline,
                   policy=config.speculation, fill_bubbles=config.fill_bubbles,
                   pipeline_max_sessions=config.pipeline_max_sessions, fill_min_redraft=config.fill_min_redraft,
                   draft_features=needs_features(engine), own_match=own_match(engine))

    @property
    def replicas(self) -> list[VerifierReplicaHandle]:
        return getattr(self.pool, "replicas", [])

    @property
    def cost_ratio(self) -> float | None:
        """Measured c: draft time per token over one verify step (None until both are measured)."""
        return self.estimates.cost_ratio

    def _saturated(self) -> bool:
        """Whether the verifiers were saturated at the last look (speculation policy's threshold)."""
        threshold = self.policy.config.saturation_sessions
        return bool(threshold) and self.estimates.last_load >= threshold

    # -- placement -----------------------------------------------------------------------------

    def _open(self, session: str, committed: list[int], params: SamplingParams, attempts: int = 1,
              deadline_s: float = 300.0, features: bool = False, score: bool = False) -> GrpcVerifierPort:
        """Open the session on a replica the pool picks; with `attempts` > 1, replicas that fail to
        answer are marked failed and the next one is tried (waiting for restarts until the deadline).
        `score`: the verifier scores the committed tokens as it prefills them (`params.prompt_logprobs`
        top ones; the port's `prompt_logprobs`)."""
        deadline = time.time() + deadline_s
        failures = 0
        while True:
            try:
                lease = self.pool.acquire(session)
            except TandemError:  # no replica serving: wait while failed ones are restarted or rebuilt
                if attempts <= 1 or time.time() > deadline:
                    raise
                time.sleep(0.5)
                continue
            replica = lease.replica
            try:
                scored = params.prompt_logprobs if score else None
                reply = replica.stub.Open(pb.OpenRequest(session=session, token_ids=committed,
                                                         params=params_to_pb(params), features=features,
                                                         prompt_logprobs=scored), timeout=120)
                open_features = features_from_pb(reply.features)[1] if reply.HasField("features") else None
                prompt_logprobs = logprobs_from_pb(reply.prompt_logprobs) if scored is not None else None
                return GrpcVerifierPort(lease, session, open_features, prompt_logprobs)
            except grpc.RpcError as e:
                lease.release()
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError(e.details()) from None
                # UNAVAILABLE: a replica that knows it is broken (it is being rebuilt): not counted
                failures += e.code() != grpc.StatusCode.UNAVAILABLE
                if failures >= attempts or time.time() > deadline:
                    raise
                log.warning("verifier replica %s did not open session %s (%s)", replica.name, session, e.code().name)
                replica.mark_failed()
                time.sleep(0.2 if e.code() == grpc.StatusCode.UNAVAILABLE else 0)

    # -- one request -----------------------------------------------------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.max_context, self.tokenizer)  # the verifier checks ids

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 timeline: list[RoundTiming] | None = None, on_tokens=None,
                 cancelled: threading.Event | None = None, max_speculative_tokens: int | None = None,
                 output_prefix: Sequence[int] = (), stats: SpeculationStats | None = None,
                 validated: bool = False, on_prompt=None) -> GenerationResult:
        """Run one request to its end. `on_tokens(new_output_tokens, their logprobs or None)` is called as
        tokens are committed; setting `cancelled` ends the request early (finish reason "cancelled") and
        frees its state; `max_speculative_tokens` caps the drafts of every round of this request, long match
        rounds included (0 = plain decoding).

        `params.prompt_logprobs`: the verifier scores the prompt as it prefills it (not again on a replay,
        nor for a resumed session); `on_prompt(prompt_logprobs)` is called with them before any token.
        `params.max_tokens` 0: the prompt is prefilled (and scored) only, no round runs (finish "length").

        Resuming a session another router carried (failover): `output_prefix` is the output it had
        already committed (the session goes on from prompt + prefix, and stop strings, EOS and
        `max_tokens` see the whole output), `stats` the speculation figures so far (counted on).

        `validated`: the caller checked the request already (the Serve ingress does, once, and fixes its
        seed); else it is checked here (`validate`) and given a seed when it has none."""
        prompt_ids = list(prompt_ids)
        if not validated:
            self.validate(prompt_ids, params)
        params = params.with_seed()  # returns `params` itself when the seed is set
        params = params.for_session(len(prompt_ids), self.eos_token_ids)  # what the processors need (or itself)
        session = f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self.metrics.add(sessions=1)
        if stats is None:
            stats = SpeculationStats(num_prompt_tokens=len(prompt_ids))
        if output_prefix:  # a resumed session whose router died after its last token, before saying so
            done: list[int] = []
            checker = StopChecker(self.tokenizer, self.eos_token_ids, params)
            finish = checker.commit(done, list(output_prefix))
            if finish:
                stats.num_generated_tokens = len(done)
                return GenerationResult(done, checker.text(done), finish, stats,
                                        None if params.logprobs is None else [])
        t_start = time.perf_counter()
        max_gamma = self.num_speculative_tokens if max_speculative_tokens is None else \
            min(self.num_speculative_tokens, max_speculative_tokens)
        if params.max_tokens == 0:  # scoring only: no drafter, no round
            max_gamma = 0
        score = params.prompt_logprobs is not None and not output_prefix
        output: list[int] = list(output_prefix)
        state = SessionState(session, params, prompt_ids + output, output, stats, self.policy.session(), max_gamma,
                             max_drafts=max_speculative_tokens)
        drafter = None
        if self.drafter is not None and max_gamma > 0:
            acquire = lambda: self.drafter.acquire(session)  # noqa: E731
            drafter = RayDrafterPort(acquire, session, params, self.metrics, needs_features=self.draft_features)
        loop = SessionLoop(state, drafter, StopChecker(self.tokenizer, self.eos_token_ids, params), self.loop_config,
                           self.estimates, self.metrics, on_tokens, cancelled, timeline, self.own_match)
        drafter_started = None
        if drafter is not None and not self._saturated():  # the draft prefill overlaps the target's
            drafter_started = self._setup.submit(drafter.start, list(state.committed))
        # else the drafter joins when the policy first asks for drafts (never, while verifiers are saturated)
        stream = prompt_logprobs = None
        try:
            stream = self._open(session, state.committed, params, attempts=1 + self.max_replays,
                                features=loop.needs_features, score=score)
            loop.add_features(0, stream.open_features)
            prompt_logprobs = stream.prompt_logprobs
            if prompt_logprobs is not None and on_prompt is not None:
                on_prompt(prompt_logprobs)
            if drafter_started is not None:
                drafter_started.result()
            stats.prefill_s = time.perf_counter() - t_start
            replays = 0
            while True:
                try:
                    finish = loop.run(stream) if params.max_tokens > 0 else "length"
                    break
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise TandemError(f"verifier refused session {session}: {e.details()}") from None
                    replays += 1
                    if replays > self.max_replays:
                        raise TandemError(f"session {session} failed {replays} times; last: {e.details()}") from None
                    failed = stream.replica
                    log.warning("verifier replica %s failed (%s) in session %s after %d tokens: replaying onto "
                                "another replica", failed.name, e.code().name, session, len(output))
                    self.metrics.add(replays=1)
                    stream.close()
                    stream.lease.release()
                    failed.mark_failed()
                    loop.drop_in_flight_drafts()
                    stream = None
                    stream = self._open(f"{session}r{replays}", state.committed, params, attempts=1 + self.max_replays,
                                        features=loop.needs_features)
                    loop.add_features(0, stream.open_features)
        finally:
            if drafter_started is not None:
                try:
                    drafter_started.result()  # finished before the drafter session is released
                except Exception:
                    pass  # raised (and reported) above
            if stream is not None:
                stream.close()
                try:
                    stream.replica.stub.Release(pb.ReleaseRequest(session=stream.session), timeout=10)
                except grpc.RpcError:
                    pass
                stream.lease.release()
            if drafter is not None:
                drafter.release()
        stats.num_generated_tokens = len(output)
        stats.total_s = time.perf_counter() - t_start
        return GenerationResult(output, StopChecker(self.tokenizer, self.eos_token_ids, params).text(output), finish, stats,
                                state.logprobs, prompt_logprobs)
