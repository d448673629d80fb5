"""The router: drives each session's pipeline of draft and verify rounds and owns its committed tokens.

Per session it keeps up to `pipeline_depth` rounds in flight on one bidirectional gRPC stream to a
verifier replica (depth 1 = ordinary sequential speculative decoding, with a bonus token each fully
accepted round). While round r is verified the drafter drafts round r+1 as if r were accepted.
On a rejection: bump the epoch, forget in-flight rounds (the verifier answers them `stale`), roll the
drafter back to the committed tokens plus the recovered token, draft again; meanwhile the verifier
runs a plain decoding step (`fill_bubbles`), and the redraft goes on if its first token matches.
A session whose replica is shared by others sends sequential rounds (`pipeline_max_sessions`).

Faults: a dead drafter switches the session to plain target decoding (same output); a dead verifier
replica gets the session replayed from its committed tokens onto another (or the restarted) replica.
Both are logged and counted in `RouterMetrics`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import ray
import ray.exceptions

from cluster.codec import params_to_pb, result_from_pb, round_to_pb
from cluster.errors import InvalidRequestError, TandemError
from cluster.messages import DraftReply, SparseRow, SyncOp
from cluster.sampling import SamplingParams
from cluster.speculate import GenerationResult, SpeculationStats, ema, validate_request
from cluster.stopping import StopChecker
from cluster.transport import Endpoint, open_channel
from drafts.policy import SpeculationPolicy, SpeculationPolicyConfig
from protos import pb, rpc

log = logging.getLogger(__name__)

# A drafter call failing for any of these sends the session on with plain target decoding (same output):
# the actor died or is unreachable, or it raised, e.g. a drafter Ray restarted no longer knows the session.
_DRAFTER_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.RayTaskError)


@dataclass
class RouterMetrics:
    sessions: int = 0
    rounds: int = 0
    stale_rounds: int = 0
    replays: int = 0  # sessions moved to another verifier replica after a failure
    drafter_fallbacks: int = 0  # sessions that lost their drafter and went on with plain decoding
    pipeline_stalls: int = 0  # pipelined rounds sent when the verifier had nothing queued for the session
    bubble_fills: int = 0  # plain steps run while the drafter redrafted after a rejection
    bubble_fill_misses: int = 0  # ... whose token the redrafted first draft did not match (drafts dropped)
    shared_sequential_rounds: int = 0  # rounds sent sequentially (not pipelined) because the replica was shared
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


@dataclass
class RoundTiming:
    round: int
    draft_start: float
    draft_end: float
    verify_start: float = 0.0
    verify_end: float = 0.0
    sent: float = 0.0  # router clock around the gRPC round trip
    received: float = 0.0


class VerifierReplicaHandle:
    """A replica as the router sees it: a name, an endpoint and a way to find the endpoint again.

    Its channel carries the cluster secret on every call (`cluster.transport.open_channel`), over TLS
    when the replica's endpoint names a root certificate."""

    def __init__(self, name: str, resolve):
        self.name, self._resolve = name, resolve
        self.endpoint: Endpoint = resolve()
        self.sessions = 0
        self.healthy = True
        self._channel = open_channel(self.endpoint)
        self.stub = rpc.VerifierStub(self._channel)

    @property
    def address(self) -> str:
        return self.endpoint.address

    def refresh(self, timeout_s: float = 300.0) -> bool:
        """Ask for the endpoint again (a restarted replica binds a new port)."""
        try:
            endpoint = self._resolve(timeout_s)
            channel = open_channel(endpoint) if endpoint != self.endpoint else None
        except Exception as e:
            log.warning("verifier replica %s is not back: %s", self.name, e)
            return False
        if channel is not None:
            self._channel.close()
            self.endpoint, self._channel = endpoint, channel
            self.stub = rpc.VerifierStub(channel)
        self.healthy = True
        return True

    def mark_failed(self) -> None:
        """Take the replica out of placement until Ray has restarted it (in the background)."""
        if self.healthy:
            self.healthy = False
            threading.Thread(target=self._recover, daemon=True, name=f"refresh-{self.name}").start()

    def _recover(self) -> None:
        while not self.refresh():  # logged by refresh; the replica stays out of placement meanwhile
            time.sleep(5.0)


