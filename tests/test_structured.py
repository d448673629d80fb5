"""Structured outputs (`cluster.core.grammar`): the grammar's mask at every draft position, lossless
under speculation, on the real model.

- the mask of a round's row equals a fresh matcher's after the row's whole history (the matcher cache and
  rollback change nothing);
- greedy output with a grammar is the same with any drafter (always right, always wrong: one-hot drafts the
  grammar mostly refuses, cut before verification; the draft model as a chain and as a tree; n-gram) as plain decoding under the same grammar, and every finished
  output parses and validates against its schema;
- sampled output with a choice grammar follows the target's masked distribution (chi-square against the
  exact probabilities, enumerated).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar

from cluster.core.config import PROMPT_CACHE_TOKENS
from cluster.core import grammar
from cluster.core.errors import InvalidRequestError
from cluster.core.grammar import StructuredOutputs
from cluster.core.processors import process_rows
from cluster.core.sampling import SamplingParams, probabilities
from cluster.model.models import encode_prompt
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from cluster.wire.codec import params_from_pb, params_to_pb
from drafts.draft_model import DraftModelProposer
from drafts.ngram import NGramProposer
from tests.helpers import OracleProposer
from tests.test_sampling_e2e import FALSE_ALARM, chi_square_pvalue

VOCAB = 49152
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "pets": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "pets"]}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                         "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                    "required": ["ok"]}},
        "required": ["city", "nested"]}
GRAMMARS = [
    ("Describe a person as JSON.", StructuredOutputs.of_schema(PERSON, any_whitespace=False), PERSON),
    ("Which city is the capital of France? Answer in JSON.", StructuredOutputs.of_schema(CITY, any_whitespace=False), CITY),
    ("Give me any JSON object about cats.", StructuredOutputs(kind="json_object", any_whitespace=False), {"type": "object"}),
    ("What is today's date?", StructuredOutputs(kind="regex", spec=r"\d{4}-\d{2}-\d{2}"), None),
    ("Is the sky blue?", StructuredOutputs.of_choice(["yes", "no", "it depends"]), None),
]
MAX_TOKENS = 48


def _fresh_mask(so: StructuredOutputs, history: list[int]) -> torch.Tensor:
    matcher = xgrammar.GrammarMatcher(grammar.compile_grammar(so, VOCAB))
    for t in history:
        assert matcher.accept_token(t)
    bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, VOCAB)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=VOCAB)
    return torch.isfinite(logits[0])


def test_each_row_gets_the_mask_of_its_whole_history(tokenizer):
    so = StructuredOutputs.of_schema(PERSON, any_whitespace=False)
    ids = tokenizer.encode('{"name": "Ann", "age": 41, "pets": ["cat"]}', add_special_tokens=False)
    for split in (0, 3, 7):  # committed output, then a round of drafts (rows continue the earlier drafts)
        out, drafts = ids[:split], ids[split:split + 6]
        logits = torch.zeros(len(drafts) + 1, VOCAB)
        logits = process_rows(logits, SamplingParams(structured_outputs=so), [], out, [drafts[:i] for i in range(len(drafts) + 1)])
        for i in range(len(drafts) + 1):
            assert torch.equal(torch.isfinite(logits[i]), _fresh_mask(so, out + drafts[:i])), (split, i)
        assert torch.isfinite(logits).sum() < logits.numel() // 2  # the grammar masks most tokens somewhere


def test_a_tree_of_paths_and_a_refused_draft(tokenizer):
    so = StructuredOutputs.of_choice(["yes", "no"])
    yes, no = tokenizer.encode("yes", add_special_tokens=False), tokenizer.encode("no", add_special_tokens=False)
    bad = tokenizer.encode("maybe", add_special_tokens=False)
    logits = torch.zeros(4, VOCAB)
    logits = process_rows(logits, SamplingParams(structured_outputs=so), [], [], [[], yes, no, bad])
    allowed = torch.isfinite(logits)
    assert set(torch.nonzero(allowed[0]).flatten().tolist()) >= {yes[0], no[0]}
    assert not allowed[0, bad[0]]
    assert allowed[1].sum() == allowed[2].sum() == 1  # after a whole choice: only the end of sequence
    assert allowed[3].all()  # a history the grammar refused is never reached: left unmasked
    assert grammar.valid_prefix(so, [], yes + bad, VOCAB) == len(yes)


def test_matchers_are_reused_along_a_session(tokenizer):
    so = StructuredOutputs(kind="regex", spec=r"[a-z]+ [0-9]+")
    ids = tokenizer.encode("abc 123", add_special_tokens=False)
    process_rows(torch.zeros(1, VOCAB), SamplingParams(structured_outputs=so), [], [], [[]])
    before = grammar._matchers.replayed
    for n in range(1, len(ids) + 1):
        process_rows(torch.zeros(2, VOCAB), SamplingParams(structured_outputs=so), [], ids[:n], [[], [ids[0]]])
    assert grammar._matchers.replayed == before  # each round advanced the cached matcher


@pytest.mark.parametrize("so", [StructuredOutputs(kind="json", spec='{"type": "nonsense"}'),
                                StructuredOutputs(kind="regex", spec="(unclosed"),
                                StructuredOutputs(kind="grammar", spec="root ::= missing_rule")])
def test_a_grammar_xgrammar_refuses_is_a_clear_error(so, tokenizer):
    with pytest.raises(InvalidRequestError, match="structured outputs: the .* cannot be compiled"):
        grammar.check(so, VOCAB)


def test_the_wire_carries_the_grammar():
    params = SamplingParams(structured_outputs=StructuredOutputs.of_schema(PERSON, any_whitespace=False))
    assert params_from_pb(params_to_pb(params)).structured_outputs == params.structured_outputs


# ---- greedy: the same output with every drafter, and it parses --------------------------------------

@pytest.fixture(scope="module")
def cases(tokenizer):
    return [(encode_prompt(tokenizer, text, chat=True), SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=so), schema)
            for text, so, schema in GRAMMARS]


@pytest.fixture(scope="module")
def plain_outputs(cases, engine_fp32, tokenizer):
    decoder = SpeculativeDecoder(TorchModelRunner(engine_fp32, prompt_cache_tokens=PROMPT_CACHE_TOKENS), None, tokenizer, 0)
    return [decoder.generate(ids, params) for ids, params, _ in cases]


def test_plain_outputs_follow_their_grammars(cases, plain_outputs, tokenizer):
    finished = 0
    for (ids, params, schema), result in zip(cases, plain_outputs):
        so = params.structured_outputs
        if result.finish_reason != "stop":
            continue
        finished += 1
        if so.kind in ("json", "json_object"):
            jsonschema.validate(json.loads(result.text), schema)
        elif so.kind == "regex":
            assert re.fullmatch(so.spec, result.text), result.text
        else:
            assert result.text in json.loads(so.spec)
    assert finished >= 4, [r.text for r in plain_outputs]


@pytest.mark.parametrize("kind", ["always-right", "always-wrong", "draft", "draft-tree", "ngram"])
def test_greedy_with_a_grammar_equals_plain_decoding(kind, cases, plain_outputs, engine_fp32, draft_runner, tokenizer):
    """always-wrong and n-gram drafts are deterministic: cut before verification at the first token the grammar
    refuses (counted), the bonus token drawn there; the model drafts' q is masked as p is."""
    target = TorchModelRunner(engine_fp32, prompt_cache_tokens=PROMPT_CACHE_TOKENS)
    drafted = accepted = cut = 0
    for (ids, params, _), want in zip(cases, plain_outputs):
        if kind.startswith("always"):
            proposer = OracleProposer({tuple(ids): want.token_ids}, target.vocab_size, wrong=kind == "always-wrong")
        elif kind == "ngram":
            proposer = NGramProposer(max_ngram=2)
        else:
            proposer = DraftModelProposer(draft_runner, tree_width=2 if kind == "draft-tree" else 1)
        decoder = SpeculativeDecoder(target, proposer, tokenizer, num_speculative_tokens=4)
        result = decoder.generate(ids, params)
        assert result.token_ids == want.token_ids, f"{kind}: {params.structured_outputs.kind}"
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
        cut += decoder.metrics.grammar_cut_drafts
    if kind == "always-wrong":
        assert accepted == 0 and cut > 0
    elif kind == "always-right":
        assert accepted > 0.3 * drafted and cut == 0
    elif kind == "ngram":
        assert drafted > 0 or cut > 0
    else:  # the model's drafts follow the grammar up to its end (drafts past an end of sequence may be cut)
        assert accepted > 0.3 * drafted


