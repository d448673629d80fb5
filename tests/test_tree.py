"""Token-tree verification: the tree, the tree rejection sampler (exact cases, chain equivalence,
chi-square distribution tests, power checks) and the runner's tree forward on the real SmolLM2 (fp32),
ending with a greedy speculative loop over trees that reproduces transformers' greedy output."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import cluster.core.tree as tree_module
from cluster.core.rejection import rejection_sample
from cluster.core.sampling import RandomStream, SamplingParams, probabilities, sample
from cluster.core.tree import SiblingScheme, TokenTree, sibling_draft_probs, tree_rejection_sample
from tests.test_rejection import GREEDY, V, one_hot_logits  # the rejection sampler's own fixtures


def logits_of(probs: dict[int, float], vocab: int = V) -> torch.Tensor:
    """Logits whose softmax (temperature 1) is exactly `probs`  # [vocab]"""
    logits = torch.full((vocab,), float("-inf"))
    for t, pr in probs.items():
        logits[t] = math.log(pr)
    return logits


# -- the tree -------------------------------------------------------------------------------------


def test_tree_shape():
    #        root
    #       /    \
    #   0:5       1:6
    #   /  \        \
    # 2:7  3:8      4:9
    #  |
    # 5:3
    tree = TokenTree([5, 6, 7, 8, 9, 3], [-1, -1, 0, 0, 1, 2])
    assert len(tree) == 6 and tree.deterministic
    assert [tree.depth(i) for i in range(6)] == [0, 0, 1, 1, 1, 2] == tree.position_offsets()
    assert tree.children() == [0, 1] and tree.children(0) == [2, 3] and tree.children(5) == []
    assert tree.path(5) == [0, 2, 5] and tree.path(4) == [1, 4] and tree.path(1) == [1]
    assert tree.leaves() == [3, 4, 5]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        expected[i, tree.path(i)] = True
    assert torch.equal(tree.attention_mask(), expected)
    assert tree.attention_mask()[5].tolist() == [True, False, True, False, False, True]

    chain = TokenTree.chain([4, 4, 2])
    assert chain.parents == [-1, 0, 1] and chain.path(2) == [0, 1, 2]
    assert torch.equal(chain.attention_mask(), torch.ones(3, 3, dtype=torch.bool).tril())

    merged = TokenTree.from_paths([[1, 2, 3], [1, 4], [5], [1, 2, 6]])
    assert merged.token_ids == [1, 2, 3, 4, 5, 6] and merged.parents == [-1, 0, 1, 0, -1, 1]


def test_malformed_trees_are_refused():
    with pytest.raises(ValueError, match="parents"):
        TokenTree([1, 2], [-1])
    with pytest.raises(ValueError, match="parent"):
        TokenTree([1, 2], [-1, 1])  # a node cannot be its own parent
    with pytest.raises(ValueError, match="parent"):
        TokenTree([1, 2], [1, -1])  # parents come first
    with pytest.raises(ValueError, match="share token"):
        TokenTree([3, 3], [-1, -1])  # deterministic siblings must differ
    with pytest.raises(ValueError, match="draft_probs has shape"):
        TokenTree([1, 2], [-1, 0], torch.ones(3, V) / V)
    q = torch.zeros(2, V)
    q[:, 1] = 1.0
    with pytest.raises(ValueError, match="draft probability 0"):
        TokenTree([1, 2], [-1, 0], q)
    q = probabilities(torch.randn(V), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="share token"):  # same token, different rows: not an i.i.d. repeat
        TokenTree([3, 3], [-1, -1], torch.stack([sibling_draft_probs(q, [3], SiblingScheme.DETERMINISTIC)[0], q]))
    TokenTree([3, 3], [-1, -1], sibling_draft_probs(q, [3, 3], SiblingScheme.IID))  # a repeated i.i.d. draw is fine
    TokenTree([3, 3], [-1, 0])  # same token, different parents: fine
    with pytest.raises(ValueError, match="without replacement"):
        sibling_draft_probs(q, [3, 3], SiblingScheme.WITHOUT_REPLACEMENT)
    with pytest.raises(ValueError, match="rows"):
        tree_rejection_sample(TokenTree.chain([1, 2]), one_hot_logits([1, 2]), GREEDY, 0)
    with pytest.raises(ValueError, match="vocabulary"):
        tree_rejection_sample(TokenTree.chain([V]), one_hot_logits([1, 2]), GREEDY, 0)


