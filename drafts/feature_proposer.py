"""The feature-fed drafts as a proposer: the EAGLE-1 style `drafts.feature_model.FeatureDraft` and the EAGLE-3
`drafts.eagle3_model.Eagle3Draft`.

The draft reads the target's features: entry t of its one-layer KV cache is computed from (f_t, x_{t+1}) and
outputs f̂_{t+1}, whose head row predicts x_{t+2}. f_t is the target's last hidden state for the EAGLE-1
draft; for EAGLE-3 it is u_t, the draft's `fuse` of the states entering three target layers (the verifier
sends those side by side, its runner's `feature_layers`), and f̂ is the draft's own g. The verifier sends the target's
features of committed positions (`add_features`, through the loop's sync ops); beyond them the draft
feeds its own predicted features, as EAGLE does. Per session it keeps the tokens (committed plus its
own drafts), a feature per position (the target's for the first `real`, predicted up to `known`) and
its KV cache. A real feature that replaces a predicted one invalidates the cache entries computed
from the prediction (they are recomputed at the next `propose`). Without the features it needs (a
session whose verifier did not send them yet) it proposes nothing: a plain decoding step, never a
wrong output.

q is the draft's distribution over its reduced vocabulary, processed like the target's (temperature,
top-k, top-p) and written over the full vocabulary, so verification is lossless with any features.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cluster.core.config import EAGLE3_DRAFT
from cluster.core.processors import process_sequence
from cluster.core.sampling import RandomStream, SamplingParams, probabilities, sample
from cluster.core.tree import additive_mask, first_chain
from drafts.dynamic_tree import ROOT, Candidate, frontier, path_tokens, select_tree
from drafts.eagle3_model import KIND as EAGLE3_KIND
from drafts.proposer import DraftProposal, SequenceProposer, SessionId

FEATURE_DRAFT = "feature"  # engine.draft shorthand: the feature-fed draft shipped in drafts/trained
SHIPPED = Path(__file__).parent / "trained" / "feature-smollm2-135m"
SHIPPED_EAGLE3 = Path(__file__).parent / "trained" / "eagle3-smollm2-135m"


FEATURE_KINDS = ("feature", EAGLE3_KIND)  # tandem_draft.json kinds of drafts fed the target's features


def draft_meta(path: str | Path) -> dict:
    """A tandem draft directory's tandem_draft.json ({} when there is none or it is unreadable)."""
    meta = feature_draft_dir(path) / "tandem_draft.json"
    try:
        return json.loads(meta.read_text()) if meta.is_file() else {}
    except (OSError, ValueError):
        return {}


def is_feature_draft(path: str | Path) -> bool:
    """Whether `path` (or the shorthand `feature`) is a draft fed the target's features: the EAGLE-1 style
    feature draft (the target's last hidden state) or an EAGLE-3 draft (three layers' states, fused)."""
    return str(path) == FEATURE_DRAFT or draft_meta(path).get("kind") in FEATURE_KINDS


def is_eagle3_draft(path: str | Path) -> bool:
    """Whether `path` (or the shorthand `eagle3`) holds tandem's files of an EAGLE-3 draft."""
    return draft_meta(path).get("kind") == EAGLE3_KIND


def feature_layers(path: str | Path) -> tuple[int, ...] | None:
    """The target layers whose input states the draft at `path` reads (an EAGLE-3 draft's fused layers), or
    None for the target's last hidden state: what the torch runner captures for it (`feature_layers`)."""
    return tuple(draft_meta(path)["fusion_layers"]) if is_eagle3_draft(path) else None


def feature_draft_dir(path: str | Path) -> Path:
    """The directory of a feature-fed draft: a shorthand's shipped one, else `path`."""
    return {FEATURE_DRAFT: SHIPPED, EAGLE3_DRAFT: SHIPPED_EAGLE3}.get(str(path), Path(path).expanduser())


def target_features(model, ids: torch.Tensor, layers: Sequence[int] | None = None) -> torch.Tensor:
    """What the verifier's runner sends for `ids` [1, L]: the target's last hidden state  # [L, H], or with
    `layers` the states entering those layers side by side  # [L, len(layers) * H]."""
    if not layers:
        return model.model(input_ids=ids).last_hidden_state[0]
    states = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], -1)