# ---- sampling follows the masked target ----------------------------------------------------------

CHOICES = ["yes", "no", "maybe", "never"]
SAMPLES = 200


def _exact(model, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """P(output) of every output the grammar allows, from the target's masked distribution at each step."""
    probs, done = {(): 1.0}, {}
    with torch.inference_mode():
        while probs:
            nxt_probs = {}
            for prefix, p in probs.items():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[:, -1]  # [1, vocab]
                row = probabilities(process_rows(logits, params, prompt, list(prefix), [[]]), params)[0]
                for t in torch.nonzero(row > 0).flatten().tolist():
                    seq = prefix + (t,)
                    if t in params.eos_token_ids:
                        done[seq] = done.get(seq, 0.0) + p * float(row[t])
                    else:
                        nxt_probs[seq] = p * float(row[t])
            probs = nxt_probs
    return done


def test_sampling_with_a_grammar_follows_the_masked_target(target_fp32, draft_runner, tokenizer, engine_fp32):
    prompt = encode_prompt(tokenizer, "Q: Will it rain tomorrow? One word.\nA:")  # short: each sample prefills it
    decoder = SpeculativeDecoder(TorchModelRunner(engine_fp32, prompt_cache_tokens=PROMPT_CACHE_TOKENS), DraftModelProposer(draft_runner), tokenizer, 3)
    params = SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=StructuredOutputs.of_choice(CHOICES))
    exact = _exact(target_fp32, prompt, params.for_session(len(prompt), decoder.eos_token_ids))
    assert len(exact) >= len(CHOICES) and abs(sum(exact.values()) - 1) < 1e-4
    samples = [tuple(decoder.generate(prompt, params.model_copy(update={"seed": i})).token_ids) for i in range(SAMPLES)]
    assert all(s in exact for s in samples)
    assert chi_square_pvalue(samples, exact) > FALSE_ALARM


