"""Protobuf <-> core types for the internal `Verifier` service: every conversion in one place.

The router and the verifier server speak core types (`SamplingParams`, `Round`, `RoundResult`, sparse
draft rows) and convert here, at the wire. The public `Generation` API converts in the ingress.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import ValidationError

from cluster.core.errors import InvalidRequestError, validation_message
from cluster.core.grammar import StructuredOutputs
from cluster.core.logprobs import TokenLogprob
from cluster.core.messages import SparseRow
from cluster.core.sampling import SamplingParams
from cluster.core.rounds import Round, RoundResult
from protos import pb

# -- sampling parameters ------------------------------------------------------------------------


def params_to_pb(params: SamplingParams):
    msg = pb.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                            top_k=params.top_k, seed=params.seed, stop=params.stop, ignore_eos=params.ignore_eos,
                            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                            min_p=params.min_p, logit_bias=params.logit_bias, min_tokens=params.min_tokens,
                            stop_token_ids=params.stop_token_ids,
                            bad_words=[pb.TokenIds(token_ids=w) for w in params.bad_words],
                            allowed_token_ids=params.allowed_token_ids or [],
                            eos_token_ids=params.eos_token_ids)
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    if params.prompt_length is not None:
        msg.prompt_length = params.prompt_length
    if params.logprobs is not None:
        msg.logprobs, msg.logprobs_mode = params.logprobs, params.logprobs_mode
    msg.include_stop_str_in_output = params.include_stop_str_in_output
    if not params.skip_special_tokens:
        msg.skip_special_tokens = False
    if params.cache_salt is not None:
        msg.cache_salt = params.cache_salt
    if params.prediction:
        msg.prediction.extend(params.prediction)
    so = params.structured_outputs
    if so is not None:
        msg.structured_outputs.CopyFrom(pb.StructuredOutputs(kind=so.kind, spec=so.spec,
                                                             disable_any_whitespace=not so.any_whitespace))
    return msg


def text_fields_from_pb(msg) -> dict:
    """How the output's text is written (`include_stop_str_in_output`, `skip_special_tokens`) from a
    pb.SamplingParams, as `SamplingParams` keywords (the public `Generation` API's too)."""
    return dict(include_stop_str_in_output=msg.include_stop_str_in_output,
                skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True)


def logprob_fields_from_pb(msg) -> dict:
    """`logprobs`, `logprobs_mode` and `prompt_logprobs` of a pb.SamplingParams as `SamplingParams` keywords (the
    public `Generation` API's too; sessions carry prompt logprobs in `OpenRequest`, so theirs is unset)."""
    return dict(logprobs=msg.logprobs if msg.HasField("logprobs") else None,
                logprobs_mode=msg.logprobs_mode or "raw_logprobs",
                prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None)


def cache_salt_from_pb(msg) -> str | None:
    """A pb.SamplingParams' `cache_salt` (None: unset; the public `Generation` API's too)."""
    return msg.cache_salt if msg.HasField("cache_salt") else None


def prediction_from_pb(msg) -> list[int] | None:
    """A pb.SamplingParams' `prediction` (None: empty; the public `Generation` API's too)."""
    return list(msg.prediction) or None


def processor_fields_from_pb(msg) -> dict:
    """The logits processors' fields of a pb.SamplingParams, as `SamplingParams` keywords (the public
    `Generation` API's too; unset or zero values mean off)."""
    return dict(presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
                min_p=msg.min_p, logit_bias=dict(msg.logit_bias), min_tokens=msg.min_tokens,
                stop_token_ids=list(msg.stop_token_ids), bad_words=[list(w.token_ids) for w in msg.bad_words],
                allowed_token_ids=list(msg.allowed_token_ids) or None,
                structured_outputs=structured_from_pb(msg))


def structured_from_pb(msg) -> StructuredOutputs | None:
    """A pb.SamplingParams' grammar (InvalidRequestError for an unknown kind)."""
    if not msg.HasField("structured_outputs"):
        return None
    so = msg.structured_outputs
    try:
        return StructuredOutputs(kind=so.kind, spec=so.spec, any_whitespace=not so.disable_any_whitespace)
    except ValidationError as e:
        raise InvalidRequestError(f"structured_outputs: {validation_message(e)}") from None


def params_from_pb(msg) -> SamplingParams:
    """The session's parameters as a verifier receives them, checked there (InvalidRequestError): its gRPC
    port is an entry point of its own, and protobuf's types do not bound what SamplingParams refuses (a NaN
    or negative temperature, top_p > 1, a seed >= 2^63, empty or too many stop strings, penalties out of
    range)."""
    return SamplingParams.build(
        max_tokens=max(1, msg.max_tokens), temperature=msg.temperature, top_p=msg.top_p or 1.0,
        top_k=msg.top_k, seed=msg.seed if msg.HasField("seed") else None, stop=list(msg.stop),
        ignore_eos=msg.ignore_eos, **processor_fields_from_pb(msg), **logprob_fields_from_pb(msg),
        **text_fields_from_pb(msg), prompt_length=msg.prompt_length if msg.HasField("prompt_length") else None,
        eos_token_ids=list(msg.eos_token_ids), cache_salt=cache_salt_from_pb(msg),
        prediction=prediction_from_pb(msg))


# -- draft proposals ----------------------------------------------------------------------------


def draft_rows_to_pb(rows: Sequence[SparseRow] | None) -> list:
    """Sparse rows of q (one per draft) -> pb.DraftDistribution list (empty for a deterministic proposer)."""
    return [pb.DraftDistribution(token_ids=ids, probs=probs) for ids, probs in rows or ()]


def dense_draft_probs(proposal, vocab_size: int) -> torch.Tensor | None:
    """Sparse wire distributions -> q  # [k, vocab_size]; None for a deterministic proposer."""
    if not proposal.draft_probs:
        return None
    if len(proposal.draft_probs) != len(proposal.token_ids):
        raise InvalidRequestError(f"{len(proposal.token_ids)} drafts but {len(proposal.draft_probs)} draft distributions")
    q = torch.zeros(len(proposal.token_ids), vocab_size)  # [k, vocab_size]
    for i, dist in enumerate(proposal.draft_probs):
        if len(dist.token_ids) != len(dist.probs) or any(t >= vocab_size for t in dist.token_ids):
            raise InvalidRequestError(f"draft distribution {i} is malformed")
        q[i, list(dist.token_ids)] = torch.tensor(list(dist.probs))
    if (q < 0).any() or ((q.sum(-1) - 1).abs() > 1e-3).any():
        raise InvalidRequestError("draft distributions must be non-negative and sum to 1")
    return q


# -- rounds and their results -------------------------------------------------------------------


def round_to_pb(session: str, round: int, epoch: int, bonus: bool, token_ids: Sequence[int],
                draft_rows: Sequence[SparseRow] | None, parents: Sequence[int] | None = None):
    """One round as the router sends it: drafts and their sparse q rows (None: deterministic), and the
    parent of each draft when they form a token tree (None: a chain)."""
    proposal = pb.DraftProposal(token_ids=token_ids, draft_probs=draft_rows_to_pb(draft_rows),
                                tree=parents is not None, parents=[p + 1 for p in parents or ()])
    return pb.VerifyRequest(session=session, round=round, epoch=epoch, bonus=bonus, proposal=proposal)


def round_from_pb(request, vocab_size: int) -> Round:
    """Raises InvalidRequestError on a malformed proposal."""
    proposal = request.proposal
    parents = [p - 1 for p in proposal.parents] if proposal.tree else None
    return Round(request.session, request.round, request.epoch, list(proposal.token_ids),
                 dense_draft_probs(proposal, vocab_size), request.bonus, parents)


def result_to_pb(r: RoundResult, active_sessions: int = 0):
    msg = pb.VerifyResult(session=r.session, round=r.round, epoch=r.epoch, num_accepted=r.num_accepted,
                          output_token_ids=r.output_token_ids, recovered=r.recovered, bonus=r.bonus,
                          stale=r.stale, verify_start=r.verify_start, verify_end=r.verify_end,
                          active_sessions=active_sessions)
    if r.features is not None:
        msg.features.CopyFrom(features_to_pb(r.feature_start, r.features))
    msg.logprobs.extend(logprobs_to_pb(r.logprobs or ()))
    return msg


def result_from_pb(msg) -> tuple[RoundResult, int]:
    """(the round's result, sessions active on the verifier replica when it answered)."""
    result = RoundResult(msg.session, msg.round, msg.epoch, msg.num_accepted, list(msg.output_token_ids),
                         msg.recovered, msg.bonus, msg.stale, msg.verify_start, msg.verify_end)
    if msg.HasField("features"):
        result.feature_start, result.features = features_from_pb(msg.features)
    if msg.logprobs:
        result.logprobs = logprobs_from_pb(msg.logprobs)
    return result, msg.active_sessions


def logprobs_to_pb(logprobs: Sequence[TokenLogprob]) -> list:
    return [pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob, top_ids=[i for i, _ in t.top],
                            top_logprobs=[lp for _, lp in t.top], rank=t.rank) for t in logprobs]


