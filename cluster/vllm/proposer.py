"""tandem's drafts inside vLLM: the custom proposer class vLLM calls after every step.

vLLM (`speculative_config={"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k}`)
builds `TandemProposer(vllm_config)` in each worker process and, after every step, calls
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`: row i holds the request's newly
committed tokens (accepted drafts + the bonus/recovered token) and its committed history is
`token_ids_cpu[i, :num_tokens_no_spec[i]]` (bookkeeping runs before the custom proposer;
`vllm/v1/worker/gpu_model_runner.py`). We return at most k tokens per row, `[]` for none. vLLM
verifies drafts without probabilities as one-hot q: lossless for greedy and sampled decoding
whatever produced them.

The proposer is a thin, non-blocking client of a tandem drafter (`cluster.vllm.client.DraftClient`),
configured by a `DrafterSpec` through the worker extension (`cluster.vllm.worker`); only rank 0 has
one (vLLM uses rank 0's drafts), the other ranks return `[]`.

Free drafts are made here, in vLLM's step, with no drafter call (`DrafterSpec.matches`): proposer
`ngram`'s prompt lookup (then there is no drafter at all) and the hybrid's long match rounds (a row
whose committed suffix has a long enough earlier match gets that match's continuation; the others go
to the drafter). A request's drafter session is opened at its first row, whichever drafts it gets.

Per request (keyed by vLLM's request id, found through the model runner's `input_batch.req_ids`,
which the worker extension hands over) the proposer knows exactly what the drafter's sequence is.
With `overlap` on, after handing vLLM a draft it asks the drafter to keep drafting as if the draft
will be accepted; at the next step a pending draft whose sequence the committed history is a prefix
of is returned at once (a hit). Otherwise (a miss) the row gets `[]`, one plain step, and the
drafter rolls back to the committed history (one `SyncOp`) and redrafts. Without `overlap` every
step rolls back and drafts synchronously. A drafter that errs or dies means plain decoding for that
request; one that is slow means `[]` for the rows whose draft is late. Each case is logged and
counted (`tandem_stats`). An exception inside `propose` would kill vLLM's engine, so `propose`
catches everything and answers `[]`.

Building the proposer is the worker's start (before its warm-up): it applies the guarded
rejection-sampler fix there (`cluster.vllm.patch`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field

from cluster.core.messages import SyncOp
from cluster.vllm.client import DraftClient, make_client
from cluster.vllm.patch import fix_rejection_sampler, fix_state
from cluster.vllm.predictions import RequestPredictions
from cluster.vllm.inline import InlineMatcher, seeded_row
from cluster.vllm.protocol import DrafterSpec, RequestKey
from drafts.prediction import prediction_prices

log = logging.getLogger(__name__)


@dataclass
class _Session:
    pending: Future | None = None  # drafts continuing `base`
    base: list[int] = field(default_factory=list)  # the drafter's sequence the pending draft continues
    known: list[int] | None = None  # the drafter's whole sequence, when no draft is pending
    submitted_at: float = 0.0
    failed: bool = False
    given: int = 0  # draft tokens handed to vLLM at the last step (its verdict arrives with the next)
    opened: int = 0  # the committed tokens when the proposer first saw the request (its prompt)
    started: bool = False  # whether the drafter was asked for this session's first draft
    feedback: object = None  # a SyncOp teaching the drafter that verdict, sent with its next call


class TandemProposer:
    """vLLM's custom proposer: drafts from a tandem drafter (configured through `tandem_configure`)."""

    def __init__(self, vllm_config=None, *args, **kwargs):
        fix_rejection_sampler()  # vLLM builds this proposer at the worker's start: fix its sampler before use
        spec = getattr(vllm_config, "speculative_config", None)
        self.k = int(getattr(spec, "num_speculative_tokens", 0) or 0)
        self.client: DraftClient | None = None
        self.runner = None
        self.rank = 0
        self.spec = DrafterSpec()  # the tuning in force (overlap, wait_s, on_miss, wait_first, registered)
        self.max_k = self.k
        self._deadline = 0.0
        self.sessions: dict[str, _Session] = {}
        self._drafter_part: dict | None = None
        self._match: InlineMatcher | None = None  # the inline matches of `spec.matches` (None: none)
        self._predictions: RequestPredictions | None = None  # requests' own predictions (rank 0)
        self._verdicts: dict[str, tuple[int, int, bool]] = {}  # key -> (match, tokens, pooled) of the inline draft last given
        self.stats: Counter = Counter()
        self._lock = threading.Lock()

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner calls this with the target model; tandem's drafter has its own."""

    # -- configuration (from the worker extension, between steps) ---------------------------------

    def configure(self, spec: DrafterSpec, runner, rank: int) -> None:
        """A new drafter from `spec`; one whose drafter part equals the current one's is kept (only
        the tuning fields max_k, overlap, wait_s, on_miss, wait_first, matches change; its sessions are released)."""
        drafter_part = spec.drafter_part()
        keep = self.client is not None and drafter_part == self._drafter_part
        if keep:
            self._release_started()
            self.sessions.clear()
        else:
            self._close()
        self.runner, self.rank, self.spec = runner, rank, spec
        self.max_k = self.k if spec.max_k is None else min(self.k, spec.max_k)
        self._match = InlineMatcher(spec.matches) if rank == 0 and spec.matches is not None else None
        self._verdicts.clear()
        self.stats = Counter()
        m = spec.matches
        prices = prediction_prices(max(1, self.k), m.threshold, m.per_row, m.busy_rows) if m else \
            prediction_prices(max(1, self.k))
        self._predictions = RequestPredictions(runner, self.stats, prices) if rank == 0 else None
        if not keep:
            self.client = make_client(spec) if rank == 0 else None
            self._drafter_part = drafter_part
        log.info("tandem proposer on rank %d: drafter %s, γ ≤ %d, overlap %s, wait %.3fs, inline matches %s", rank,
                 self.client.name if self.client else "none", self.max_k, self.spec.overlap, self.spec.wait_s,
                 spec.matches.model_dump() if spec.matches and rank == 0 else None)

    def _release_started(self) -> None:
        """Release the drafter sessions this proposer started (a session only matched inline has none here)."""
        for session, s in list(self.sessions.items()):
            if s.started:
                self.client.release(session)

    def _close(self) -> None:
        if self.client is not None:
            self._release_started()
            self.client.close()
        self.client = None
        self._drafter_part = None
        self.sessions.clear()

    # -- vLLM's call ----------------------------------------------------------------------------------

    def propose(self, sampled_token_ids, num_tokens_no_spec=None, token_ids_cpu=None, *args, **kwargs):
        rows = len(sampled_token_ids)
        try:
            with self._lock:
                return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception:  # noqa: BLE001 - an exception here would kill vLLM's engine
            log.exception("tandem proposer failed; plain decoding for this step")
            self.stats["proposer_errors"] += 1
            self.stats["empty_rows"] += rows
            return [[] for _ in range(rows)]

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        rows = len(sampled_token_ids)
        self.stats["steps"] += 1
        drafter = self.client is not None and self.max_k > 0
        predictions = self._predictions
        if self.runner is None or not (drafter or self._match is not None or predictions is not None):
            self.stats["rows_without_drafter"] += rows
            return [[] for _ in range(rows)]
        req_ids = self.runner.input_batch.req_ids
        self._deadline = time.monotonic() + self.spec.wait_s  # one bound for the whole step, however many rows
        active = sum(1 for t in sampled_token_ids if t)  # the step's decoding rows (what a verified token costs)
        # requests gone since the last step (finished or aborted): released, their outputs pooled first
        live = getattr(self.runner, "requests", None)
        if live is not None:
            if predictions is not None:
                predictions.forget(set(live))
            live = {self._key(r) for r in live}
            for key in [k for k in self._verdicts if k not in live]:
                del self._verdicts[key]
            if self._match is not None:
                self.stats["pool_outputs"] += self._match.pool_finished(live)
            for session in [s for s in self.sessions if s not in live]:  # finished or aborted
                if self.sessions.pop(session).started and not self.spec.registered:
                    self.client.release(session)  # a registered session is released by its front door
                self.stats["released"] += 1
        out: list[list[int]] = []
        for i in range(rows):
            if not sampled_token_ids[i]:  # a partial prefill or a discarded row: nothing committed
                out.append([])
                continue
            self.stats["rows"] += 1
            history = token_ids_cpu[i, : int(num_tokens_no_spec[i])].tolist()
            key = self._key(req_ids[i])
            # the cap and salt group are in the id the front door gave (vLLM's internal id adds a suffix)
            request_key = RequestKey.parse(RequestKey.from_vllm(req_ids[i]))
            cap = request_key.cap
            if cap == 0:  # this request asked for plain decoding
                self.stats["plain_rows"] += 1
                out.append([])
                continue
            num_new = len(sampled_token_ids[i])
            limit = self.k if cap is None else min(self.k, cap)
            s = self.sessions.get(key)
            if s is None and drafter:
                s = self.sessions[key] = _Session(opened=len(history) - num_new)
                self.stats["sessions"] += 1
            seeded = seeded_row(self.runner, req_ids[i], i)
            draft, at = predictions.propose(req_ids[i], history, limit, active, seeded) if predictions else ([], 0)
            predicted = bool(draft)
            if predicted:  # the request's own prediction, priced, before any other source
                predictions.give(req_ids[i], history, draft, at)
            if self._match is not None:
                given = self._verdicts.pop(key, None)
                if given is not None:  # the verdict on the inline draft given at this request's last step
                    accepted = max(0, min(given[1], num_new - 1))
                    self._match.learn(given[0], given[1], accepted, given[2])
                    self.stats["inline_verdicts"] += 1
                    self.stats["inline_verdict_accepted"] += accepted
                self._match.track(key, len(history) - num_new, history, request_key.group)
                if not draft:
                    draft, match, pooled = self._match.propose(history, limit, active, group=request_key.group,
                                                               seeded=seeded)
                    if draft:
                        self._verdicts[key] = (match, len(draft), pooled)
                        self.stats["pooled_rows"] += int(pooled)
            if draft:  # drafted here (a prediction's, a match's): the drafter's session learns the verdict as a resync
                if not predicted:  # a match's (a prediction's are counted as prediction_rows)
                    self.stats["matched_rows"] += 1
                    self.stats["matched_tokens"] += len(draft)
                if s is not None:
                    s.given = 0
            elif drafter:
                draft = self._row(key, s, history, num_new)[:limit]
            if draft:
                self.stats["drafted_rows"] += 1
                self.stats["drafted_tokens"] += len(draft)
            else:
                self.stats["empty_rows"] += 1
            out.append(draft)
        return out

    def _key(self, rid: str) -> str:
        """The drafter's session for vLLM's internal request id: with `registered`, the id the front
        door gave the request."""
        return RequestKey.from_vllm(rid) if self.spec.registered else rid

    def _row(self, rid: str, s: _Session, history: list[int], num_new: int) -> list[int]:
        k = self.max_k
        if not s.started:
            s.started = True
            n = k + 1 if self.spec.overlap else k
            if self.spec.registered:  # the front door opened it on the prompt, before vLLM's prefill
                self._submit(s, self.client.resume(rid, s.opened, history, n), history)
            else:
                self._submit(s, self.client.start_and_propose(rid, history, n), history)
            if not self.spec.wait_first and not s.pending.done():  # the first token leaves now; drafts next step
                self.stats["empty_first"] += 1
                return []
        elif s.failed:
            self.stats["empty_failed"] += 1
            return []
        else:
            s.feedback = self._feedback(s, num_new) or s.feedback
            if s.pending is None:  # without overlap: roll back to the history and draft now
                self._resync(rid, s, history, s.known or [])
        s.given = 0
        if not self._wait(rid, s):
            return []
        drafted = s.base + s.pending.result()
        s.pending, s.known = None, drafted
        if len(drafted) > len(history) and drafted[: len(history)] == history:
            draft = drafted[len(history): len(history) + k]
            self.stats["hits"] += 1
            if self.spec.overlap:  # keep drafting as if this draft will be accepted
                self._submit(s, self.client.propose(rid, k + 1, self._take_feedback(s)), drafted)
            s.given = len(draft)
            return draft
        # a miss: the drafter's sequence left the committed history
        self.stats["misses"] += 1
        self._resync(rid, s, history, drafted)
        if self.spec.overlap and self.spec.on_miss == "plain":
            self.stats["empty_miss"] += 1
            return []  # one plain step while the drafter redrafts
        if not self._wait(rid, s):
            return []
        drafted = s.base + s.pending.result()
        s.pending, s.known = None, drafted
        draft = drafted[len(history): len(history) + k]
        s.given = len(draft)
        if self.spec.overlap:  # the redraft was waited for (on_miss "wait"): draft on beyond it
            self._submit(s, self.client.propose(rid, k + 1), drafted)
        return draft

    def _feedback(self, s: _Session, num_new: int):
        """What vLLM made of the draft handed over at the last step: num_new committed tokens are its
        accepted drafts plus one (the bonus or recovered token). None when no draft was handed over."""
        if not s.given:
            return None
        accepted = max(0, min(s.given, num_new - 1))
        self.stats["verdict_drafted"] += s.given
        self.stats["verdict_accepted"] += accepted
        return SyncOp(num_drafted=s.given, num_accepted=accepted)

    @staticmethod
    def _take_feedback(s: _Session) -> list:
        ops = [s.feedback] if s.feedback is not None else []
        s.feedback = None
        return ops

    def _resync(self, rid: str, s: _Session, history: list[int], drafter_seq: list[int]) -> None:
        """Roll the drafter back to the committed history (keep the common prefix) and redraft."""
        common = 0
        for a, b in zip(drafter_seq, history):
            if a != b:
                break
            common += 1
        sync = self._take_feedback(s) + [SyncOp(length=common, token_ids=history[common:])]
        self.stats["rollbacks"] += 1
        self._submit(s, self.client.propose(rid, self.max_k + 1 if self.spec.overlap else self.max_k, sync), history)

    def _submit(self, s: _Session, future: Future, base: list[int]) -> None:
        s.pending, s.base, s.known, s.submitted_at = future, list(base), None, time.monotonic()

    def _wait(self, rid: str, s: _Session) -> bool:
        """Wait for the pending draft until this step's deadline; False (the row gets []) when it is late
        or failed."""
        try:
            s.pending.result(timeout=max(0.0, self._deadline - time.monotonic()))
            return True
        except TimeoutError:
            self.stats["empty_late"] += 1
            if time.monotonic() - s.submitted_at > max(30.0, 10 * self.spec.wait_s):
                self._fail(rid, s, "no draft for 30 s")
            elif self.stats["empty_late"] in (1, 10, 100, 1000):
                log.warning("tandem drafter late for %s (> %.3fs): plain step (%d late rows so far)", rid,
                            self.spec.wait_s, self.stats["empty_late"])
            return False
        except Exception as e:  # noqa: BLE001 - the drafter failed: plain decoding for this request
            self._fail(rid, s, f"{type(e).__name__}: {e}")
            return False

    def _fail(self, rid: str, s: _Session, why: str) -> None:
        s.failed, s.pending = True, None
        self.stats["drafter_failures"] += 1
        self.stats["empty_failed"] += 1
        log.warning("tandem drafter failed for request %s (%s): plain decoding for it", rid, why)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.stats, rank=self.rank, sessions_open=len(self.sessions),
                        drafter=self.client.name if self.client else "none", fix=fix_state())


PROPOSER_CLASS = f"{TandemProposer.__module__}.{TandemProposer.__qualname__}"  # vLLM's `speculative_config.model`
