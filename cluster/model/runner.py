"""The torch model runner: one causal LM, many sessions, each with its own KV cache.

Verbs: `add_session`, `extend(session, token_ids) -> logits for the new positions`, `truncate(session,
length)` (rollback: moves a cursor, never copies), `release`. `extend_batch` extends several sessions
in one forward pass. The model definition is Hugging Face `transformers`' own; the runner only owns
the cache layout (a growable buffer with a length cursor per layer, gpt-fast style).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable

import torch
from transformers.cache_utils import Cache

from cluster.core.errors import InvalidRequestError, TandemError
from cluster.core.tree import additive_mask
from cluster.model.cache import new_cache
from cluster.model.graphs import GraphedDecode
from cluster.model.packed import PackedCache, chain_mask, packed_attention, placeholder_mask
from cluster.model.prompt_cache import PromptCache

if TYPE_CHECKING:
    from cluster.core.tree import TokenTree

SessionId = Hashable
log = logging.getLogger(__name__)


class UnknownSessionError(TandemError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass
class _Session:
    cache: Cache

    @property
    def length(self) -> int:
        return self.cache.layers[0].get_seq_length()


class TorchModelRunner:
    """Runs one Hugging Face causal LM on CPU or CUDA for many sessions."""

    batches_trees = True  # extend_batch scores token trees beside chains in one forward

    def __init__(self, model: torch.nn.Module, name: str = "model", cuda_graphs: int = 0,
                 graph_capacity: int = 2048, capture: bool | None = None, graph_tokens: int = 8,
                 feature_layers: Sequence[int] | None = None, prompt_cache_tokens: int = 0):
        """`cuda_graphs` > 0: up to that many sessions at once hold a fixed buffer of `graph_capacity`
        tokens, and their steps of up to `graph_tokens` tokens (plain and draft steps, chain
        verification) replay CUDA graphs (graphs.py). Without CUDA it is ignored
        (logged) unless `capture=False` asks for the same static forward run eagerly, which is how its
        exactness is tested without a GPU. `feature_layers`: what a captured session's features are (below).
        `prompt_cache_tokens`: the prompts' KV kept after their sessions end, for a later session (of any engine
        or proposer on this runner) that prefills exactly the same tokens (`prompt_cache`); 0: none (the engines
        `EngineConfig` builds keep `prompt_cache_tokens`, `PROMPT_CACHE_TOKENS` by default)."""
        self.model = model.eval()
        self.name = name
        config = model.config.get_text_config(decoder=True)
        self.num_layers: int = config.num_hidden_layers
        self.vocab_size: int = config.vocab_size
        self.max_context: int = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.device: torch.device = next(model.parameters()).device
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self._sessions: dict[SessionId, _Session] = {}
        self._kept: set[SessionId] = set()  # sessions that hold a prompt's KV (`add_session(kept=True)`)
        self.prompt_cache = PromptCache(self, prompt_cache_tokens, name=f"{name}/prompt-cache")
        self._ids = itertools.count()
        # sessions whose features each forward keeps, for a feature-fed draft; `hidden[session]` holds the last
        # forward's rows  # [new positions, H] bf16: the last hidden state (post-norm: what the head reads), or
        # with `feature_layers` (an EAGLE-3 draft's fused layers) the states entering those layers side by
        # side  # [new positions, len(feature_layers) * H]
        self.capture: set[SessionId] = set()
        self.hidden: dict[SessionId, torch.Tensor] = {}
        self.feature_layers = tuple(feature_layers) if feature_layers else None
        if self.feature_layers and not all(0 <= i < self.num_layers for i in self.feature_layers):
            raise ValueError(f"feature layers {self.feature_layers} outside the target's {self.num_layers} layers")
        if cuda_graphs and self.device.type != "cuda" and capture is None:
            log.warning("%s: cuda_graphs ignored on %s (CUDA graphs need a CUDA device)", name, self.device)
            cuda_graphs = 0
        self.graphs = GraphedDecode(self.model, min(graph_capacity, self.max_context), cuda_graphs, capture,
                                    graph_tokens) if cuda_graphs else None

    # -- sessions -----------------------------------------------------------------------------

    def add_session(self, session: SessionId | None = None, capacity: int = 256, kept: bool = False) -> SessionId:
        """`capacity`: the tokens its buffers start with (they grow by doubling). `kept`: a session that only
        holds KV for others to copy (`prompt_cache`): never a CUDA-graph slot, not in `num_sessions`."""
        session = next(self._ids) if session is None else session
        if session in self._sessions:
            raise InvalidRequestError(f"session {session!r} already exists on {self.name}")
        self._sessions[session] = _Session(new_cache(self.num_layers, capacity))
        if kept:
            self._kept.add(session)
        elif self.graphs is not None:
            self.graphs.attach(self._sessions[session].cache, session)
        return session

    def _get(self, session: SessionId) -> _Session:
        try:
            return self._sessions[session]
        except KeyError:
            raise UnknownSessionError(f"unknown session {session!r} on {self.name}") from None

    def has_session(self, session: SessionId) -> bool:
        return session in self._sessions

    def length(self, session: SessionId) -> int:
        return self._get(session).length

    @property
    def num_sessions(self) -> int:
        """Sessions of requests (not the kept prompts': `num_kept`)."""
        return len(self._sessions) - len(self._kept)

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    def truncate(self, session: SessionId, length: int) -> None:
        """Roll back to the first `length` tokens: moves each layer's cursor."""
        state = self._get(session)
        if not 0 <= length <= state.length:
            raise ValueError(f"cannot truncate session {session!r} of length {state.length} to {length}")
        state.cache.crop(length)

    def share_prefix(self, source: SessionId, session: SessionId, length: int) -> None:
        """Give the empty `session` the keys and values of `source`'s first `length` tokens (the same prompt
        prefilled once for several sessions, as `n` choices open it): copied once, each session then writes
        its own cache from there on."""
        src, dst = self._get(source), self._get(session)
        if dst.length or not 0 < length <= src.length:
            raise ValueError(f"cannot share {length} tokens of {source!r} (length {src.length}) with "
                             f"{session!r} (length {dst.length})")
        for s_layer, d_layer in zip(src.cache.layers, dst.cache.layers):
            d_layer.copy_prefix(s_layer, length)

    def release(self, session: SessionId) -> None:
        state = self._sessions.pop(session, None)
        self._kept.discard(session)
        if state is not None and self.graphs is not None:
            self.graphs.detach(state.cache)
        self.capture.discard(session)
        self.hidden.pop(session, None)

    @property
    def supports_features(self) -> bool:
        """Whether `capture` works: a decoder and a plain linear head (no logit soft-capping)."""
        config = self.model.config.get_text_config(decoder=True)
        return (hasattr(self.model, "get_decoder") and hasattr(self.model, "lm_head")
                and not getattr(config, "final_logit_softcapping", None))

    @property
    def feature_width(self) -> int:
        """The width of a captured position's features."""
        hidden = self.model.config.get_text_config(decoder=True).hidden_size
        return hidden * (len(self.feature_layers) if self.feature_layers else 1)

    def _forward(self, sessions: Sequence[SessionId], rows: Sequence[int], logits_to_keep, starts=None, **kwargs):
        """The model's forward; logits  # [B, kept, vocab_size]. For sessions in `capture`, the features
        (`feature_layers`) of their first `rows[i]` positions (from `starts[i]` of the one packed row when
        given) go to `hidden` (the head then reads the decoder's own last hidden state: the logits are the
        model's own)."""
        with packed_attention(self.model, packed=starts is not None):
            if not self.capture.intersection(sessions):
                return self.model(logits_to_keep=logits_to_keep, **kwargs).logits
            if self.feature_layers:
                out = self.model.get_decoder()(output_hidden_states=True, **kwargs)
                hidden = out.last_hidden_state  # [B, n, H]
                feats = torch.cat([out.hidden_states[i] for i in self.feature_layers], -1)  # [B, n, 3H]
            else:
                hidden = feats = self.model.get_decoder()(**kwargs).last_hidden_state  # [B, n, H]
        for i, s in enumerate(sessions):
            if s in self.capture:
                b, at = (0, starts[i]) if starts is not None else (i, 0)
                self.hidden[s] = feats[b, at: at + rows[i]].to("cpu", torch.bfloat16)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return self.model.lm_head(hidden[:, keep, :])

    def _all_logits(self, **kwargs) -> torch.Tensor:
        return self.model(logits_to_keep=0, **kwargs).logits  # [1, n, V]

    # -- forward ------------------------------------------------------------------------------

    def _check_room(self, state: _Session, session: SessionId, n: int) -> None:
        if state.length + n > self.max_context:
            raise InvalidRequestError(
                f"session {session!r} would reach {state.length + n} tokens, over the "
                f"{self.max_context}-token context of {self.name}"
            )

    @torch.inference_mode()
    def extend(self, session: SessionId, token_ids: Sequence[int], num_logits: int | None = None) -> torch.Tensor:
        """Append `token_ids` to the session; return float32 logits of the last `num_logits` new
        positions (all of them by default)  # [num_logits, vocab_size]"""
        state = self._get(session)
        n = len(token_ids)
        if n == 0:
            return torch.empty(0, self.vocab_size)
        self._check_room(state, session, n)
        num_logits = n if num_logits is None else min(num_logits, n)
        if self.graphs is not None and session not in self.capture:
            logits = self.graphs.step(state.cache, token_ids, self._all_logits)  # [n, V] or None
            if logits is not None:
                return logits[n - num_logits:]
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        start = state.length
        position_ids = torch.arange(start, start + n, device=self.device)[None]  # [1, n]
        logits = self._forward([session], [n], max(num_logits, 1), input_ids=input_ids, position_ids=position_ids,
                               past_key_values=state.cache, use_cache=True)[0].float()  # [max(num_logits, 1), vocab_size]
        return logits[logits.shape[0] - num_logits :]

    @torch.inference_mode()
    def extend_batch(self, requests: Mapping[SessionId, Sequence[int]],
                     num_logits: Mapping[SessionId, int] | None = None,
                     trees: Mapping[SessionId, tuple[int, "TokenTree"]] | None = None) -> dict[SessionId, torch.Tensor]:
        """Extend several sessions in one forward pass, packed (packed.py): their new tokens are one
        sequence for the weights, each at its own position; each attends to its own cache only, which
        it extends in place. `trees`: sessions whose new tokens are `num_prefix` committed tokens and
        then a token tree's nodes (`requests[s]` = prefix + tree.token_ids), scored as `extend_tree`
        scores them (all their logits are returned; `keep_tree_path` keeps the accepted branch).
        """
        requests = {s: list(t) for s, t in requests.items() if len(t) > 0}
        trees = {s: t for s, t in (trees or {}).items() if s in requests}
        if len(requests) <= 1:
            return {s: self.extend_tree(s, t[: trees[s][0]], trees[s][1]) if s in trees
                    else self.extend(s, t, (num_logits or {}).get(s)) for s, t in requests.items()}
        sessions = list(requests)
        states = [self._get(s) for s in sessions]
        for s, state in zip(sessions, states):
            self._check_room(state, s, len(requests[s]))
        dev = self.device
        counts = [len(requests[s]) for s in sessions]
        positions, masks, keep = [], [], []
        for s, state, n in zip(sessions, states, counts):
            if s in trees:
                pos, allowed = _tree_layout(state.length, *trees[s])
                masks.append(allowed[None, None].to(dev))  # [1, 1, n, length + n]
                keep.append(n)
            else:
                pos = torch.arange(state.length, state.length + n)
                masks.append(chain_mask(state.length, n, dev))
                keep.append(min((num_logits or {}).get(s, n), n))
            positions.append(pos)
        cache = PackedCache([state.cache for state in states], counts, masks)
        rows = torch.cat([torch.arange(start + n - k, start + n) for start, n, k in zip(cache.starts, counts, keep)])
        input_ids = torch.tensor([[t for s in sessions for t in requests[s]]], dtype=torch.long, device=dev)  # [1, N]
        logits = self._forward(sessions, counts, rows.to(dev), starts=cache.starts, input_ids=input_ids,
                               position_ids=torch.cat(positions)[None].to(dev),  # [1, N]
                               attention_mask=placeholder_mask(dev), past_key_values=cache,
                               use_cache=True)[0].float()  # [sum(keep), vocab_size]
        out, at = {}, 0
        for s, k in zip(sessions, keep):
            out[s] = logits[at:at + k]
            at += k
        return out

    # -- token trees ----------------------------------------------------------------------------
    # One session per call (`extend_batch(trees=...)` batches trees across sessions). Works with any attention implementation
    # that takes transformers' additive 4-D float mask (sdpa and eager: a prepared 4-D mask is
    # passed through `create_causal_mask` unchanged).

    @torch.inference_mode()
    def extend_tree(self, session: SessionId, prefix_ids: Sequence[int], tree: "TokenTree") -> torch.Tensor:
        """Append `prefix_ids` (committed tokens not yet cached, run causally) and then the tree's
        nodes in one forward: node i sits at position base + depth(i) (base = length after the
        prefix) and attends to the cache, the prefix and its own ancestors only.

        Returns float32 logits  # [len(prefix_ids) + n, vocab_size]: row len(prefix_ids) - 1 is the
        root's distribution and row len(prefix_ids) + i the distribution after node i, so
        `logits[len(prefix_ids) - 1:]` are `tree_rejection_sample`'s target_logits (with an empty
        prefix the root row must come from the previous forward). Every node stays in the cache
        (at base + i) until `keep_tree_path` keeps the accepted branch."""
        state = self._get(session)
        num_prefix, n = len(prefix_ids), len(tree)
        if num_prefix + n == 0:
            return torch.empty(0, self.vocab_size)
        self._check_room(state, session, num_prefix + n)
        input_ids = torch.tensor([[*prefix_ids, *tree.token_ids]], dtype=torch.long, device=self.device)  # [1, P + n]
        positions, allowed = _tree_layout(state.length, num_prefix, tree)
        mask = additive_mask(allowed, self.dtype)
        return self._forward([session], [num_prefix + n], 0, input_ids=input_ids,
                             position_ids=positions[None].to(self.device),
                             attention_mask=mask[None, None].to(self.device),  # [1, 1, P + n, total]
                             past_key_values=state.cache, use_cache=True)[0].float()

    @torch.inference_mode()
    def keep_tree_path(self, session: SessionId, num_prefix_cached: int, node_path: Sequence[int],
                       tree: "TokenTree | None" = None) -> None:
        """After `extend_tree`: keep only the accepted branch. `num_prefix_cached` is the session's
        length before the tree's nodes (its length before `extend_tree` plus the prefix);
        `node_path` the accepted nodes, root's child first (`TreeResult.node_path`; checked to be a
        root-to-node path when `tree` is given). The accepted nodes' keys/values are copied down to
        consecutive slots after the prefix (they were computed at those positions already: position
        = base + depth) and the cursor moves past them, so the cache equals that of a plain
        `extend` of prefix + accepted tokens."""
        state = self._get(session)
        path = [int(i) for i in node_path]
        num_nodes = state.length - num_prefix_cached
        if num_nodes < 0 or num_prefix_cached < 0:
            raise ValueError(f"session {session!r} of length {state.length} has no tree after {num_prefix_cached}")
        if any(not 0 <= i < num_nodes for i in path) or any(b <= a for a, b in zip(path, path[1:])):
            raise ValueError(f"node path {path} is not increasing within the {num_nodes} cached nodes")
        if tree is not None and path and (len(tree) != num_nodes or tree.path(path[-1]) != path):
            raise ValueError(f"node path {path} is not a root-to-node path of the tree")
        if path != list(range(len(path))):  # else the branch is in place already
            index = torch.tensor(path, dtype=torch.long, device=self.device) + num_prefix_cached
            end = num_prefix_cached + len(path)
            for layer in state.cache.layers:
                layer.keys[:, :, num_prefix_cached:end] = layer.keys.index_select(2, index)
                layer.values[:, :, num_prefix_cached:end] = layer.values.index_select(2, index)
        state.cache.crop(num_prefix_cached + len(path))


def _tree_layout(start: int, num_prefix: int, tree: "TokenTree") -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and mask of `num_prefix` committed tokens (causal) then a tree's nodes after `start`
    cached tokens: node i at base + depth(i) (base = start + num_prefix), seeing the cache, the prefix
    and its own ancestors.  # [P + n], [P + n, start + P + n] bool"""
    n = len(tree)
    base = start + num_prefix
    positions = torch.cat([torch.arange(start, base), base + torch.tensor(tree.position_offsets(), dtype=torch.long)])
    allowed = torch.zeros(num_prefix + n, base + n, dtype=torch.bool)
    allowed[:, :start] = True
    allowed[:num_prefix, start:base] = torch.ones(num_prefix, num_prefix, dtype=torch.bool).tril()
    allowed[num_prefix:, start:base] = True
    allowed[num_prefix:, base:] = tree.attention_mask()
    return positions, allowed
