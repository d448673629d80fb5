"""The verifier engine: target KV per session, rounds verified in order, many sessions per forward.

A session is one token stream. Each round's drafts are fed after the session's uncached committed
token (if any); the first draft is tested against the distribution at the end of the previous round
when that round was fully accepted without a bonus (the pipelined case), so the chain of tests is
exactly speculative sampling over the whole sequence. A rejection truncates the KV to the committed
length (a cursor move), returns the recovered token and bumps the session's epoch; rounds drafted
in an older epoch are answered `stale` and commit nothing.

No gRPC here: `cluster/wire/verifier_server.py` puts this behind the `Verifier` service.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cluster.core.errors import InvalidRequestError
from cluster.core.logprobs import prompt_logprobs, token_logprobs
from cluster.core.processors import process_sequence
from cluster.core.rejection import rejection_sample
from cluster.core.rounds import Opened, Round, RoundResult
from cluster.core.sampling import SamplingParams
from cluster.core.tree import tree_rejection_sample
from cluster.model.prompt_cache import PromptCache
from cluster.model.runner import TorchModelRunner

log = logging.getLogger(__name__)


Callback = Callable[[RoundResult | Exception], None]


@dataclass
class _Session:
    params: SamplingParams
    num_tokens: int  # committed tokens (prompt + output) the verifier knows
    uncached: list[int]  # committed tokens not yet in the KV (at most one)
    next_logits: torch.Tensor | None = None  # [vocab_size]: the next position's, when uncached is empty
    epoch: int = 0
    pending: deque = field(default_factory=deque)  # (Round, Callback), in arrival order
    features: bool = False  # send the target's hidden states of committed positions (a feature-fed draft)
    tokens: list[int] | None = None  # the committed tokens (prompt, then output), kept only where processors act
    opened: tuple[int, ...] = ()  # the tokens it opened with: their KV (all but the last) may be shared
    threads: int = 0  # the torch threads their prefill ran with (the prompt cache's key)


class VerifierEngine:
    """Owns a target runner; `step()` verifies the oldest pending round of every session at once."""

    def __init__(self, runner: TorchModelRunner, max_batch: int = 32):
        self.runner = runner
        # the runner's kept prompts (`cluster.model.prompt_cache`: a session that opens with exactly the prefilled
        # tokens of an earlier one copies their KV, bit for bit a prefill's); a runner without any: none
        self.prompt_cache = PromptCache.of(runner)
        self.max_batch = max_batch
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Condition()
        self._stopped = False
        self.rounds_verified = 0
        self.stale_rounds = 0
        self.shared_prefills = 0  # sessions opened with another open session's prompt KV (n choices)

    # -- sessions (called from gRPC threads) -----------------------------------------------------

    def open(self, session: str, token_ids: Sequence[int], params: SamplingParams, features: bool = False
             ) -> Opened:
        """Prefill the committed tokens; returns their count and, with `features`, the target's last hidden
        state of all but the last  # [n - 1, H] bf16 (every round's result then carries those of the
        positions it commits). With `params.prompt_logprobs`, the same prefill keeps the logits of every
        position (the KV it writes is the same) for the logprobs of tokens 1 .. n - 1."""
        if not token_ids:
            raise InvalidRequestError("open: no tokens")
        if any(not 0 <= t < self.runner.vocab_size for t in token_ids):
            raise InvalidRequestError(f"open: token ids must lie in [0, {self.runner.vocab_size})")
        if len(token_ids) > self.runner.max_context:
            raise InvalidRequestError(f"open: {len(token_ids)} tokens exceed the context of {self.runner.max_context}")
        params.check_vocab(self.runner.vocab_size)
        if params.processes_logits and params.prompt_length is None:  # opened with the prompt alone
            params = params.model_copy(update={"prompt_length": len(token_ids)})
        if params.prompt_length is not None and params.prompt_length > len(token_ids):
            raise InvalidRequestError(f"open: a prompt of {params.prompt_length} tokens but {len(token_ids)} tokens")
        if features and not getattr(self.runner, "supports_features", False):
            raise InvalidRequestError(f"open: this target runner ({type(self.runner).__name__}) cannot send features "
                                      "for a feature-fed draft")
        prompt_features = rows = None
        with self._lock:
            if session in self._sessions:
                raise InvalidRequestError(f"session {session!r} is already open")
            self.runner.add_session(session)
            if features:
                self.runner.capture.add(session)
            try:
                opened = tuple(int(t) for t in token_ids)
                shareable = not features and params.prompt_logprobs is None  # both need the prefill's own rows
                salt = params.cache_salt  # prefill KV comes only from sessions of the same salt (None: unsalted)
                donor = self._prefix_donor(opened, salt) if shareable else None
                threads = self._sessions[donor].threads if donor is not None else torch.get_num_threads()
                if donor is not None:  # the same prompt, prefilled already: its KV, bit for bit what a prefill gives
                    self.runner.share_prefix(donor, session, len(token_ids) - 1)
                    self.shared_prefills += 1
                elif shareable and len(token_ids) > 1 and self.prompt_cache.take(opened[:-1], session, salt):
                    pass  # an earlier session's prefill of the same tokens (and cache_salt), kept
                elif len(token_ids) > 1:  # with prompt_logprobs, row i: the raw logits after token i  # [n - 1, vocab]
                    rows = self.runner.extend(session, list(token_ids[:-1]),
                                              num_logits=None if params.prompt_logprobs is not None else 0)
                if features:
                    prompt_features = self.runner.hidden.pop(session, None)
                    if prompt_features is None:
                        prompt_features = self._no_features()
            except Exception:
                self.runner.release(session)
                raise
            self._sessions[session] = _Session(params.with_seed(), len(token_ids), [int(token_ids[-1])],
                                               features=features,
                                               tokens=[int(t) for t in token_ids] if params.processes_logits else None,
                                               opened=opened, threads=threads)
        if params.prompt_logprobs is None:
            return Opened(len(token_ids), prompt_features)
        scored = [] if rows is None else prompt_logprobs(rows, token_ids, params.prompt_logprobs)  # outside the lock
        return Opened(len(token_ids), prompt_features, scored)

    def _prefix_donor(self, opened: tuple[int, ...], salt: str | None = None) -> str | None:
        """An open session that opened with the same tokens and the same `cache_salt` (a choice of the same
        request): the KV of all but the last is its first positions' for good (a session never rolls back below
        what it opened with). None where the runner cannot share or no session fits. Called under the lock."""
        if len(opened) < 2 or not hasattr(self.runner, "share_prefix"):
            return None
        for sid, state in reversed(self._sessions.items()):
            if state.opened == opened and state.params.cache_salt == salt \
                    and self.runner.length(sid) >= len(opened) - 1:
                return sid
        return None

    def release(self, session: str) -> bool:
        with self._lock:
            state = self._sessions.pop(session, None)
            if state is None:
                return False
            if len(state.opened) > 1:  # its first positions: the prefill of all but the last token it opened with
                try:
                    self.prompt_cache.keep(session, state.opened[:-1], state.threads, state.params.cache_salt)
                except Exception:  # e.g. a tensor-parallel group that lost a rank: nothing kept, loudly
                    log.exception("keeping session %s's prompt KV failed", session)
            self.runner.release(session)
            for rnd, callback in state.pending:
                callback(InvalidRequestError(f"session {session!r} was released"))
            return True

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def submit(self, rnd: Round, callback: Callback) -> None:
        """Queue a round; `callback` gets its RoundResult (or the error) from the engine thread."""
        with self._lock:
            state = self._sessions.get(rnd.session)
            if state is None:
                raise InvalidRequestError(f"unknown session {rnd.session!r}")
            self._validate(rnd, state)
            state.pending.append((rnd, callback))
            self._lock.notify_all()

    def _validate(self, rnd: Round, state: _Session) -> None:
        k, vocab = len(rnd.token_ids), self.runner.vocab_size
        if any(not 0 <= t < vocab for t in rnd.token_ids):
            raise InvalidRequestError(f"round {rnd.round}: draft token ids must lie in [0, {vocab})")
        if rnd.draft_probs is not None:
            if tuple(rnd.draft_probs.shape) != (k, vocab):
                raise InvalidRequestError(f"round {rnd.round}: {k} drafts but draft_probs of shape {tuple(rnd.draft_probs.shape)}")
            if any(float(rnd.draft_probs[i, t]) <= 0 for i, t in enumerate(rnd.token_ids)):
                raise InvalidRequestError(f"round {rnd.round}: a draft token has draft probability 0")
        if rnd.epoch > state.epoch:  # the router learns of a new epoch only from this verifier
            raise InvalidRequestError(f"round {rnd.round}: epoch {rnd.epoch} is ahead of the session's {state.epoch}")
        if k == 0 and not rnd.bonus:
            raise InvalidRequestError(f"round {rnd.round}: no drafts and no bonus asked: nothing to verify")
        if rnd.parents is not None:
            if not rnd.bonus or k == 0:
                raise InvalidRequestError(f"round {rnd.round}: a token tree needs drafts and a bonus token")
            try:
                rnd.tree()
            except ValueError as e:
                raise InvalidRequestError(f"round {rnd.round}: malformed token tree: {e}") from None
        if state.num_tokens + k + 1 > self.runner.max_context:
            raise InvalidRequestError(f"round {rnd.round}: the session would exceed the context of {self.runner.max_context}")

    # -- the engine loop -----------------------------------------------------------------------

    def run_forever(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not any(s.pending for s in self._sessions.values()):
                    self._lock.wait()
                if self._stopped:
                    return
            self.step()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    def step(self) -> int:
        """Verify the oldest pending round of up to `max_batch` sessions in one forward pass."""
        with self._lock:
            batch: list[tuple[str, _Session, Round, Callback]] = []
            for sid, state in self._sessions.items():
                while state.pending:
                    rnd, callback = state.pending[0]
                    if rnd.epoch == state.epoch:
                        batch.append((sid, state, rnd, callback))
                        break
                    state.pending.popleft()  # drafted before the last rejection
                    self.stale_rounds += 1
                    callback(RoundResult(sid, rnd.round, rnd.epoch, stale=True))
                if len(batch) >= self.max_batch:
                    break
            if not batch:
                return 0
            feeds = {sid: state.uncached + rnd.token_ids for sid, state, rnd, _ in batch}
            trees = {sid: (len(state.uncached), rnd.tree()) for sid, state, rnd, _ in batch if rnd.parents is not None}
            start = time.time()
            try:  # chains and token trees (each node along its own path) in one forward
                chains = {s: f for s, f in feeds.items() if f and s not in trees}
                if not trees:
                    logits = self.runner.extend_batch(chains)
                elif getattr(self.runner, "batches_trees", False):
                    logits = self.runner.extend_batch({s: f for s, f in feeds.items() if f}, trees=trees)
                else:  # a runner that scores trees one at a time
                    logits = self.runner.extend_batch(chains)
                    for sid, (num_prefix, tree) in trees.items():
                        logits[sid] = self.runner.extend_tree(sid, feeds[sid][:num_prefix], tree)
            except Exception as e:  # a failed forward fails its rounds, loudly; the sessions survive
                log.exception("verification forward failed")
                for sid, state, rnd, callback in batch:
                    state.pending.popleft()
                    try:
                        self.runner.truncate(sid, state.num_tokens - len(state.uncached))
                    except Exception:  # e.g. a tensor-parallel group that lost a rank: nothing to undo
                        log.debug("truncate after a failed forward failed too", exc_info=True)
                    callback(e)
                return 0
            end = time.time()
            results = []
            for sid, state, rnd, callback in batch:
                state.pending.popleft()
                commit = self._commit if rnd.parents is None else self._commit_tree
                results.append((callback, commit(sid, state, rnd, logits.get(sid), start, end)))
            self.rounds_verified += len(batch)
        for callback, result in results:  # outside the lock: callbacks may block on queues
            callback(result)
        return len(batch)

    def _no_features(self) -> torch.Tensor:
        return torch.zeros(0, self.runner.feature_width, dtype=torch.bfloat16)

    def _commit(self, sid: str, state: _Session, rnd: Round, rows: torch.Tensor | None,
                start: float, end: float) -> RoundResult:
        k = len(rnd.token_ids)
        fed_start, num_fed_committed = state.num_tokens - len(state.uncached), len(state.uncached)
        head = [] if state.uncached else [state.next_logits[None]]
        dists = torch.cat(head + ([rows] if rows is not None else []))  # [k + 1, vocab_size], raw
        scored = dists if rnd.bonus else dists[:k]
        if state.tokens is not None:  # row i continues the committed tokens + drafts 0..i-1
            scored = process_sequence(scored, state.params, state.tokens,
                                      [rnd.token_ids[:i] for i in range(scored.shape[0])])
        result = rejection_sample(rnd.token_ids, scored, rnd.draft_probs, state.params,
                                  start_position=state.num_tokens)
        out = RoundResult(sid, rnd.round, rnd.epoch, result.num_accepted, result.output_token_ids,
                          result.recovered, result.bonus, verify_start=start, verify_end=end)
        if state.params.logprobs is not None:  # output token j was drawn from row j
            rows = scored if state.params.logprobs_mode == "processed_logprobs" else dists
            out.logprobs = token_logprobs(rows[: len(result.output_token_ids)], result.output_token_ids, state.params)
        if state.features:
            hidden = self.runner.hidden.pop(sid, None)
            m = num_fed_committed + result.num_accepted  # fed tokens now committed
            out.features = hidden[:m] if hidden is not None else self._no_features()
            out.feature_start = fed_start
        if result.recovered:
            self.runner.truncate(sid, state.num_tokens + result.num_accepted)
            state.uncached, state.next_logits = [result.output_token_ids[-1]], None
            state.epoch += 1
        elif result.bonus:
            state.uncached, state.next_logits = [result.output_token_ids[-1]], None
        else:
            state.uncached, state.next_logits = [], dists[k]
        state.num_tokens += len(result.output_token_ids)
        if state.tokens is not None:
            state.tokens.extend(result.output_token_ids)
        return out

    def _commit_tree(self, sid: str, state: _Session, rnd: Round, rows: torch.Tensor,
                     start: float, end: float) -> RoundResult:
        """A token tree's round: `rows` are extend_tree's logits (the uncached token, then the nodes)."""
        tree = rnd.tree()
        num_prefix = len(state.uncached)
        fed_start = state.num_tokens - num_prefix
        head = [] if num_prefix else [state.next_logits[None]]
        raw = dists = torch.cat(head + [rows[max(0, num_prefix - 1):]])  # [n + 1, vocab_size]: root, then each node
        if state.tokens is not None:  # each node's row continues the committed tokens + its path
            dists = process_sequence(dists, state.params, state.tokens,
                                     [[]] + [tree.path_tokens(tree.path(i)) for i in range(len(tree))])
        result = tree_rejection_sample(tree, dists, state.params, start_position=state.num_tokens)
        self.runner.keep_tree_path(sid, state.num_tokens, result.node_path)  # uncached tokens now cached
        out = RoundResult(sid, rnd.round, rnd.epoch, result.num_accepted, result.output_token_ids,
                          result.recovered, result.bonus, verify_start=start, verify_end=end)
        if state.params.logprobs is not None:  # output token 0 drawn at the root, token j > 0 after node_path[j - 1]
            rows = dists if state.params.logprobs_mode == "processed_logprobs" else raw
            index = torch.tensor([0] + [1 + i for i in result.node_path], dtype=torch.long)
            out.logprobs = token_logprobs(rows[index[: len(result.output_token_ids)].to(rows.device)],
                                          result.output_token_ids, state.params)
        if state.features:
            hidden = self.runner.hidden.pop(sid)  # [num_prefix + n, H]: the prefix, then the tree's nodes
            path = torch.tensor([num_prefix + i for i in result.node_path], dtype=torch.long)
            out.features, out.feature_start = torch.cat([hidden[:num_prefix], hidden[path]]), fed_start
        state.uncached, state.next_logits = [result.output_token_ids[-1]], None
        if result.recovered:
            state.epoch += 1
        state.num_tokens += len(result.output_token_ids)
        if state.tokens is not None:
            state.tokens.extend(result.output_token_ids)
        return out
