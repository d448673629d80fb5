"""Token trees and their lossless verification: a pure function of token ids and probabilities.

A `TokenTree` holds several candidate continuations at once (siblings: alternative tokens at one
position). The target scores every node in one forward (`TorchModelRunner.extend_tree`: each node
attends to the committed tokens and its own ancestors only), `tree_rejection_sample` walks down the
tree accepting at most one child per level, and `TorchModelRunner.keep_tree_path` keeps the accepted
branch's keys/values. A chain tree gives exactly `cluster.core.rejection.rejection_sample`'s result.

Sibling scheme (what makes sampling lossless)
--------------------------------------------
At a node with candidate children c_1..c_m (in node-index order, which must be the order the
proposer produced them), let p_1 be the target's distribution there. For j = 1..m:

    accept c_j with probability min(1, p_j(c_j) / q_j(c_j)); else p_{j+1} = norm(max(0, p_j - q_j))

and when every child is rejected the recovered token is drawn from p_{m+1}. Here q_j is
`draft_probs[c_j]`: the distribution c_j was *actually drawn from*, given its parent path and its
earlier siblings c_1..c_{j-1}. By induction on the candidates left, the emitted token follows p_1
exactly whenever c_j really is a draw from q_j given everything before it (the accept step emits x
with probability min(p_j(x), q_j(x)), and the rejected remainder, whose mass is 1 - sum min(p_j, q_j),
is handed to a continuation that emits p_{j+1} by induction, for any c_j). Three ways of producing
siblings satisfy this (`sibling_draft_probs` builds their rows):

- `SiblingScheme.IID`: every sibling an independent draw from the same q (with replacement):
  q_j = q for all j. Siblings share their parent's q row. A repeated token is a real draw: it must
  stay a node of its own (the tree allows siblings with the same token only when their rows are
  equal), since each draw advances the residual; it can never be accepted after the first copy was
  rejected (p_j(x) = 0 then), so it needs no children.
- `SiblingScheme.WITHOUT_REPLACEMENT`: sibling j drawn from q with c_1..c_{j-1} removed and
  renormalised (distinct siblings, the better use of a node).
- `SiblingScheme.DETERMINISTIC`: the siblings are chosen, not sampled (the draft's top-k, several
  n-gram matches): q_j = one-hot(c_j), so c_j is accepted with probability p_j(c_j), the current
  residual, and rejecting it removes its mass and renormalises. `draft_probs=None` means this for
  every node. A deterministic top-k is *not* a sample from q: giving it q rows is lossy (the tests
  show the sampler's output then drifts from p).

Rows may mix schemes across sibling groups (e.g. deterministic top-2 at the first position, then a
sampled chain): each node's row is simply how that node was produced.

Random numbers come from (seed, position, stream) as in `cluster.core.rejection`: the first child at a
position uses `RandomStream.ACCEPT` and a later sibling j (0-based) a stream of its own
(`_SIBLING_STREAM + j`); the recovered or bonus token uses `RandomStream.TARGET`. Only one sibling
group is tested per position, so no uniform is ever used twice.

Greedy decoding (temperature 0) walks down taking the child equal to the target's argmax and emits
the argmax where no child matches (recovered if the node had children, bonus at a leaf).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cluster.core.rejection import RejectionResult, residual_distribution
from cluster.core.sampling import RandomStream, SamplingParams, position_generator, probabilities, sample

ROOT = -1  # the parent of depth-0 nodes: the last committed token
_SIBLING_STREAM = 1 << 20  # uniforms of sibling attempts j >= 1 use stream _SIBLING_STREAM + j


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True: may attend) as the additive float mask transformers takes: 0 where
    allowed, the dtype's lowest value elsewhere. Same shape."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


class SiblingScheme(enum.Enum):
    """How a group of sibling candidates was produced (see the module docstring)."""

    IID = "iid"
    WITHOUT_REPLACEMENT = "without_replacement"
    DETERMINISTIC = "deterministic"


def sibling_draft_probs(q: torch.Tensor, token_ids: Sequence[int], scheme: SiblingScheme) -> torch.Tensor:
    """The `draft_probs` rows of one sibling group  # [m, vocab_size].

    q          # [vocab_size]: the draft's distribution at the siblings' position (given their parent)
    token_ids  # [m]: the siblings in the order they were produced
    """
    m, vocab = len(token_ids), q.shape[-1]
    if scheme is SiblingScheme.DETERMINISTIC:
        rows = torch.zeros(m, vocab, dtype=q.dtype, device=q.device)
        rows[torch.arange(m), torch.tensor(list(token_ids), dtype=torch.long)] = 1.0
        return rows
    if scheme is SiblingScheme.IID:
        return q.expand(m, vocab).clone()
    rows, remaining = [], q.clone()
    for t in token_ids:
        total = remaining.sum()
        if total <= 0 or remaining[t] <= 0:
            raise ValueError(f"sibling {t} cannot be drawn without replacement from q")
        rows.append(remaining / total)
        remaining = remaining.clone()
        remaining[t] = 0.0
    return torch.stack(rows) if rows else q.new_zeros(0, vocab)


def first_chain(token_ids: Sequence[int], parents: Sequence[int] | None) -> list[int]:
    """The proposer's own continuation in a tree (`parents` in `TokenTree` order): the first child at
    each level from the root; a chain (`parents` None) is itself."""
    if parents is None:
        return list(token_ids)
    out, node = [], ROOT
    while (child := next((i for i, parent in enumerate(parents) if parent == node), None)) is not None:
        out.append(token_ids[child])
        node = child
    return out


@dataclass(frozen=True, eq=False)
class TokenTree:
    """Draft tokens as a tree over the last committed token (the root, not a node).

    token_ids    # [n]: nodes in topological order (node i's parent has a smaller index)
    parents      # [n]: parent node index, ROOT (-1) for a child of the root
    draft_probs  # [n, vocab_size] or None: row i is the distribution node i's token was drawn from,
                 #   given its parent path and its earlier siblings (see the module docstring);
                 #   for i.i.d. siblings that is their parent's q row, shared; None: every node was
                 #   chosen deterministically (one-hot q), e.g. greedy drafts, top-k, n-gram matches.
    """

    token_ids: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None = None
    _depths: list[int] = field(init=False, repr=False)
    _children: dict[int, list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        token_ids, parents = [int(t) for t in self.token_ids], [int(p) for p in self.parents]
        object.__setattr__(self, "token_ids", token_ids)
        object.__setattr__(self, "parents", parents)
        n = len(token_ids)
        if len(parents) != n:
            raise ValueError(f"{n} tokens but {len(parents)} parents")
        depths: list[int] = []
        children: dict[int, list[int]] = {ROOT: []}
        for i, (t, parent) in enumerate(zip(token_ids, parents)):
            if t < 0:
                raise ValueError(f"node {i} has a negative token id {t}")
            if not ROOT <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come first (-1 <= parent < {i})")
            depths.append(0 if parent == ROOT else depths[parent] + 1)
            children.setdefault(parent, []).append(i)
            children[i] = []
        q = self.draft_probs
        if q is not None:
            if q.dim() != 2 or q.shape[0] != n:
                raise ValueError(f"draft_probs has shape {tuple(q.shape)}, want ({n}, vocab_size)")
            if n and max(token_ids) >= q.shape[1]:
                raise ValueError(f"token id {max(token_ids)} is outside draft_probs' vocabulary of {q.shape[1]}")
            if n:
                own = q[torch.arange(n), torch.tensor(token_ids, dtype=torch.long)]
                bad = torch.nonzero(~(own > 0)).flatten().tolist()
                if bad:
                    raise ValueError(f"node {bad[0]} (token {token_ids[bad[0]]}) has draft probability 0 in its own row")
        for parent, kids in children.items():
            seen: dict[int, int] = {}
            for c in kids:
                t = token_ids[c]
                if t in seen and (q is None or not torch.equal(q[seen[t]], q[c])):
                    raise ValueError(
                        f"siblings {seen[t]} and {c} (children of {parent}) share token {t}: only repeated "
                        "i.i.d. draws (equal draft_probs rows) may repeat a token"
                    )
                seen.setdefault(t, c)
        object.__setattr__(self, "_depths", depths)
        object.__setattr__(self, "_children", children)

    # -- builders -----------------------------------------------------------------------------

    @classmethod
    def chain(cls, token_ids: Sequence[int], probs: torch.Tensor | None = None) -> "TokenTree":
        """A linear tree: node i is the child of node i - 1 (the ordinary draft chain)."""
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), probs)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "TokenTree":
        """A deterministic tree (draft_probs None) holding every path, common prefixes merged
        (e.g. several n-gram continuations). Siblings keep the order their paths come in."""
        token_ids: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for path in paths:
            parent = ROOT
            for t in path:
                key = (parent, int(t))
                if key not in index:
                    index[key] = len(token_ids)
                    token_ids.append(int(t))
                    parents.append(parent)
                parent = index[key]
        return cls(token_ids, parents, None)

    # -- shape --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def deterministic(self) -> bool:
        """True when every node is a one-hot q (no draft_probs)."""
        return self.draft_probs is None

    def depth(self, i: int) -> int:
        """Depth of node i: 0 for a child of the root (its position is start_position + depth)."""
        return self._depths[i]

    def children(self, i: int = ROOT) -> list[int]:
        """Node i's children in index order (ROOT: the depth-0 nodes)."""
        return list(self._children[i])

    def path(self, i: int) -> list[int]:
        """Node indices from the root's child down to node i (inclusive)."""
        out = []
        while i != ROOT:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def leaves(self) -> list[int]:
        return [i for i in range(len(self)) if not self._children[i]]

    def path_tokens(self, node_path: Sequence[int]) -> list[int]:
        return [self.token_ids[i] for i in node_path]

    def attention_mask(self) -> torch.Tensor:
        """bool [n, n]: node i attends to node j iff j is on path(i) (itself included)."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent != ROOT:
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask

    def position_offsets(self) -> list[int]:
        """Each node's position after the root's child position: its depth."""
        return list(self._depths)


@dataclass(frozen=True)
class TreeResult:
    node_path: list[int]  # accepted nodes, root's child first (a root-to-node path of the tree)
    output_token_ids: list[int]  # the accepted nodes' tokens, then one recovered or bonus token
    recovered: bool  # True: the last token replaces the rejected children of the last accepted node

    @property
    def num_accepted(self) -> int:
        return len(self.node_path)

    @property
    def bonus(self) -> bool:
        return not self.recovered

    def as_rejection_result(self) -> RejectionResult:
        return RejectionResult(self.num_accepted, list(self.output_token_ids), self.recovered)


def _attempt_uniform(seed: int, position: int, attempt: int) -> float:
    """The acceptance uniform of sibling attempt `attempt` (0-based) at `position`."""
    stream = RandomStream.ACCEPT if attempt == 0 else _SIBLING_STREAM + attempt
    return torch.rand((), generator=position_generator(seed, position, stream)).item()


def tree_rejection_sample(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    start_position: int,
) -> TreeResult:
    """Verify one token tree; lossless for greedy and sampling (see the module docstring).

    target_logits   # [n + 1, vocab_size]: row 0 the target's distribution after the last committed
                    #   token (the root), row i + 1 the distribution after node i (given its path)
    start_position  # sequence position of the depth-0 nodes; keys the random numbers
    """
    n = len(tree)
    if target_logits.dim() != 2 or target_logits.shape[0] != n + 1:
        raise ValueError(f"target_logits has shape {tuple(target_logits.shape)} for {n} nodes (want {n + 1} rows)")
    vocab = target_logits.shape[-1]
    if n and max(tree.token_ids) >= vocab:
        raise ValueError(f"token id {max(tree.token_ids)} is outside the target's vocabulary of {vocab}")
    if tree.draft_probs is not None and tree.draft_probs.shape[-1] != vocab:
        raise ValueError(f"draft_probs has {tree.draft_probs.shape[-1]} columns, the target {vocab}")
    tokens = tree.token_ids

    if params.greedy:
        target_ids = target_logits.argmax(dim=-1).tolist()  # [n + 1]
        node, path = ROOT, []
        while True:
            want, kids = target_ids[node + 1], tree.children(node)
            match = next((c for c in kids if tokens[c] == want), None)
            if match is None:
                return TreeResult(path, [*tree.path_tokens(path), want], recovered=bool(kids))
            path.append(match)
            node = match

    seed = params.seed if params.seed is not None else 0
    node, path = ROOT, []
    while True:
        position = start_position + len(path)
        # only the rows on the walk are processed (test_chain_tree_equals_rejection_sample checks this
        # matches rejection_sample, which processes all rows at once)
        p = probabilities(target_logits[node + 1 : node + 2], params)[0]  # [vocab_size]; the residual below
        kids = tree.children(node)
        accepted = None
        for attempt, c in enumerate(kids):
            d = tokens[c]
            q_d = 1.0 if tree.draft_probs is None else float(tree.draft_probs[c, d])
            if q_d <= 0.0:  # unreachable through TokenTree's validation; kept as a guard
                raise ValueError(f"node {c} (token {d}) at position {position} has draft probability 0")
            if _attempt_uniform(seed, position, attempt) < min(1.0, float(p[d]) / q_d):
                accepted = c
                break
            if tree.draft_probs is None:
                q = torch.zeros_like(p)
                q[d] = 1.0
            else:
                q = tree.draft_probs[c].float()
            p = residual_distribution(p, q)
        if accepted is None:
            token = sample(p, seed, position, RandomStream.TARGET)
            return TreeResult(path, [*tree.path_tokens(path), token], recovered=bool(kids))
        path.append(accepted)
        node = accepted
