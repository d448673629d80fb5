"""tandem's free drafts inside vLLM's own EAGLE-3 proposer (proposer 'eagle3' on vLLM, `engine.eagle3_matches`).

vLLM's eagle3 method drafts γ tokens a step for every request, from the target's three fused layers. A
request whose own committed tokens repeat something (code, a list, a quoted prompt), or that repeats what a
finished request wrote (the pool), has a free draft that is often right for much longer: the continuation of
a priced suffix match (`drafts.suffix.PooledPricedMatch`, the same as proposer `suffix`'s). Per row and step
the draft expected to have more tokens accepted is given to vLLM: the match's (up to `InlineMatches.max_tokens`),
or EAGLE-3's γ tokens, its expectation the product of the acceptance rates learned per position from its own
verdicts (`ChainAcceptance`). SuffixDecoding's hybrid with a speculator, inside one vLLM step.

How: the worker extension (`tandem_eagle_matches`) wraps the model runner's `EagleProposer.propose` (`install`);
vLLM's draft is made as ever (for every row: the EAGLE-3 layer's KV for the step's tokens stays written), then
rows are replaced. What it needs from the engine: `num_speculative_tokens` the
longest draft a row may take (the matches' length; EAGLE-3 itself drafts only γ, by batch size), and
`disable_padded_drafter_batch` (`cluster.vllm.eagle3.eagle3_speculative_config`: drafts of any length per row, made after vLLM's bookkeeping, so the runner's
input batch holds each request's committed tokens); the engine runs with synchronous scheduling (vLLM's async
scheduler reserves exactly `num_speculative_tokens` slots per request).

Lossless whatever it proposes: vLLM's eagle3 method verifies its drafts with one-hot q (draft_sample_method
'greedy', checked at install), and the EAGLE-3 layer's state is rebuilt each step from the target's states for
the tokens the target processed, so a row given a match's tokens drafts on from the committed tokens. A busy step
(γ 0 by the schedule, or no request that could take EAGLE-3's drafts: each one capped at 0 or stale, below) runs no
EAGLE-3 forward at all (its cost, ~6% of a 16-stream step here, BENCHMARKS.md); the requests in it keep only
matches from then on, as their draft KV misses those tokens. A step whose requests all just sampled their first
token (one stream's first step) runs EAGLE-3's KV pass over the prompts and drafts nothing: the first token leaves
sooner (TTFT). A request's own prediction (OpenAI's Predicted Outputs, `cluster.vllm.predictions`) is a third
candidate, priced by a table of its own: the row takes it where it is expected to have at least as many accepted.
Pooled drafts only for greedy and unseeded sampled requests; a seeded sampled request's row is decided by the
tables' priors, which never learn (`seeded_row`: its answer then does not change with other requests). A request's
draft cap (`RequestKey`) is kept: 0 means plain decoding. An exception here would kill vLLM's engine: it is logged,
counted (`proposer_errors`) and the step keeps vLLM's own drafts.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from cluster.vllm.inline import InlineMatcher, seeded_row
from cluster.vllm.predictions import RequestPredictions
from cluster.vllm.protocol import InlineMatches, RequestKey
from drafts.prediction import prediction_prices

log = logging.getLogger(__name__)


def gamma_for(schedule: list[list[int]] | None, gamma: int, rows: int) -> int:
    """EAGLE-3's γ for a step of `rows` requests: the schedule's (first, last, γ) range holding it (the last range
    past its end), never above `gamma`; `gamma` without a schedule."""
    if not schedule:
        return gamma
    for first, last, g in schedule:
        if first <= rows <= last:
            return min(gamma, g)
    return min(gamma, schedule[-1][2])


class ChainAcceptance:
    """A chain draft's acceptance rate per position (the chance token j is accepted when the ones before it were),
    learned from verdicts with exponential forgetting from a prior; `expected(n)`: the tokens of an n-token draft
    expected to be accepted."""

    PRIOR_TRIALS = 4.0

    def __init__(self, positions: int = 32, prior: float = 0.5, weight: float = 0.02):
        self.weight = weight
        self.hits = [prior * self.PRIOR_TRIALS] * positions
        self.trials = [self.PRIOR_TRIALS] * positions

    def expected(self, drafted: int) -> float:
        p, total = 1.0, 0.0
        for j in range(min(drafted, len(self.trials))):
            p *= self.hits[j] / self.trials[j]
            total += p
        return total

    def learn(self, drafted: int, accepted: int) -> None:
        keep = 1.0 - self.weight
        for j in range(min(accepted + 1, drafted, len(self.trials))):
            self.trials[j] = self.trials[j] * keep + 1.0
            self.hits[j] = self.hits[j] * keep + (1.0 if j < accepted else 0.0)


class EagleMatches:
    """The wrapper of one worker's `EagleProposer.propose` (`install`); `snapshot()`: its counters."""

    def __init__(self, runner, matches: InlineMatches, gamma: int, schedule: list[list[int]] | None = None):
        if matches.kind != "priced":
            raise ValueError(f"EAGLE-3 with tandem's matches takes priced matches, not {matches.kind!r}")
        self.runner, self.gamma, self.schedule = runner, gamma, schedule
        self.matcher = InlineMatcher(matches)
        self.chain = ChainAcceptance()
        self.prior_chain = ChainAcceptance()  # a seeded sampled request's: never learns (`seeded_row`)
        self.stats: Counter = Counter()
        self.predictions = RequestPredictions(runner, self.stats, prediction_prices(
            matches.max_tokens, matches.threshold, matches.per_row, matches.busy_rows))  # requests' own predictions
        self.given: dict[str, tuple[int, list[int], int, bool, bool]] = {}  # rid -> (at, draft, match, pooled, is_match)
        self.stale: set[str] = set()  # requests that lived through a step without EAGLE-3's forward: matches only
        self._lock = threading.Lock()

    def install(self) -> None:
        drafter = self.runner.drafter
        method = getattr(drafter, "method", None)
        spec = self.runner.speculative_config
        if method != "eagle3" or not spec.disable_padded_drafter_batch:
            raise RuntimeError(f"EAGLE-3 with tandem's matches needs vLLM's eagle3 method with "
                               f"disable_padded_drafter_batch; this engine has {method!r}")
        if getattr(spec, "draft_sample_method", "greedy") != "greedy":
            raise RuntimeError("EAGLE-3 with tandem's matches needs one-hot drafts (draft_sample_method 'greedy')")
        original = getattr(drafter, "_tandem_original_propose", None) or drafter.propose
        drafter._tandem_original_propose = original

        def propose(num_speculative_tokens, *args, **kwargs):
            batch = self.runner.input_batch
            req_ids = list(batch.req_ids)
            # per row: its key (`RequestKey`: draft cap, None: none; salt group) and the tokens it has sampled so far
            # (0: prefilling)
            keys = [RequestKey.parse(RequestKey.from_vllm(rid)) for rid in req_ids]
            caps = [key.cap for key in keys]
            sampled = (batch.num_tokens_no_spec[:len(req_ids)] - batch.num_prompt_tokens[:len(req_ids)]).tolist()
            # EAGLE-3 drafts no more than the rows that can take its drafts allow (none: no forward at all)
            takers = [c for rid, c in zip(req_ids, caps) if c != 0 and rid not in self.stale]
            widest = self.gamma if None in takers else max(takers, default=0)
            gamma = min(num_speculative_tokens, gamma_for(self.schedule, self.gamma, len(req_ids)), widest)
            if gamma == 0:  # a busy step: no EAGLE-3 forward at all; these requests' draft KV misses this step's tokens
                self.stale.update(req_ids)
                self.stats["eagle_skipped_steps"] += 1
                drafts = [[] for _ in req_ids]
            elif max(sampled, default=0) <= 1:  # every row prefilling or at its first token (vLLM sends that token when
                # the step, drafts included, is done): EAGLE-3's KV for the prompts, no drafts, the first token sooner
                self.stats["eagle_first_steps"] += 1
                drafts = original(0, *args, **kwargs).tolist()
            else:
                drafts = original(gamma, *args, **kwargs).tolist()
            try:
                with self._lock:
                    return self._merge(drafts, num_speculative_tokens, keys, sampled)
            except Exception:  # noqa: BLE001 - an exception here would kill vLLM's engine
                log.exception("tandem's matches in vLLM's EAGLE-3 proposer failed; EAGLE-3's drafts for this step")
                self.stats["proposer_errors"] += 1
                return [[] if rid in self.stale else row for rid, row in zip(req_ids, drafts)]

        drafter.propose = propose
        self.runner._tandem_eagle_matches = self

    def _merge(self, eagle: list[list[int]], limit: int, keys: list[RequestKey], sampled: list[int]
               ) -> list[list[int]]:
        batch = self.runner.input_batch
        req_ids = batch.req_ids
        self.stats["steps"] += 1
        live = getattr(self.runner, "requests", None)
        if live is not None:
            live = set(live)
            for rid in [r for r in self.given if r not in live]:
                del self.given[rid]
            self.stale &= live
            self.predictions.forget(live)
            self.stats["pool_outputs"] += self.matcher.pool_finished(live)
        decoding = [i for i in range(len(req_ids)) if sampled[i] > 0]
        active = len(decoding)  # the step's decoding rows (what a verified token costs)
        out = [list(row) for row in eagle]
        for i in decoding:
            rid = req_ids[i]
            history = batch.token_ids_cpu[i, : int(batch.num_tokens_no_spec[i])].tolist()
            self._verdict(rid, history)
            self.stats["rows"] += 1
            cap = limit if keys[i].cap is None else min(limit, keys[i].cap)
            if cap == 0:  # this request asked for plain decoding
                self.stats["plain_rows"] += 1
                out[i] = []
                continue
            group = keys[i].group  # its cache salt's: pooled among its own group only
            self.matcher.track(rid, int(batch.num_prompt_tokens[i]), history, group)  # pooled when it ends
            row = [] if rid in self.stale else out[i][:cap]
            seeded = seeded_row(self.runner, rid, i)  # then priced by the priors: its drafts depend on it alone
            draft, match, pooled = self.matcher.propose(history, cap, active, group=group, seeded=seeded)
            eagle_expected = (self.prior_chain if seeded else self.chain).expected(len(row))
            match_expected = self.matcher.expected(match, len(draft), pooled, seeded) if draft else 0.0
            predicted, at = self.predictions.propose(rid, history, cap, active, seeded)  # its own prediction
            if predicted and self.predictions.expected(rid, at, len(predicted)) >= max(eagle_expected,
                                                                                       match_expected):
                out[i] = predicted
                self.predictions.give(rid, history, predicted, at)
                self.stats["drafted_rows"] += 1
                continue
            if draft and match_expected > eagle_expected:
                out[i] = draft
                self.given[rid] = (len(history), draft, match, pooled, True)
                self.stats["matched_rows"] += 1
                self.stats["matched_tokens"] += len(draft)
                self.stats["pooled_rows"] += int(pooled)
            else:
                out[i] = row
                self.given[rid] = (len(history), row, 0, False, False)
                self.stats["eagle_rows"] += 1
                self.stats["eagle_tokens"] += len(row)
            self.stats["drafted_rows" if out[i] else "empty_rows"] += 1
        return out

    def _verdict(self, rid: str, history: list[int]) -> None:
        """What the target made of the draft `rid` was given at its last step: the drafted tokens the committed
        history goes on with."""
        given = self.given.pop(rid, None)
        if given is None or not given[1]:
            return
        at, draft, match, pooled, is_match = given
        accepted = 0
        for j, token in enumerate(draft):
            if at + j >= len(history) or history[at + j] != token:
                break
            accepted += 1
        if is_match:
            self.matcher.learn(match, len(draft), accepted, pooled)
        else:
            self.chain.learn(len(draft), accepted)
        self.stats["verdict_drafted"] += len(draft)
        self.stats["verdict_accepted"] += accepted

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.stats, eagle_expected=round(self.chain.expected(self.gamma), 3), pool_size=len(self.matcher.pool or ()))
