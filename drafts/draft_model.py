"""Draft-model proposer: any causal LM with the target's tokenizer, run by a `TorchModelRunner`.

The zero-training default is an int8 dynamic-quantized copy of the target (`quantized_copy`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

import torch

from cluster.runner import TorchModelRunner
from cluster.sampling import RandomStream, SamplingParams, probabilities, sample
from drafts.proposer import DraftProposal, SequenceProposer, SessionId


def quantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An int8 dynamic-quantized copy of `model` (CPU; activations stay fp32)."""
    draft = copy.deepcopy(model).to(device="cpu", dtype=torch.float32).eval()
    with warnings.catch_warnings():  # torch deprecates quantized tensors in favour of torchao
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.ao.quantization.quantize_dynamic(draft, {torch.nn.Linear}, dtype=torch.qint8)


class DraftModelProposer(SequenceProposer):
    """Drafts k tokens one forward step at a time; greedy under greedy decoding, else sampled from
    q (the draft's distribution processed exactly like the target's) and q is sent along."""

    name = "draft"

    def __init__(self, runner: TorchModelRunner):
        super().__init__()
        self.runner = runner

    def start(self, session: SessionId, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        super().start(session, prompt_ids, params)
        self.runner.add_session(session)
        if len(prompt_ids) > 1:  # prefill now; the last token is fed by the first propose
            self.runner.extend(session, prompt_ids[:-1], num_logits=0)

    def propose(self, session: SessionId, k: int) -> DraftProposal:
        tokens = self.tokens(session)
        params = self._params[session]
        k = max(0, min(k, self.runner.max_context - len(tokens)))
        draft: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            feed = tokens[self.runner.length(session) :]  # usually one token
            logits = self.runner.extend(session, feed, num_logits=1)  # [1, vocab_size]
            if params.greedy:
                token = int(logits[0].argmax())
            else:
                q = probabilities(logits, params)[0]  # [vocab_size]
                token = sample(q, params.seed or 0, len(tokens), RandomStream.DRAFT)
                rows.append(q)
            tokens.append(token)
            draft.append(token)
        draft_probs = torch.stack(rows) if rows else None  # [k, vocab_size]
        return DraftProposal(draft, draft_probs)

    def rollback(self, session: SessionId, length: int, token_ids: Sequence[int] = ()) -> None:
        super().rollback(session, length, token_ids)
        if self.runner.length(session) > length:
            self.runner.truncate(session, length)

    def release(self, session: SessionId) -> None:
        super().release(session)
        self.runner.release(session)