def test_a_lazily_loaded_tokenizer_is_registered_without_deadlock(monkeypatch, model_dir):
    """A process that loaded a model (not its tokenizer) loads it at its first grammar: the loader registers
    the tokenizer it loads while the compile holds the module's lock (a plain lock hung the served request)."""
    import threading
    from collections import OrderedDict

    from cluster.model import models

    monkeypatch.setattr(grammar, "_tokenizer", None)
    monkeypatch.setattr(grammar, "_compilers", {})
    monkeypatch.setattr(grammar, "_compiled", OrderedDict())
    grammar.register_tokenizer(loader=lambda: models.load_tokenizer(model_dir))
    worker = threading.Thread(target=grammar.check, args=(StructuredOutputs.of_choice(["a", "b"]), VOCAB), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "compiling with a lazily loaded tokenizer hung"
    assert grammar._tokenizer is not None


def test_a_process_without_a_tokenizer_says_so(monkeypatch):
    """The router's draft cut needs the vocabulary; where no model was loaded it is a NoTokenizer (the loop
    then leaves drafts uncut, logged: p rejects a refused token anyway)."""
    from collections import OrderedDict

    monkeypatch.setattr(grammar, "_tokenizer", None)
    monkeypatch.setattr(grammar, "_tokenizer_loader", None)
    monkeypatch.setattr(grammar, "_compilers", {})
    monkeypatch.setattr(grammar, "_compiled", OrderedDict())
    with pytest.raises(grammar.NoTokenizer, match="no tokenizer registered"):
        grammar.valid_prefix(StructuredOutputs.of_choice(["a"]), [], [1, 2])


def test_a_tokenizer_of_another_vocabulary_drops_the_grammars_compiled_before(monkeypatch, tokenizer, model_dir):
    """Compiled grammars are cached by vocabulary size alone: registering a tokenizer of another vocabulary (a
    process that loads another model's) drops them; the same vocabulary loaded again keeps them."""
    from collections import OrderedDict

    from cluster.model import models

    monkeypatch.setattr(grammar, "_tokenizer", tokenizer)
    monkeypatch.setattr(grammar, "_compilers", {})
    monkeypatch.setattr(grammar, "_compiled", OrderedDict())
    so = StructuredOutputs.of_choice(["yes", "no"])
    compiled = grammar.compile_grammar(so, VOCAB)
    models.load_tokenizer(model_dir)  # the same vocabulary, another object
    assert grammar.compile_grammar(so, VOCAB) is compiled
    other = models.load_tokenizer(model_dir, register=False)
    other.add_tokens(["<another-vocabulary>"])
    grammar.register_tokenizer(other)
    assert not grammar._compiled and not grammar._compilers
    assert grammar.compile_grammar(so, VOCAB) is not compiled