def logprobs_from_pb(msgs) -> list[TokenLogprob]:
    return [TokenLogprob(m.token_id, m.logprob, tuple(zip(m.top_ids, m.top_logprobs)),
                         m.rank if m.HasField("rank") else None) for m in msgs]


# -- the target's features (for a feature-fed draft) --------------------------------------------


def features_to_pb(start: int, rows: torch.Tensor):
    """rows  # [m, H] -> pb.Features (bf16 bytes)."""
    rows = rows.detach().to("cpu", torch.bfloat16).contiguous()
    return pb.Features(start=start, rows=rows.shape[0], dim=rows.shape[1],
                       bf16=rows.view(torch.int16).numpy().tobytes())


def features_from_pb(msg) -> tuple[int, torch.Tensor]:
    """pb.Features -> (start, rows  # [m, H] bf16)."""
    if len(msg.bf16) != 2 * msg.rows * msg.dim:
        raise InvalidRequestError(f"features: {len(msg.bf16)} bytes for {msg.rows} x {msg.dim} bf16")
    if not msg.rows:
        return msg.start, torch.zeros(0, msg.dim, dtype=torch.bfloat16)
    rows = torch.frombuffer(bytearray(msg.bf16), dtype=torch.int16).view(torch.bfloat16)
    return msg.start, rows.view(msg.rows, msg.dim).clone()