class StaticVerifierPool:
    """A fixed list of replicas (the `TandemCluster` runtime): sessions go to the least-loaded healthy one."""

    def __init__(self, replicas: Sequence[VerifierReplicaHandle]):
        if not replicas:
            raise InvalidRequestError("the verifier pool is empty")
        self.replicas = list(replicas)
        self._lock = threading.Lock()

    def acquire(self, session: str) -> "VerifierLease":
        with self._lock:
            candidates = [r for r in self.replicas if r.healthy]
            if not candidates:
                raise TandemError("no verifier replica is serving")
            replica = min(candidates, key=lambda r: r.sessions)  # least loaded
            replica.sessions += 1
        return VerifierLease(replica, release=lambda: self._unpin(replica))

    def _unpin(self, replica: VerifierReplicaHandle) -> None:
        with self._lock:
            replica.sessions -= 1


class VerifierLease:
    """A session's hold on one verifier replica; `release` is called exactly once."""

    def __init__(self, replica: VerifierReplicaHandle, release=lambda: None):
        self.replica = replica
        self._release = release
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


class StaticDrafter:
    """One drafter actor for every session (the `TandemCluster` runtime)."""

    def __init__(self, actor):
        self.actor = actor

    def acquire(self, session: str):
        """(actor handle, release callback) for one session."""
        return self.actor, lambda: None


class _Stream:
    """One session's open bidirectional Verify stream."""

    def __init__(self, lease: VerifierLease, session: str):
        self.lease, self.replica, self.session = lease, lease.replica, session
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = self.replica.stub.Verify(iter(self._requests.get, None))

    def send(self, request) -> None:
        self._requests.put(request)

    def receive(self):
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        self._responses.cancel()


