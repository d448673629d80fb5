"""Draft-model proposer: any causal LM with the target's tokenizer, run by a `TorchModelRunner`.

The zero-training default is an int8 dynamic-quantized copy of the target (`quantized_copy`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Collection, Sequence

import torch

from cluster.core.processors import process_sequence
from cluster.core.sampling import RandomStream, SamplingParams, probabilities, sample
from cluster.model.prompt_cache import PromptCache
from cluster.model.runner import TorchModelRunner
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

    def __init__(self, runner: TorchModelRunner, max_support: int | None = None, tree_width: int = 1):
        """`max_support`: sample from the draft's `max_support` most likely tokens (renormalised), so
        q crosses the wire compactly. Any q keeps the output lossless: the verifier uses this one.
        `tree_width` > 1: `propose_tree` adds the draft's next most likely tokens as siblings of the
        first draft (a token tree, `cluster.core.tree`). A session whose prompt the runner keeps
        (`runner.prompt_cache`, under the same `params.cache_salt`) takes its KV instead of a prefill."""
        super().__init__()
        self.runner = runner
        self.prompt_cache = PromptCache.of(runner)
        self._prefilled: dict[SessionId, tuple[int, int, str | None]] = {}  # prompt tokens prefilled at start (all
        # but the last), the torch threads that prefill ran with, and the session's cache_salt
        self.max_support = max_support
        self.tree_width = tree_width

    def start(self, session: SessionId, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        super().start(session, prompt_ids, params)
        self.runner.add_session(session)
        if len(prompt_ids) > 1:  # prefill now (or the same prompt's kept KV); the last token is fed by the first propose
            self._prefilled[session] = (len(prompt_ids) - 1, torch.get_num_threads(), params.cache_salt)
            if not self.prompt_cache.take(prompt_ids[:-1], session, params.cache_salt):
                self.runner.extend(session, prompt_ids[:-1], num_logits=0)

    def propose(self, session: SessionId, k: int) -> DraftProposal:
        return self.propose_batch({session: k})[session]

    def propose_batch(self, requests: dict[SessionId, int], trees: Collection[SessionId] = ()
                      ) -> dict[SessionId, DraftProposal]:
        """Draft for several sessions at once: one batched forward per draft position. `trees`: sessions
        whose proposal is a token tree, the chain plus `tree_width - 1` siblings of its first draft: the
        draft's most likely other tokens there, chosen deterministically (one-hot rows, so the tree's
        multi-candidate verification stays lossless, `cluster.core.tree`). The chain is what the session's
        own sequence continues with."""
        wanted = {s: max(0, min(k, self.runner.max_context - len(self.tokens(s)))) for s, k in requests.items()}
        drafts: dict[SessionId, list[int]] = {s: [] for s in requests}
        rows: dict[SessionId, list[torch.Tensor]] = {s: [] for s in requests}
        siblings: dict[SessionId, list[int]] = {s: [] for s in requests}
        for step in range(max(wanted.values(), default=0)):
            active = [s for s in requests if step < wanted[s]]
            feeds = {s: self.tokens(s)[self.runner.length(s) :] for s in active}  # usually one token each
            logits = self.runner.extend_batch(feeds, num_logits={s: 1 for s in active})  # {s: [1, vocab]}
            for s in active:
                tokens, params = self.tokens(s), self._params[s]
                row = process_sequence(logits[s], params, tokens)  # [1, vocab]: as the target's at this position
                if params.greedy:
                    token = int(row[0].argmax())
                else:
                    q = probabilities(row, params)[0]  # [vocab_size]
                    if self.max_support and self.max_support < q.shape[-1]:
                        top = torch.topk(q, self.max_support)
                        q = torch.zeros_like(q).scatter_(0, top.indices, top.values / top.values.sum())
                    token = sample(q, params.seed or 0, len(tokens), RandomStream.DRAFT)
                    rows[s].append(q)
                if step == 0 and s in trees and self.tree_width > 1:
                    ranked = torch.topk(row[0], self.tree_width).indices.tolist()
                    siblings[s] = [t for t in ranked if t != token][: self.tree_width - 1]
                tokens.append(token)
                drafts[s].append(token)
        return {s: self._proposal(drafts[s], rows[s], siblings[s]) for s in requests}

    @staticmethod
    def _proposal(chain: list[int], rows: list[torch.Tensor], siblings: list[int]) -> DraftProposal:
        q = torch.stack(rows) if rows else None  # [k, vocab_size]
        if not siblings or not chain:
            return DraftProposal(chain, q)
        # nodes: the chain's first draft, its siblings, then the rest of the chain (topological order)
        token_ids = [chain[0], *siblings, *chain[1:]]
        parents = [-1] * (1 + len(siblings))
        if len(chain) > 1:
            parents += [0, *range(len(siblings) + 1, len(siblings) + len(chain) - 1)]
        if q is not None:
            one_hot = torch.zeros(len(siblings), q.shape[-1])
            one_hot[torch.arange(len(siblings)), torch.tensor(siblings)] = 1.0
            q = torch.cat([q[:1], one_hot, q[1:]])
        return DraftProposal(token_ids, q, parents)

    def rollback(self, session: SessionId, length: int, token_ids: Sequence[int] = ()) -> None:
        super().rollback(session, length, token_ids)
        # keep the sequence's last token out of the KV: the next propose feeds it to get its logits
        keep = min(length, len(self.tokens(session)) - 1)
        if self.runner.length(session) > keep:
            self.runner.truncate(session, keep)
        if keep < self._prefilled.get(session, (0,))[0]:  # below the prompt (no router does): nothing to keep
            del self._prefilled[session]

    def release(self, session: SessionId) -> None:
        prefilled, threads, salt = self._prefilled.pop(session, (0, 0, None))
        if prefilled and session in self._tokens and self.runner.has_session(session):
            self.prompt_cache.keep(session, self._tokens[session][:prefilled], threads, salt)
        super().release(session)
        self.runner.release(session)
