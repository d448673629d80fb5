"""Speculative decoding in one process: the session loop (`cluster.session.loop`) over in-process ports.

The target is a `VerifierEngine` over a local runner (`cluster.session.ports.LocalVerifierPort`) and the
proposer is called in this process (`LocalDrafterPort`), so this is the router's algorithm, pipelining
and bubble filling included, without Ray or gRPC. Each round the target extends the session by the
last committed token plus the k drafts, which yields k + 1 distributions: one per draft and one for
the bonus.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from cluster.core.errors import InvalidRequestError
from cluster.core.sampling import SamplingParams
from cluster.core.stats import GenerationResult, SpeculationStats
from cluster.core.stopping import StopChecker, eos_ids
from cluster.core.validation import validate_request
from cluster.model.runner import TorchModelRunner
from cluster.model.verifier import VerifierEngine
from cluster.session.loop import CostEstimates, LoopConfig, LoopMetrics, SessionLoop, SessionState
from cluster.session.ports import LocalDrafterPort, LocalVerifierPort
from drafts.hybrid import HybridProposer
from drafts.policy import SpeculationPolicy, SpeculationPolicyConfig
from drafts.proposer import Proposer
from drafts.suffix import OwnMatch


class SpeculativeDecoder:
    """Lossless speculative decoding of one request at a time on a local target runner.

    `num_speculative_tokens` (γ) = 0, or `proposer=None`, is plain target decoding. `pipeline_depth`
    2 runs the pipelined chain (round r+1 drafted while r is verified; `fill_bubbles`), with the
    proposer in a thread of its own when `overlap` (else one after the other: same tokens).
    """

    def __init__(self, target: TorchModelRunner, proposer: Proposer | None, tokenizer=None,
                 num_speculative_tokens: int = 4, eos_token_ids: Sequence[int] | None = None,
                 policy: SpeculationPolicy | None = None, pipeline_depth: int = 1, fill_bubbles: bool = True,
                 balance_pipeline: bool = False, overlap: bool = False, fill_min_redraft: float = 0.5,
                 own_matches: bool = True):
        """`policy`: a `drafts.policy.SpeculationPolicy` choosing γ per round (≤ num_speculative_tokens)
        from the session's running α and the measured cost ratio; None drafts γ every round. `own_matches`: with
        a hybrid proposer with long match rounds, the loop drafts long matches of the session's own suffix
        itself (`SessionLoop.own_match`), in sequential rounds and in the plain steps the policy chooses."""
        if num_speculative_tokens < 0:
            raise InvalidRequestError(f"{num_speculative_tokens=} must be >= 0")
        if pipeline_depth < 1:
            raise InvalidRequestError(f"{pipeline_depth=} must be >= 1")
        self.target = target
        self.engine = VerifierEngine(target)
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        if eos_token_ids is None:
            eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
            eos = eos if eos is not None else getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = eos_ids(eos)
        self.eos_token_ids = set(eos_token_ids)
        self.policy = policy or SpeculationPolicy(SpeculationPolicyConfig(adaptive=False),
                                                  self.num_speculative_tokens, pipelined=pipeline_depth > 1)
        self.loop_config = LoopConfig(pipeline_depth=pipeline_depth, balance_pipeline=balance_pipeline,
                                      fill_bubbles=fill_bubbles, fill_min_redraft=fill_min_redraft)
        self.own_match = OwnMatch.for_rounds(proposer.match_tokens, self.num_speculative_tokens, proposer.extend_min,
                                             proposer.max_ngram) \
            if own_matches and isinstance(proposer, HybridProposer) else None
        self.estimates = CostEstimates()
        self.metrics = LoopMetrics()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="drafter") if overlap else None
        self._ids = itertools.count()

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.target.max_context, self.tokenizer, self.target.vocab_size)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 max_speculative_tokens: int | None = None) -> GenerationResult:
        """`max_speculative_tokens` caps the drafts of every round of this request, long match rounds
        included (0 = plain decoding), as `Router.generate`'s does."""
        prompt_ids = list(prompt_ids)
        self.validate(prompt_ids, params)
        params = params.with_seed().for_session(len(prompt_ids), self.eos_token_ids)
        session = f"local-{next(self._ids)}-{uuid.uuid4().hex[:6]}"  # proposers may be shared by decoders
        stats = SpeculationStats(num_prompt_tokens=len(prompt_ids))
        self.metrics.add(sessions=1)
        t_start = time.perf_counter()
        verifier = LocalVerifierPort(self.engine, session)
        drafter = None
        max_gamma = self.num_speculative_tokens if max_speculative_tokens is None else \
            min(self.num_speculative_tokens, max_speculative_tokens)
        if self.proposer is not None and max_gamma > 0 and params.max_tokens > 0:
            drafter = LocalDrafterPort(self.proposer, session, params, self._executor)
        state = SessionState(session, params, list(prompt_ids), [], stats, self.policy.session(), max_gamma,
                             max_drafts=max_speculative_tokens)
        loop = SessionLoop(state, drafter, StopChecker(self.tokenizer, self.eos_token_ids, params), self.loop_config,
                           self.estimates, self.metrics, own_match=self.own_match)
        # the last prompt token is fed with the first round's drafts
        opened = verifier.open(prompt_ids, params, features=loop.needs_features)
        loop.add_features(0, opened.features)
        try:
            if drafter is not None:
                drafter.start(prompt_ids)
            stats.prefill_s = time.perf_counter() - t_start
            finish = loop.run(verifier) if params.max_tokens > 0 else "length"  # 0: the prompt scored only
        finally:
            verifier.release()
            if drafter is not None:
                drafter.release()
        stats.num_generated_tokens = len(state.output)
        stats.total_s = time.perf_counter() - t_start
        return GenerationResult(state.output, StopChecker(self.tokenizer, self.eos_token_ids, params).text(state.output), finish, stats,
                                state.logprobs, opened.prompt_logprobs)