@dataclass
class _State:
    feats: torch.Tensor  # [capacity, H]: a feature per position, the target's for [0, real), predicted to known
    cache: object  # the draft layer's KV cache (transformers DynamicCache): entry t from (f_t, x_{t+1})
    real: int = 0
    known: int = 0
    stats: dict = field(default_factory=lambda: {"no_features": 0})


class FeatureProposer(SequenceProposer):
    name = "feature"
    needs_features = True  # the verifier sends the target's last hidden state of committed positions

    def __init__(self, draft, max_support: int | None = None, tree_width: int = 1, tree_tokens: int = 16):
        """`draft`: a loaded `FeatureDraft` (`drafts.training.feature_draft.load_feature_draft`). `max_support`: sample
        from the draft's `max_support` most likely tokens (renormalised), so q crosses the wire compactly.
        `tree_width` > 1: sequential rounds are EAGLE-2 dynamic trees (`_propose_tree`) of at most
        `tree_tokens` nodes."""
        super().__init__()
        self.tree_width, self.tree_tokens = tree_width, tree_tokens
        self.draft = draft.eval()
        self.hidden_size = int(draft.embed.shape[1])
        self.vocab_size = int(draft.embed.shape[0])  # the target's vocabulary
        self.dtype = draft.fc.weight.dtype
        self.device = draft.fc.weight.device  # its state lives beside its weights (CPU or CUDA)
        self.max_support = max_support
        self.max_predicted = 16  # positions drafted from predicted features before the target's are needed
        self._state: dict[SessionId, _State] = {}
        self.proposals_without_features = 0  # rounds it could not draft for lack of the target's features

    def start(self, session: SessionId, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        from transformers import DynamicCache

        super().start(session, prompt_ids, params)
        self._state[session] = _State(torch.zeros(max(64, 2 * len(prompt_ids)), self.hidden_size, dtype=self.dtype,
                                                  device=self.device),
                                      DynamicCache())

    def release(self, session: SessionId) -> None:
        super().release(session)
        self._state.pop(session, None)

    # -- features ---------------------------------------------------------------------------------

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """What the verifier's runner must capture for it (`TorchModelRunner.feature_layers`)."""
        return self.draft.feature_layers

    @torch.inference_mode()
    def add_features(self, session: SessionId, start: int, rows: torch.Tensor) -> None:
        """The target's features of positions start .. start + len(rows) - 1  # rows [m, W] (W: the draft's
        `feature_width`; an EAGLE-3 draft fuses its three layers' states into one H-wide input here).
        Positions after them lose their predicted features (they were drafted from the predictions)."""
        st = self._state.get(session)
        if st is None or len(rows) == 0:
            return
        if rows.shape[-1] != self.draft.feature_width:
            raise ValueError(f"features of width {rows.shape[-1]}, the draft reads {self.draft.feature_width}")
        if start > st.real:  # a gap (features lost on the way): drafting waits for a full resend
            return
        end = start + len(rows)
        self._room(st, end)
        st.feats[start:end] = self.draft.fuse(rows.to(self.device, self.dtype))
        st.real = st.known = end
        self._crop(st, start)  # entries from `start` on were computed from predicted features

    @staticmethod
    def _crop(st: _State, entries: int) -> None:
        if st.cache.get_seq_length() > entries:
            st.cache.crop(entries - st.cache.get_seq_length())

    def _room(self, st: _State, n: int) -> None:
        if n > len(st.feats):
            grown = torch.zeros(max(n, 2 * len(st.feats)), self.hidden_size, dtype=self.dtype, device=self.device)
            grown[: len(st.feats)] = st.feats
            st.feats = grown

    def rollback(self, session: SessionId, length: int, token_ids: Sequence[int] = ()) -> None:
        super().rollback(session, length, token_ids)
        st = self._state[session]
        st.real, st.known = min(st.real, length), min(st.known, length)  # f_p depends on x_0 .. x_p
        self._crop(st, max(length - 1, 0))  # entry t read x_{t+1}

    # -- drafting ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def _advance(self, st: _State, tokens: list[int], upto: int) -> torch.Tensor:
        """Compute the cache entries up to `upto` - 1 and return the last one's output f̂_upto  # [H]:
        the entries whose features are known in one forward, then one at a time (each output is the next
        position's predicted feature)."""
        if st.cache.get_seq_length() >= upto:
            self._crop(st, upto - 1)  # recompute the last entry for its output
        out = None
        while st.cache.get_seq_length() < upto:
            t = st.cache.get_seq_length()
            end = min(upto, st.known) if t < st.known else t + 1
            feats = st.feats[t:end][None]  # [1, n, H]
            ids = torch.tensor([tokens[t + 1:end + 1]], dtype=torch.long, device=self.device)  # [1, n]
            pos = torch.arange(t, end, device=self.device)[None]
            hidden, _ = self.draft(feats, ids, past=st.cache, pos=pos)  # [1, n, H]
            out = hidden[0, -1]
            if end >= st.known:  # the output is the first position without a feature
                self._room(st, end + 1)
                st.feats[end] = out
                st.known = end + 1
        return out

    def propose(self, session: SessionId, k: int) -> DraftProposal:
        return self.propose_batch({session: k})[session]

    def propose_batch(self, requests: dict[SessionId, int], trees: Collection[SessionId] = ()
                      ) -> dict[SessionId, DraftProposal]:
        """Each session in turn (the draft is one layer: batching would save little). `trees`: sessions
        whose round may be a token tree (sequential rounds): with `tree_width` > 1, EAGLE-2's dynamic tree."""
        return {s: self._propose_tree(s, k) if s in trees and self.tree_width > 1 else self._propose(s, k)
                for s, k in requests.items()}

    def _ready(self, st: _State, n: int, k: int) -> bool:
        if k <= 0 or n < 2 or st.known == 0 or n - 1 - st.known > self.max_predicted:
            if k > 0:
                self.proposals_without_features += 1
            return False
        return True

    def _log_q(self, feats: torch.Tensor, params: SamplingParams, tokens: list[int],
               paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's log-probabilities after each of `feats`  # [f, H] (row i continues tokens + paths[i]),
        as (values, target token ids)  # [f, K] each, over its reduced vocabulary or, where processors act,
        processed like the target's over the full one."""
        logits = self.draft.logits(feats).float()  # [f, K]
        if not params.processes_logits:
            return logits.log_softmax(-1), self.draft.vocab.expand(len(feats), -1)
        full = torch.full((len(feats), self.vocab_size), float("-inf"), device=logits.device)
        full[:, self.draft.vocab] = logits
        full = process_sequence(full, params, tokens, paths)  # [f, vocab_size]
        return full.log_softmax(-1), torch.arange(self.vocab_size, device=logits.device).expand(len(feats), -1)

    @torch.inference_mode()
    def _propose_tree(self, session: SessionId, k: int) -> DraftProposal:
        """A dynamic tree k deep (`drafts.dynamic_tree`): each depth expands its `tree_width` best nodes in
        one forward of the draft layer (tree attention: each node attends to the committed entries, its
        ancestors and itself), each scoring `tree_width` children; the best `tree_tokens` nodes are kept.
        The tree's entries leave the draft's cache afterwards; its first chain joins the sequence."""
        tokens, params, st = self.tokens(session), self._params[session], self._state[session]
        n = len(tokens)
        if not self._ready(st, n, k):
            return DraftProposal([])
        feats = self._advance(st, tokens, n - 1)[None]  # [1, H]: f̂_{n-1}, the root's
        base = st.cache.get_seq_length()  # n - 1 committed entries
        width, cands = self.tree_width, []
        rows: list[int] = [ROOT]  # the candidate each row of `feats` belongs to (ROOT: the root)
        slots: dict[int, int] = {}  # expanded candidate -> its entry in the cache, after `base`
        for depth in range(k):
            paths = [path_tokens(cands, r) for r in rows]
            logq, ids = self._log_q(feats, params, tokens, paths)  # [f, K]
            top = logq.topk(min(width, logq.shape[-1]), dim=-1)
            first = len(cands)
            for r, parent in enumerate(rows):
                base_score = 0.0 if parent == ROOT else cands[parent].score
                for value, j in zip(top.values[r].tolist(), top.indices[r].tolist()):
                    if value != float("-inf"):
                        cands.append(Candidate(int(ids[r, j]), parent, base_score + value, depth))
            if depth + 1 == k or len(cands) == first:
                break
            parents, rows = rows, frontier(cands, range(first, len(cands)), width)
            feats = self._expand(st, base, cands, rows, parents, feats, slots, n)
        self._crop(st, base)
        if not cands:
            return DraftProposal([])
        token_ids, parents = select_tree(cands, self.tree_tokens)
        tokens.extend(first_chain(token_ids, parents))
        return DraftProposal(token_ids, None, parents)

    def _expand(self, st: _State, base: int, cands: list[Candidate], nodes: list[int], parents: list[int],
                feats: torch.Tensor, slots: dict[int, int], n: int) -> torch.Tensor:
        """Run the draft layer on `nodes`, each from its parent's output feature (the row of `feats`  # [f, H]
        that `parents` gives it) and its own token, at position n - 1 + depth; returns their outputs
        # [len(nodes), H]. Their entries join the cache after those of the depths before."""
        row_of = {c: r for r, c in enumerate(parents)}
        m, cached = len(nodes), st.cache.get_seq_length()
        inputs = feats[torch.tensor([row_of[cands[c].parent] for c in nodes], device=feats.device)]  # [m, H]
        ids = torch.tensor([[cands[c].token for c in nodes]], dtype=torch.long, device=self.device)  # [1, m]
        pos = torch.tensor([[n - 1 + cands[c].depth for c in nodes]], dtype=torch.long, device=self.device)
        allowed = torch.zeros(m, cached + m, dtype=torch.bool)  # [m, cached + m]
        allowed[:, :base] = True
        for i, c in enumerate(nodes):
            a = cands[c].parent
            while a != ROOT:  # every ancestor was expanded, so has an entry
                allowed[i, slots[a]] = True
                a = cands[a].parent
            slots[c] = cached + i
            allowed[i, slots[c]] = True
        mask = additive_mask(allowed, self.dtype)[None, None].to(self.device)
        hidden, _ = self.draft(inputs[None], ids, past=st.cache, pos=pos, mask=mask)
        return hidden[0]

    @torch.inference_mode()
    def _propose(self, session: SessionId, k: int) -> DraftProposal:
        tokens, params, st = self.tokens(session), self._params[session], self._state[session]
        n = len(tokens)
        if not self._ready(st, n, k):
            return DraftProposal([])
        out = self._advance(st, tokens, n - 1)  # f̂_{n-1}: predicts x_n
        drafts, rows = [], []
        for step in range(k):
            logits = self.draft.logits(out[None])[0].float()  # [K]
            if params.greedy and not params.processes_logits:
                token = int(self.draft.vocab[int(logits.argmax())])
            else:
                full = torch.full((self.vocab_size,), float("-inf"), device=logits.device)
                full[self.draft.vocab] = logits.float()
                full = process_sequence(full[None], params, tokens)  # [1, vocab_size], as the target's here
                if params.greedy:
                    token = int(full[0].argmax())
                else:
                    q = probabilities(full, params)[0]  # [vocab_size]
                    if self.max_support and self.max_support < int((q > 0).sum()):
                        top = torch.topk(q, self.max_support)
                        q = torch.zeros_like(q).scatter_(0, top.indices, top.values / top.values.sum())
                    token = sample(q, params.seed or 0, len(tokens), RandomStream.DRAFT)
                    rows.append(q)
            tokens.append(token)
            drafts.append(token)
            if step + 1 < k:
                out = self._advance(st, tokens, len(tokens) - 1)
        return DraftProposal(drafts, torch.stack(rows) if rows else None)
