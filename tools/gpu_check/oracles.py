"""Drafters of known acceptance for the GPU check, and pacers that make them cost what a real draft costs.

`ControlledOracle` proposes the target's own greedy continuation (known from a plain decoding run) with
each token replaced by a wrong one with probability 1 − α: α = 1 is always right, α = 0 always wrong,
and in between the per-token acceptance is i.i.d. α, as `drafts/pipeline_model.py` assumes. With a
pacer it also runs one forward of a real-shaped draft per token (and discards its output), so its
cost ratio c is that draft's. `SiblingOracle` proposes token trees won by a sibling branch.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence

import torch

from cluster.model.runner import TorchModelRunner
from drafts.proposer import DraftProposal, SequenceProposer
from tools.gpu_check.timing import sync


class LlamaPacer:
    """One decode step of a draft Llama per drafted token, at a fixed context (the prompt's): `extend`
    by one token, read the argmax (the sync a draft model pays), roll the KV back."""

    def __init__(self, model: torch.nn.Module):
        self.runner = TorchModelRunner(model, name="pacer")
        self._base: dict = {}

    def start(self, session, prompt_ids: Sequence[int]) -> None:
        self.runner.add_session(session)
        self.runner.extend(session, list(prompt_ids[:-1]), num_logits=0)
        self._base[session] = (self.runner.length(session), int(prompt_ids[-1]))
        sync(self.runner.device)  # the prefill is done before another stream reads this KV

    def step(self, session) -> int:
        length, token = self._base[session]
        logits = self.runner.extend(session, [token], num_logits=1)  # [1, vocab_size]
        out = int(logits[0].argmax())
        self.runner.truncate(session, length)
        return out

    def release(self, session) -> None:
        self.runner.release(session)
        self._base.pop(session, None)


class FeaturePacer:
    """One step of the feature-fed draft per drafted token, as `FeatureProposer._advance` drafts beyond
    the committed point: fc([f̂; emb(x)]) -> its decoder layer (KV cache at the prompt's length) -> the
    reduced head's argmax; the cache is cropped back."""

    def __init__(self, draft):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.hidden = int(draft.embed.shape[1])
        self._state: dict = {}

    @torch.inference_mode()
    def start(self, session, prompt_ids: Sequence[int]) -> None:
        from transformers import DynamicCache

        n = len(prompt_ids) - 1
        cache = DynamicCache()
        feats = torch.randn(1, max(n, 1), self.hidden, device=self.device, dtype=self.dtype)  # [1, n, H]
        ids = torch.tensor([list(prompt_ids[1:]) or [0]], device=self.device)  # [1, n]
        self.draft(feats, ids, past=cache, pos=torch.arange(ids.shape[1], device=self.device)[None])
        self._state[session] = (cache, ids.shape[1], feats[:, -1:], ids[:, -1:])  # f̂ [1, 1, H], x [1, 1]
        sync(self.device)

    @torch.inference_mode()
    def step(self, session) -> int:
        cache, n, feat, token = self._state[session]
        out, _ = self.draft(feat, token, past=cache, pos=torch.tensor([[n]], device=self.device))  # [1, 1, H]
        best = int(self.draft.logits(out[0, -1]).argmax())
        cache.crop(n - cache.get_seq_length())  # negative: drop the step's entry
        return best

    def release(self, session) -> None:
        self._state.pop(session, None)


class ControlledOracle(SequenceProposer):
    """Proposes `references[prompt]` (the target's greedy continuation), each token corrupted to
    (token + 1) mod V with probability 1 − α (a fresh draw per proposal); `pacer` adds a real draft's
    cost per token, run on CUDA stream `stream` when given (so that it can overlap the verifier's)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int, alpha: float = 1.0,
                 seed: int = 0, pacer: LlamaPacer | FeaturePacer | None = None, stream=None):
        super().__init__()
        self.references, self.vocab_size, self.alpha = references, vocab_size, alpha
        self.rng = random.Random(seed)
        self.pacer, self.stream = pacer, stream
        self.name = f"oracle(alpha={alpha})"
        self._prompt_len: dict = {}

    def start(self, session, prompt_ids, params):
        super().start(session, prompt_ids, params)
        self._prompt_len[session] = len(prompt_ids)
        if self.pacer is not None:
            self.pacer.start(session, list(prompt_ids))

    def _reference(self, session) -> tuple[list[int], int]:
        tokens = self.tokens(session)
        n = self._prompt_len[session]
        return self.references[tuple(tokens[:n])], n

    def propose(self, session, k):
        tokens = self.tokens(session)
        reference, n = self._reference(session)
        out = []
        context = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with context:
            for _ in range(k):
                position = len(tokens) - n
                if position >= len(reference):
                    break
                if self.pacer is not None:
                    self.pacer.step(session)
                right = reference[position]
                token = right if self.rng.random() < self.alpha else (right + 1) % self.vocab_size
                tokens.append(token)
                out.append(token)
        return DraftProposal(out, None)

    def release(self, session):
        super().release(session)
        self._prompt_len.pop(session, None)
        if self.pacer is not None:
            self.pacer.release(session)


class SiblingOracle(ControlledOracle):
    """Token trees (`tree_width` 2) whose own chain starts with a wrong token and whose second root
    candidate is the reference's: every tree round is won by the sibling branch."""

    tree_width = 2

    def __init__(self, references, vocab_size: int):
        super().__init__(references, vocab_size, alpha=0.0)
        self.name = "sibling-oracle"

    def propose_batch(self, requests, trees=()):
        out = {}
        for session, k in requests.items():
            tokens = self.tokens(session)
            reference, n = self._reference(session)
            right = reference[len(tokens) - n: len(tokens) - n + k]
            if session not in trees or not right:
                out[session] = self.propose(session, k)
                continue
            wrong = [(t + 1) % self.vocab_size for t in right]
            tokens.extend(wrong)  # the proposer's own sequence follows its chain
            # nodes: wrong[0], right[0] (its sibling), then the wrong chain under wrong[0]
            parents = [-1, -1] + ([0, *range(2, len(wrong))] if len(wrong) > 1 else [])
            out[session] = DraftProposal([wrong[0], right[0], *wrong[1:]], None, parents)
        return out