class Router:
    """`pool`: a list of replica handles or any object with `acquire(session) -> VerifierLease`;
    `drafter`: a drafter actor or any object with `acquire(session) -> (actor, release)`."""

    def __init__(self, pool, drafter=None, tokenizer=None,
                 eos_token_ids: Sequence[int] = (), num_speculative_tokens: int = 4, pipeline_depth: int = 2,
                 max_context: int = 8192, max_replays: int = 3, balance_pipeline: bool = True,
                 policy: SpeculationPolicyConfig | None = None, fill_bubbles: bool = True,
                 pipeline_max_sessions: int = 1):
        if pipeline_depth < 1:
            raise InvalidRequestError(f"{pipeline_depth=} must be >= 1")
        self.pool = StaticVerifierPool(pool) if isinstance(pool, (list, tuple)) else pool
        if drafter is not None and not hasattr(drafter, "acquire"):
            drafter = StaticDrafter(drafter)
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.num_speculative_tokens = num_speculative_tokens if drafter is not None else 0
        self.pipeline_depth = pipeline_depth
        self.max_context = max_context
        self.max_replays = max_replays
        # Pipelined rounds pay off when drafting a round takes about as long as verifying one: with
        # `balance_pipeline`, γ per round is capped at verify time / draft time per token (online EMAs).
        self.balance_pipeline = balance_pipeline
        # Pipelined mode: after a rejection, run a plain decoding step while the drafter redrafts.
        self.fill_bubbles = fill_bubbles
        # Rounds are pipelined only while at most this many sessions share the session's verifier replica:
        # beyond, sessions already overlap each other's drafting and verification, and sequential rounds
        # (each with its bonus token) commit more per verifier forward.
        self.pipeline_max_sessions = pipeline_max_sessions
        # γ per session from the cost model; not adaptive unless configured (tests pin γ exactly)
        self.policy = SpeculationPolicy(policy or SpeculationPolicyConfig(adaptive=False),
                                        self.num_speculative_tokens, pipelined=pipeline_depth > 1)
        self._draft_token_s = 0.0
        self._verify_s = 0.0
        self._last_load = 0  # sessions on a verifier replica, as last reported
        self.metrics = RouterMetrics()
        self._ids = itertools.count()
        self._setup = ThreadPoolExecutor(max_workers=64, thread_name_prefix="session-setup")

    @property
    def replicas(self) -> list[VerifierReplicaHandle]:
        return getattr(self.pool, "replicas", [])

    @property
    def cost_ratio(self) -> float | None:
        """Measured c: draft time per token over one verify step (None until both are measured)."""
        if self._draft_token_s > 0 and self._verify_s > 0:
            return self._draft_token_s / self._verify_s
        return None

    # -- placement -----------------------------------------------------------------------------

    def _open(self, session: str, committed: list[int], params: SamplingParams, attempts: int = 1,
              deadline_s: float = 300.0) -> _Stream:
        """Open the session on a replica the pool picks; with `attempts` > 1, replicas that fail to
        answer are marked failed and the next one is tried (waiting for restarts until the deadline)."""
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
                replica.stub.Open(pb.OpenRequest(session=session, token_ids=committed, params=params_to_pb(params)),
                                  timeout=120)
                return _Stream(lease, session)
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

    # -- drafter calls (a dead drafter means plain decoding from here on) ------------------------

    def _drafter_lost(self, state: dict, what: str, session: str, error: Exception) -> None:
        log.warning("drafter failed during %s of session %s (%s): continuing with plain target decoding",
                    what, session, type(error).__name__)
        self.metrics.add(drafter_fallbacks=1)
        state["drafting"] = False

    def _drafter_submit(self, state: dict, what: str, session: str, call: Callable[[], ray.ObjectRef]):
        """`call()` submits one drafter call; its ObjectRef, or None (and plain decoding) if the drafter is lost.
        `what` names the call in the log."""
        if not state["drafting"]:
            return None
        try:
            return call()
        except _DRAFTER_ERRORS as e:
            self._drafter_lost(state, what, session, e)
            return None

    def _drafter_result(self, state: dict, session: str, ref, what: str = "propose"):
        """The result of a submitted drafter call; None (and plain decoding) if the drafter died."""
        if ref is None or not state["drafting"]:
            return None
        try:
            return ray.get(ref, timeout=120)
        except _DRAFTER_ERRORS + (ray.exceptions.GetTimeoutError,) as e:
            self._drafter_lost(state, what, session, e)
            return None

    def _drafter_start(self, state: dict, session: str, tokens: list[int], params: SamplingParams) -> None:
        ref = self._drafter_submit(state, "start", session, lambda: state["drafter"].start.remote(session, tokens, params))
        self._drafter_result(state, session, ref, "start")

    def _drafter_propose(self, state: dict, session: str, k: int):
        """Ask for k drafts, sending the sync ops owed; an ObjectRef of a `DraftReply` (None if the drafter is lost)."""
        sync, state["sync"] = state["sync"], []  # list[SyncOp]
        return self._drafter_submit(state, "propose", session, lambda: state["drafter"].propose.remote(session, k, sync))

    def _drafter_release(self, state: dict, session: str) -> None:
        """Not waited for: the drafter frees the session's state in its own time."""
        self._drafter_submit(state, "release", session, lambda: state["drafter"].release.remote(session))

    def _acquire_drafter(self, session: str, state: dict) -> None:
        if not state["drafting"]:
            return
        try:
            state["drafter"], state["release_drafter"] = self.drafter.acquire(session)
        except Exception as e:  # no drafter replica could take the session
            self._drafter_lost(state, f"acquire ({e})", session, e)

    # -- one request -----------------------------------------------------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.max_context, self.tokenizer)  # the verifier checks ids

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 timeline: list[RoundTiming] | None = None, on_tokens=None,
                 cancelled: threading.Event | None = None, max_speculative_tokens: int | None = None,
                 output_prefix: Sequence[int] = (), stats: SpeculationStats | None = None,
                 ) -> GenerationResult:
        """Run one request to its end. `on_tokens(new_output_tokens)` is called as tokens are committed;
        setting `cancelled` ends the request early (finish reason "cancelled") and frees its state;
        `max_speculative_tokens` caps γ for this request (0 = plain decoding).

        Resuming a session another router carried (failover): `output_prefix` is the output it had
        already committed (the session goes on from prompt + prefix, and stop strings, EOS and
        `max_tokens` see the whole output), `stats` the speculation figures so far (counted on)."""
        prompt_ids = list(prompt_ids)
        self.validate(prompt_ids, params)
        params = params.with_seed()
        session = f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self.metrics.add(sessions=1)
        if stats is None:
            stats = SpeculationStats(num_prompt_tokens=len(prompt_ids))
        if output_prefix:  # a resumed session whose router died after its last token, before saying so
            done: list[int] = []
            finish = StopChecker(self.tokenizer, self.eos_token_ids, params).commit(done, list(output_prefix))
            if finish:
                stats.num_generated_tokens = len(done)
                return GenerationResult(done, StopChecker(self.tokenizer, (), params).text(done), finish, stats)
        t_start = time.perf_counter()
        max_gamma = self.num_speculative_tokens if max_speculative_tokens is None else \
            min(self.num_speculative_tokens, max_speculative_tokens)
        # drafter state: whether it is alive, and the rollback/feedback ops owed to it, sent with the next propose
        state = {"drafting": self.drafter is not None and max_gamma > 0, "sync": [], "drafter": None,
                 "release_drafter": lambda: None, "max_gamma": max_gamma, "policy": self.policy.session(),
                 "on_tokens": on_tokens, "cancelled": cancelled, "drafter_started": False,
                 "start_drafter": None}
        output: list[int] = list(output_prefix)
        committed = prompt_ids + output
        stream = None

        def start_drafter(tokens: list[int]) -> None:
            state["drafter_started"] = True
            self._acquire_drafter(session, state)
            self._drafter_start(state, session, tokens, params)

        state["start_drafter"] = start_drafter
        drafter_started = None
        if state["drafting"] and not self._saturated():  # the draft prefill overlaps the target's
            drafter_started = self._setup.submit(start_drafter, list(committed))
        # else the drafter joins when the policy first asks for drafts (never, while verifiers are saturated)
        try:
            stream = self._open(session, committed, params, attempts=1 + self.max_replays)
            if drafter_started is not None:
                drafter_started.result()
            stats.prefill_s = time.perf_counter() - t_start
            replays = 0
            while True:
                try:
                    finish = self._run(session, stream, committed, output, params, state, stats, timeline)
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
                    state["sync"].append(SyncOp(length=len(committed)))
                    stream = None
                    stream = self._open(f"{session}r{replays}", committed, params, attempts=1 + self.max_replays)
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
            if state["drafter_started"]:
                self._drafter_release(state, session)
            state["release_drafter"]()
        stats.num_generated_tokens = len(output)
        stats.total_s = time.perf_counter() - t_start
        return GenerationResult(output, StopChecker(self.tokenizer, (), params).text(output), finish, stats)

    def _record_draft(self, stats: SpeculationStats, seconds: float, num_drafts: int) -> None:
        stats.draft_s += seconds
        if num_drafts:
            self._draft_token_s = ema(self._draft_token_s, seconds / num_drafts)

    def _saturated(self) -> bool:
        """Whether the verifiers were saturated at the last look (speculation policy's threshold)."""
        threshold = self.policy.config.saturation_sessions
        return bool(threshold) and self.policy.config.adaptive and self._last_load >= threshold

    def _choose_gamma(self, state: dict, remaining: int, bonus: bool, verifier_sessions: int) -> int:
        limit = min(state["max_gamma"], remaining - (1 if bonus else 0))
        if not bonus and self.balance_pipeline and self.cost_ratio:  # a pipelined round
            limit = min(limit, max(1, round(1 / self.cost_ratio)))
        return state["policy"].gamma(remaining, limit, self.cost_ratio, verifier_sessions, pipelined=not bonus)

    def _run(self, session: str, stream: _Stream, committed: list[int], output: list[int],
             params: SamplingParams, state: dict, stats: SpeculationStats,
             timeline: list[RoundTiming] | None) -> str:
        """Drive rounds until a stop; returns the finish reason. Raises grpc.RpcError on a verifier fault."""
        stops = StopChecker(self.tokenizer, self.eos_token_ids, params)
        epoch, optimistic = 0, 0  # optimistic: drafted tokens in flight beyond the committed ones
        in_flight: deque = deque()  # [round, epoch, num_drafts, stale, timing]
        round_ids = itertools.count()
        verifier_sessions = 0
        cancelled: threading.Event | None = state["cancelled"]
        fill = None  # (round, proposal ref): a plain step in flight while the drafter redrafts (see below)

        def send(drafts: list[int], rows: list[SparseRow] | None, bonus: bool, timing: RoundTiming) -> None:
            nonlocal optimistic
            stream.send(round_to_pb(stream.session, timing.round, epoch, bonus, drafts, rows))
            timing.sent = time.time()
            in_flight.append([timing.round, epoch, len(drafts), False, timing])
            optimistic += len(drafts)
            stats.record_gamma(len(drafts))

        while True:
            if cancelled is not None and cancelled.is_set():
                return "cancelled"
            live = sum(1 for entry in in_flight if not entry[3])
            depth = self.pipeline_depth if verifier_sessions <= self.pipeline_max_sessions else 1
            sequential = depth == 1
            while fill is None and live < depth:
                remaining = params.max_tokens - len(output) - optimistic
                if remaining <= 0:
                    break
                bonus = sequential
                k = self._choose_gamma(state, remaining, bonus, verifier_sessions) if state["drafting"] else 0
                if k > 0 and not state["drafter_started"]:
                    if live:
                        k = 0
                    else:  # the drafter joins late, from the committed tokens
                        state["sync"] = []
                        state["start_drafter"](list(committed))
                        k = k if state["drafting"] else 0
                if (k > 0 and not live and not sequential and self.fill_bubbles and state["drafting"]
                        and stats.rounds > 0 and remaining > 2):
                    # After a rejection the verifier would idle while the drafter drafts from the corrected
                    # token. Give it a plain decoding step meanwhile, and ask the drafter for one draft more:
                    # if its first draft equals the step's token, the rest go on as the next round.
                    ref = self._drafter_propose(state, session, k + 1)
                    if ref is not None:
                        t = time.time()
                        timing = RoundTiming(next(round_ids), t, t)
                        send([], None, True, timing)
                        fill = (timing.round, ref)
                        self.metrics.add(bubble_fills=1)
                        break
                t0 = time.time()
                drafts, rows = [], None
                if k > 0 and state["drafting"]:
                    proposal: DraftReply | None = self._drafter_result(
                        state, session, self._drafter_propose(state, session, k))
                    if proposal is not None:
                        drafts = proposal.token_ids
                        rows = proposal.draft_probs
                t1 = time.time()
                if not drafts:
                    if live:
                        break  # nothing to add: wait for the rounds in flight
                    bonus = True  # a plain decoding step
                if not sequential and not in_flight and stats.rounds > 0:
                    self.metrics.add(pipeline_stalls=1)  # the verifier had nothing queued for this session
                send(drafts, rows, bonus, RoundTiming(next(round_ids), t0, t1))
                if sequential and self.pipeline_depth > 1:
                    self.metrics.add(shared_sequential_rounds=1)
                live += 1
                self._record_draft(stats, t1 - t0, len(drafts))
                if bonus:
                    break  # the next round starts from this one's bonus token
            result, active_sessions = result_from_pb(stream.receive())
            received = time.time()
            rnd, rnd_epoch, num_drafts, stale, timing = in_flight.popleft()
            if result.round != rnd:
                raise TandemError(f"verifier answered round {result.round}, expected {rnd}")
            if stale or result.stale:
                self.metrics.add(stale_rounds=1)
                continue
            verifier_sessions = self._last_load = active_sessions
            timing.verify_start, timing.verify_end = result.verify_start, result.verify_end
            timing.received = received
            self._verify_s = ema(self._verify_s, result.verify_end - result.verify_start)
            stats.verify_s += result.verify_end - result.verify_start
            if timeline is not None:
                timeline.append(timing)
            optimistic -= num_drafts
            stats.record_round(num_drafts, result.num_accepted)
            state["policy"].learn(num_drafts, result.num_accepted)
            self.metrics.add(rounds=1)
            new_tokens = list(result.output_token_ids)
            committed.extend(new_tokens)
            op = SyncOp(num_drafted=num_drafts, num_accepted=result.num_accepted)
            if result.recovered or result.bonus:  # the drafter continues from the corrected token
                op = SyncOp(len(committed) - 1, new_tokens[-1:], num_drafts, result.num_accepted)
            if result.recovered:
                epoch += 1
                optimistic = 0
                for entry in in_flight:
                    entry[3] = True
            before = len(output)
            finish = stops.commit(output, new_tokens)
            if state["on_tokens"] is not None and len(output) > before:
                state["on_tokens"](output[before:])
            if finish:
                return finish
            if fill is not None and rnd == fill[0]:
                proposal = self._drafter_result(state, session, fill[1])
                fill = None
                drafts = proposal.token_ids if proposal else []
                # Lossless either way: the next round's drafts were drawn from q given the drafter's own
                # first token; when that equals the committed one they are ordinary drafts from here.
                if len(drafts) > 1 and drafts[0] == new_tokens[-1]:
                    op = op.without_rollback()  # the drafter's sequence already continues with this token
                    drafts = drafts[1:1 + params.max_tokens - len(output)]
                    rows = (proposal.draft_probs or [])[1:1 + len(drafts)]
                    self._record_draft(stats, proposal.draft_s, len(proposal.token_ids))
                    state["sync"].append(op)
                    send(drafts, rows, False, RoundTiming(next(round_ids), proposal.start, proposal.end))
                    continue
                self.metrics.add(bubble_fill_misses=1)
            state["sync"].append(op)