def test_sibling_rows():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    torch.testing.assert_close(sibling_draft_probs(q, [0, 2], SiblingScheme.WITHOUT_REPLACEMENT),
                               torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.6, 0.4, 0.0]]))
    torch.testing.assert_close(sibling_draft_probs(q, [2, 1], SiblingScheme.DETERMINISTIC),
                               torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    assert torch.equal(sibling_draft_probs(q, [1, 1], SiblingScheme.IID), torch.stack([q, q]))


# -- exact cases ----------------------------------------------------------------------------------


def test_greedy_walks_into_the_second_sibling_and_ends_with_a_bonus():
    tree = TokenTree([5, 6, 7, 1, 2], [-1, -1, 0, 1, 3])
    # argmax of row 0 (root) 6 -> node 1; row 2 (after node 1) 1 -> node 3; row 4 (after node 3) 2 -> node 4;
    # row 5 (after node 4) 0 is the bonus. Rows 1 and 3 (after nodes 0 and 2) are never read.
    target = one_hot_logits([6, 3, 1, 4, 2, 0])
    result = tree_rejection_sample(tree, target, GREEDY, 10)
    assert result.node_path == [1, 3, 4] and result.output_token_ids == [6, 1, 2, 0]
    assert result.num_accepted == 3 and result.bonus and not result.recovered


def test_greedy_recovered_versus_bonus():
    tree = TokenTree([5, 6, 7], [-1, -1, 0])
    recovered = tree_rejection_sample(tree, one_hot_logits([5, 4, 4, 4]), GREEDY, 0)  # after node 0 wants 4, child is 7
    assert recovered.node_path == [0] and recovered.output_token_ids == [5, 4] and recovered.recovered
    bonus = tree_rejection_sample(tree, one_hot_logits([6, 4, 3, 4]), GREEDY, 0)  # node 1 is a leaf: 3 is a bonus
    assert bonus.node_path == [1] and bonus.output_token_ids == [6, 3] and bonus.bonus
    none = tree_rejection_sample(tree, one_hot_logits([2, 4, 3, 4]), GREEDY, 0)
    assert none.node_path == [] and none.output_token_ids == [2] and none.recovered
    plain = tree_rejection_sample(TokenTree([], []), one_hot_logits([2]), GREEDY, 0)
    assert plain.output_token_ids == [2] and plain.bonus


def test_deterministic_second_sibling_is_accepted_when_the_first_is_rejected():
    """p = ½ on each sibling: rejecting sibling 1 leaves all the residual on sibling 2, which is then
    accepted with probability 1. Never recovered, and both outcomes occur."""
    tree = TokenTree([3, 5], [-1, -1])
    target = torch.stack([logits_of({3: 0.5, 5: 0.5}), torch.zeros(V), torch.zeros(V)])
    paths = set()
    for seed in range(200):
        result = tree_rejection_sample(tree, target, SamplingParams(temperature=1.0, seed=seed), 4)
        assert not result.recovered and result.num_accepted == 1
        assert result.output_token_ids[0] == tree.token_ids[result.node_path[0]]
        paths.add(tuple(result.node_path))
    assert paths == {(0,), (1,)}


@pytest.mark.parametrize("scheme", [SiblingScheme.DETERMINISTIC, SiblingScheme.IID, SiblingScheme.WITHOUT_REPLACEMENT])
def test_all_siblings_rejected_samples_the_final_residual(scheme):
    """The target gives the siblings no mass: every sibling is rejected and the token comes from
    what is left, p itself here, at its keyed TARGET draw."""
    q = torch.tensor([0.0, 0.5, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0])
    siblings = [1, 2]
    rows = None if scheme is SiblingScheme.DETERMINISTIC else sibling_draft_probs(q, siblings, scheme)
    tree = TokenTree(siblings, [-1, -1], rows)
    p_logits = logits_of({4: 0.7, 6: 0.3})
    target = torch.stack([p_logits, torch.zeros(V), torch.zeros(V)])
    outs = set()
    for seed in range(60):
        params = SamplingParams(temperature=1.0, seed=seed)
        result = tree_rejection_sample(tree, target, params, 9)
        assert result.recovered and result.node_path == []
        assert result.output_token_ids == [sample(probabilities(p_logits[None], params)[0], seed, 9, RandomStream.TARGET)]
        outs.add(result.output_token_ids[0])
    assert outs == {4, 6}


def test_a_repeated_iid_draw_is_never_accepted_after_its_first_copy_was_rejected():
    q = torch.tensor([0.0, 0.6, 0.4, 0.0, 0.0, 0.0, 0.0, 0.0])
    tree = TokenTree([1, 1], [-1, -1], sibling_draft_probs(q, [1, 1], SiblingScheme.IID))
    target = torch.stack([logits_of({1: 0.3, 2: 0.3, 3: 0.4}), torch.zeros(V), torch.zeros(V)])
    paths = {tuple(tree_rejection_sample(tree, target, SamplingParams(temperature=1.0, seed=s), 0).node_path)
             for s in range(300)}
    assert (0,) in paths and () in paths and (1,) not in paths


# -- a chain is the ordinary rejection sampler -------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                dict(temperature=1.3, top_p=0.8)], ids=["greedy", "plain", "top_k", "top_p"])
def test_chain_tree_equals_rejection_sample(kw):
    gen = torch.Generator().manual_seed(zlib.crc32(repr(kw).encode()))
    for trial in range(150):
        k = trial % 4
        target_logits = torch.randn(k + 1, V, generator=gen) * 2  # [k + 1, V]
        params = SamplingParams(**kw, seed=trial)
        deterministic = trial % 2 == 0
        if deterministic:
            q = None
            drafts = target_logits[:k].argmax(-1).tolist() if trial % 3 == 0 else torch.randint(V, (k,), generator=gen).tolist()
        else:
            q = probabilities(torch.randn(k, V, generator=gen) * 2, SamplingParams(temperature=1.0))  # [k, V]
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
        expected = rejection_sample(drafts, target_logits, q, params, 3 + trial)
        got = tree_rejection_sample(TokenTree.chain(drafts, q), target_logits, params, 3 + trial)
        assert got.as_rejection_result() == expected, (trial, drafts)
        assert got.node_path == list(range(expected.num_accepted))


# -- distributions ----------------------------------------------------------------------------------

FALSE_ALARM = 1e-3  # each goodness-of-fit test wrongly fails once in a thousand runs
N_SAMPLES = 5000
W = 6  # vocabulary of the distribution tests (W² joint categories)


def _assert_matches(counts: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; categories expected fewer than `min_expected` times are pooled."""
    p = expected_probs / expected_probs.sum()
    support = p > 0
    assert counts[~support].sum() == 0, "sampled something the target gives probability 0"
    expected = p * counts.sum()
    big = expected >= min_expected
    observed = list(counts[big]) + [counts[support & ~big].sum()]
    pooled = list(expected[big]) + [expected[support & ~big].sum()]
    if pooled[-1] == 0:
        observed, pooled = observed[:-1], pooled[:-1]
    stat = chisquare(observed, np.array(pooled) / np.sum(pooled) * np.sum(observed))
    assert stat.pvalue > FALSE_ALARM, f"distribution differs from the target: {stat}"
    return stat.pvalue


class Tables:
    """A synthetic target and draft over W tokens, two levels deep (distinct logits per prefix)."""

    def __init__(self, name: str, params: SamplingParams):
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        self.params = params
        self.t0 = torch.randn(W, generator=gen) * 1.5  # target at the root
        self.t1 = torch.randn(W, W, generator=gen) * 1.5  # [x0] -> target after x0
        self.t2 = torch.randn(W, W, W, generator=gen) * 1.5  # [x0, x1] -> target after x0 x1
        d0 = torch.randn(W, generator=gen) * 1.5
        d0[0] = -1e9  # q = 0 where p > 0: only a residual can produce token 0
        self.q0 = probabilities(d0[None], params)[0]  # [W]
        self.q1 = probabilities(torch.randn(W, W, generator=gen) * 1.5, params)  # [W, W]
        self.p0 = probabilities(self.t0[None], params)[0].double().numpy()  # [W]
        self.p1 = probabilities(self.t1, params).double().numpy()  # [W, W]

    def joint(self) -> np.ndarray:
        return (self.p0[:, None] * self.p1).reshape(-1)  # [W * W]

    def target_rows(self, tree: TokenTree) -> torch.Tensor:
        rows = [self.t0]
        for i in range(len(tree)):
            path = tree.path_tokens(tree.path(i))
            rows.append(self.t1[path[0]] if len(path) == 1 else self.t2[path[0], path[1]])
        return torch.stack(rows)  # [n + 1, W]


def _draw(rng: np.random.Generator, q: torch.Tensor, m: int, scheme: SiblingScheme) -> list[int]:
    """m sibling candidates from q the way `scheme` says."""
    probs = q.double().numpy()
    if scheme is SiblingScheme.DETERMINISTIC:
        return [int(t) for t in np.argsort(-probs, kind="stable")[:m]]
    if scheme is SiblingScheme.IID:
        return [int(rng.choice(W, p=probs / probs.sum())) for _ in range(m)]
    out, remaining = [], probs.copy()
    for _ in range(m):
        out.append(int(rng.choice(W, p=remaining / remaining.sum())))
        remaining[out[-1]] = 0.0
    return out


def _build(tables: Tables, rng: np.random.Generator, shape: str) -> TokenTree:
    """A depth-2 tree. Shapes: 'iid' (2 i.i.d. draws at each of the two levels, under every node),
    'wor' (3 draws without replacement at the root, 2 under the first), 'top2' (the project's first
    tree: deterministic top-2 at both positions under the top-1), 'mixed' (deterministic top-2 at the
    root, then one sampled child under each)."""
    scheme0 = {"iid": SiblingScheme.IID, "wor": SiblingScheme.WITHOUT_REPLACEMENT,
               "top2": SiblingScheme.DETERMINISTIC, "mixed": SiblingScheme.DETERMINISTIC}[shape]
    m0 = 3 if shape == "wor" else 2
    first = _draw(rng, tables.q0, m0, scheme0)
    tokens, parents = list(first), [-1] * m0
    rows = list(sibling_draft_probs(tables.q0, first, scheme0))
    for node, x0 in enumerate(first):
        if shape == "iid":
            m1, scheme1 = 2, SiblingScheme.IID
        elif shape == "wor":
            m1, scheme1 = (2 if node == 0 else 0), SiblingScheme.WITHOUT_REPLACEMENT
        elif shape == "top2":
            m1, scheme1 = (2 if node == 0 else 0), SiblingScheme.DETERMINISTIC
        else:
            m1, scheme1 = 1, SiblingScheme.IID
        kids = _draw(rng, tables.q1[x0], m1, scheme1)
        tokens += kids
        parents += [node] * m1
        rows += list(sibling_draft_probs(tables.q1[x0], kids, scheme1))
    probs = None if shape == "top2" else torch.stack(rows)
    return TokenTree(tokens, parents, probs)


def _run(tables: Tables, shape: str, n: int = N_SAMPLES, build=_build, seed_offset: int = 0):
    """First-token and first-two-token counts over n request seeds. When a round emits only one
    token, the second is what the next round's plain step draws (the target after x0)."""
    rng = np.random.default_rng(zlib.crc32(shape.encode()))
    first, joint = np.zeros(W), np.zeros(W * W)
    sampled_siblings = 0
    for i in range(n):
        tree = build(tables, rng, shape)
        params = tables.params.model_copy(update={"seed": i + seed_offset})
        result = tree_rejection_sample(tree, tables.target_rows(tree), params, 0)
        out = result.output_token_ids
        if len(out) == 1:
            p1 = probabilities(tables.t1[out[0]][None], params)[0]
            out = [out[0], sample(p1, params.seed, 1, RandomStream.TARGET)]
        first[out[0]] += 1
        joint[out[0] * W + out[1]] += 1
        sampled_siblings += any(tree.children(tree.parents[c]).index(c) > 0 for c in result.node_path)
    return first, joint, sampled_siblings


DIST_CASES = [
    ("iid", dict(temperature=1.0)),
    ("wor", dict(temperature=0.8, top_k=4)),
    ("top2", dict(temperature=1.0)),
    ("mixed", dict(temperature=1.2, top_p=0.9)),
]


@pytest.mark.parametrize("shape,kw", DIST_CASES, ids=[c[0] for c in DIST_CASES])
def test_tree_sampling_follows_the_target(shape, kw):
    tables = Tables(shape, SamplingParams(**kw))
    assert (tables.p0 > 0).sum() >= 3 and not np.allclose(tables.p0, tables.q0.double().numpy(), atol=0.05)
    first, joint, sibling_wins = _run(tables, shape)
    _assert_matches(first, tables.p0)
    _assert_matches(joint, tables.joint())
    assert sibling_wins > N_SAMPLES * 0.02, "a later sibling must be accepted now and then, or the test tests no tree"
    if tables.p0[0] > 0.01:
        assert first[0] > 0  # token 0 (q = 0) is reachable only through residuals


def _top2_with_q_rows(tables: Tables, rng: np.random.Generator, shape: str) -> TokenTree:
    """The classic mistake: deterministic top-2 siblings verified as if they were draws from q."""
    top2 = _draw(rng, tables.q0, 2, SiblingScheme.DETERMINISTIC)
    return TokenTree(top2, [-1, -1], sibling_draft_probs(tables.q0, top2, SiblingScheme.IID))


def test_power_top2_verified_as_iid_draws_is_caught():
    tables = Tables("power-top2", SamplingParams(temperature=1.0))
    first, _, _ = _run(tables, "power-top2", n=3000, build=_top2_with_q_rows)
    p = tables.p0 / tables.p0.sum()
    assert chisquare(first, p * first.sum()).pvalue < 1e-6


def test_power_a_sampler_that_forgets_the_residual_between_siblings_is_caught(monkeypatch):
    monkeypatch.setattr(tree_module, "residual_distribution", lambda p, q: p)
    tables = Tables("power-residual", SamplingParams(temperature=1.0))
    first, _, _ = _run(tables, "iid", n=3000, build=lambda t, rng, s: _build(t, rng, "iid"))
    p = tables.p0 / tables.p0.sum()
    assert chisquare(first, p * first.sum()).pvalue < 1e-6


# -- the tree forward on the real model (fp32) --------------------------------------------------------

PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("Write a short poem about the sea.", True),  # neither ends with EOS within MAX_TOKENS
]
MAX_TOKENS = 24
ATOL = 1e-4

#        root
#       /    \
#   0:a       1:b
#   /  \        \
# 2:c  3:d      4:e
#  |
# 5:f
SHAPE = [-1, -1, 0, 0, 1, 2]


@pytest.fixture(params=["sdpa", "eager"])
def attn_target(request, target_fp32):
    """The fp32 target under one attention implementation (restored afterwards)."""
    before = target_fp32.config._attn_implementation
    target_fp32.set_attn_implementation(request.param)
    assert target_fp32.config._attn_implementation == request.param
    yield target_fp32
    target_fp32.set_attn_implementation(before)


def _plain_logits(runner, ids: list[int]) -> torch.Tensor:
    s = runner.add_session()
    try:
        return runner.extend(s, ids)  # [len(ids), vocab]
    finally:
        runner.release(s)


@pytest.mark.parametrize("num_prefix", [0, 1, 3])
def test_extend_tree_equals_plain_extends_along_each_path(attn_target, prompt_ids, num_prefix):
    from cluster.model.runner import TorchModelRunner

    runner = TorchModelRunner(attn_target)
    ids = prompt_ids[0]
    tree = TokenTree([ids[3], 1143, ids[5], 28, 504, 7], SHAPE)
    cached, prefix = ids[: len(ids) - num_prefix], ids[len(ids) - num_prefix :]
    session = runner.add_session()
    head = runner.extend(session, cached)
    logits = runner.extend_tree(session, prefix, tree)
    assert logits.shape == (num_prefix + len(tree), runner.vocab_size)
    assert runner.length(session) == len(ids) + len(tree)
    for leaf in tree.leaves():
        path = tree.path(leaf)
        reference = _plain_logits(runner, ids + tree.path_tokens(path))  # [len(ids) + depth + 1, vocab]
        root = logits[num_prefix - 1] if num_prefix else head[-1]
        torch.testing.assert_close(root, reference[len(ids) - 1], atol=ATOL, rtol=ATOL)
        if num_prefix:
            torch.testing.assert_close(logits[:num_prefix], reference[len(cached) : len(ids)], atol=ATOL, rtol=ATOL)
        for depth, node in enumerate(path):
            torch.testing.assert_close(logits[num_prefix + node], reference[len(ids) + depth], atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("node_path", [[1, 4], [0, 2, 5], [0, 3], []], ids=str)
def test_keep_tree_path_leaves_the_cache_of_the_accepted_branch(attn_target, prompt_ids, node_path):
    from cluster.model.runner import TorchModelRunner

    runner = TorchModelRunner(attn_target)
    ids = prompt_ids[1]
    tree = TokenTree([ids[-1], 330, ids[-2], 11, 95, ids[-3]], SHAPE)
    session = runner.add_session()
    runner.extend(session, ids[:-1])
    runner.extend_tree(session, ids[-1:], tree)
    runner.keep_tree_path(session, len(ids), node_path, tree)
    accepted = tree.path_tokens(node_path)
    assert runner.length(session) == len(ids) + len(node_path)

    fresh = runner.add_session()
    runner.extend(fresh, ids + accepted)
    n = len(ids) + len(node_path)
    for mine, theirs in zip(runner._sessions[session].cache.layers, runner._sessions[fresh].cache.layers):
        torch.testing.assert_close(mine.keys[:, :, :n], theirs.keys[:, :, :n], atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(mine.values[:, :, :n], theirs.values[:, :, :n], atol=ATOL, rtol=ATOL)
    nxt = [17, 2345, 9]
    torch.testing.assert_close(runner.extend(session, nxt), runner.extend(fresh, nxt), atol=ATOL, rtol=ATOL)


def test_trees_and_chains_batched_in_one_forward_equal_their_own_forwards(attn_target, prompt_ids):
    """`extend_batch(trees=...)`: a chain session and two tree sessions (prefixes of 1 and 0 tokens, caches
    of different lengths) in one forward give each session the logits of its own `extend` /
    `extend_tree`, and leave caches that `keep_tree_path` turns into the accepted branch's."""
    from cluster.model.runner import TorchModelRunner

    runner = TorchModelRunner(attn_target)
    a, b, c = prompt_ids[0], prompt_ids[1], prompt_ids[0][:-4]
    tree_b = TokenTree([b[-1], 330, b[-2], 11, 95, b[-3]], SHAPE)
    tree_c = TokenTree([c[2], c[3], 17], [-1, 0, -1])
    for s, ids in (("a", a[:-3]), ("b", b[:-1]), ("c", c)):
        runner.add_session(s)
        runner.extend(s, ids)
    got = runner.extend_batch({"a": a[-3:], "b": b[-1:] + tree_b.token_ids, "c": tree_c.token_ids},
                              trees={"b": (1, tree_b), "c": (0, tree_c)})
    solo = TorchModelRunner(attn_target)
    for s, ids in (("a", a[:-3]), ("b", b[:-1]), ("c", c)):
        solo.add_session(s)
        solo.extend(s, ids)
    want = {"a": solo.extend("a", a[-3:]), "b": solo.extend_tree("b", b[-1:], tree_b), "c": solo.extend_tree("c", [], tree_c)}
    for s in "abc":
        assert got[s].shape == want[s].shape
        torch.testing.assert_close(got[s], want[s], atol=ATOL, rtol=ATOL)
    runner.keep_tree_path("b", len(b), [0, 2, 5], tree_b)
    solo.keep_tree_path("b", len(b), [0, 2, 5], tree_b)
    runner.keep_tree_path("c", len(c), [2], tree_c)
    solo.keep_tree_path("c", len(c), [2], tree_c)
    for s in "abc":
        assert runner.length(s) == solo.length(s)
        torch.testing.assert_close(runner.extend(s, [9, 42]), solo.extend(s, [9, 42]), atol=ATOL, rtol=ATOL)


def test_keep_tree_path_refuses_a_path_that_is_not_one(target_runner):
    tree = TokenTree([5, 6, 7, 8, 9, 10], SHAPE)
    session = target_runner.add_session()
    target_runner.extend(session, [1, 2, 3])
    target_runner.extend_tree(session, [4], tree)
    with pytest.raises(ValueError, match="not a root-to-node path"):
        target_runner.keep_tree_path(session, 4, [0, 1], tree)  # two siblings
    with pytest.raises(ValueError, match="not increasing"):
        target_runner.keep_tree_path(session, 4, [2, 0])
    with pytest.raises(ValueError, match="not increasing"):
        target_runner.keep_tree_path(session, 4, [0, 6])
    assert target_runner.length(session) == 4 + len(tree)  # nothing changed


# -- a greedy speculative loop over trees -------------------------------------------------------------


def _tree_loop(target_runner, propose, prompt: list[int], max_tokens: int) -> tuple[list[int], list[list[int]]]:
    """extend_tree + tree_rejection_sample + keep_tree_path until max_tokens; the last emitted token
    is never cached (it is the next round's prefix)."""
    session = target_runner.add_session()
    target_runner.extend(session, prompt[:-1])
    committed, pending, paths = list(prompt), [prompt[-1]], []
    while len(committed) - len(prompt) < max_tokens:
        tree = propose(committed)
        base = target_runner.length(session) + len(pending)
        logits = target_runner.extend_tree(session, pending, tree)
        result = tree_rejection_sample(tree, logits[len(pending) - 1 :], GREEDY, len(committed))
        target_runner.keep_tree_path(session, base, result.node_path, tree)
        committed += result.output_token_ids
        pending = result.output_token_ids[-1:]
        paths.append(result.node_path)
        assert target_runner.length(session) == len(committed) - 1
    target_runner.release(session)
    return committed[len(prompt) : len(prompt) + max_tokens], paths


class Top2DraftTree:
    """The int8 draft's greedy chain of `k` tokens, with its second choice as a leaf sibling at the
    first `siblings` positions. Node order: chain token then its sibling at each depth."""

    def __init__(self, draft_runner, k: int = 3, siblings: int = 2):
        self.runner, self.k, self.siblings = draft_runner, k, siblings
        self.session = draft_runner.add_session()
        self.cached: list[int] = []

    def __call__(self, committed: list[int]) -> TokenTree:
        common = 0
        while common < min(len(self.cached), len(committed) - 1) and self.cached[common] == committed[common]:
            common += 1
        self.runner.truncate(self.session, common)
        self.cached = self.cached[:common]
        feed = committed[common:]
        tokens, parents, parent = [], [], -1
        for depth in range(self.k):
            logits = self.runner.extend(self.session, feed, num_logits=1)[0]
            self.cached += feed
            top = logits.topk(2).indices.tolist()
            tokens.append(top[0])
            parents.append(parent)
            chain_node = len(tokens) - 1
            if depth < self.siblings:
                tokens.append(top[1])
                parents.append(parent)
            parent, feed = chain_node, [top[0]]
        return TokenTree(tokens, parents)


class WrongFirstOracle:
    """Knows the reference: at depth 0 it puts a wrong token before the right one, at depth 1 the
    right one before a wrong one, then a wrong chain token. The accepted path is always [1, 2]: the
    compaction moves both accepted nodes, and each round ends with a recovered token."""

    def __init__(self, prompt: list[int], reference: list[int], vocab: int):
        self.full, self.vocab = list(prompt) + list(reference), vocab

    def __call__(self, committed: list[int]) -> TokenTree:
        right = (self.full[len(committed) : len(committed) + 3] + [0, 0, 0])[:3]
        wrong = [(t + 1) % self.vocab for t in right]
        return TokenTree([wrong[0], right[0], right[1], wrong[1], wrong[2]], [-1, -1, 1, 1, 2])


def test_greedy_tree_loop_reproduces_transformers(target_runner, draft_runner, prompt_ids, references):
    for ids in prompt_ids:
        reference = references[tuple(ids)]
        assert len(reference) == MAX_TOKENS
        out, paths = _tree_loop(target_runner, Top2DraftTree(draft_runner), ids, MAX_TOKENS)
        assert out == reference
        assert len(paths) < MAX_TOKENS, "the int8 draft's trees must speed something up"
        out, paths = _tree_loop(target_runner, WrongFirstOracle(ids, reference, target_runner.vocab_size), ids, MAX_TOKENS)
        assert out == reference
        assert all(path == [1, 2] for path in paths[:-1])


def test_the_engine_verifies_tree_rounds_of_several_sessions_in_one_forward(engine_fp32, prompt_ids):
    from cluster.model.runner import TorchModelRunner
    from cluster.model.verifier import Round, VerifierEngine

    def run(sessions: list[int]) -> tuple[dict, int]:
        engine = VerifierEngine(TorchModelRunner(engine_fp32))
        forwards = []
        inner = engine.runner._forward
        engine.runner._forward = lambda *a, **kw: forwards.append(1) or inner(*a, **kw)
        results = {}
        for i in sessions:
            ids = prompt_ids[i]
            engine.open(f"s{i}", ids, SamplingParams(max_tokens=8))
            rnd = Round(f"s{i}", 0, 0, [ids[3], 1143, 28], None, True, parents=[-1, -1, 0])
            engine.submit(rnd, lambda r, i=i: results.__setitem__(i, r))
        before = len(forwards)
        engine.step()
        return results, len(forwards) - before

    together, forwards = run([0, 1])
    assert forwards == 1 and set(together) == {0, 1}
    for i in (0, 1):
        alone, _ = run([i])
        assert together[i].output_token_ids == alone[i].output_token_ids


def test_dynamic_tree_keeps_the_best_nodes_as_a_tree():
    """EAGLE-2's rerank (`drafts.dynamic_tree.select_tree`): the `budget` best candidates by cumulative log q,
    each with its parent, ordered by depth and then score (so a node's first child is its best)."""
    from cluster.core.tree import first_chain
    from drafts.dynamic_tree import ROOT as DROOT, Candidate, frontier, select_tree

    c = [Candidate(10, DROOT, -0.1, 0), Candidate(11, DROOT, -2.0, 0), Candidate(12, DROOT, -0.7, 0),
         Candidate(20, 0, -0.5, 1), Candidate(21, 0, -0.3, 1), Candidate(22, 2, -0.9, 1), Candidate(23, 2, -3.0, 1),
         Candidate(30, 4, -0.35, 2), Candidate(31, 4, -4.0, 2)]
    assert frontier(c, range(3, 7), 2) == [4, 3]
    token_ids, parents = select_tree(c, 5)
    # kept: 10 (-0.1), 21 (-0.3), 30 (-0.35), 20 (-0.5), 12 (-0.7); 22 (-0.9) and the rest are cut
    assert token_ids == [10, 12, 21, 20, 30]
    assert parents == [DROOT, DROOT, 0, 0, 2]
    tree = TokenTree(token_ids, parents)
    assert first_chain(token_ids, parents) == [10, 21, 30] and len(tree) == 5
    assert select_tree(c, 100)[0][:3] == [10, 12, 11] and len(select_tree(c, 100)[0]) == len(c)
