"""bf16: scoring k tokens in one forward is not bit-identical to scoring them one at a time, so
speculative output may leave target-only output (same dtype) only where the token it picks is within
a near-tie of the target's best logit, as target-only decoding computed it. Exactness itself is proven in fp32 (test_greedy_equality.py)."""

from __future__ import annotations

import pytest

from cluster.core.sampling import SamplingParams
from cluster.model import models
from cluster.model.models import encode_prompt
from cluster.model.runner import TorchModelRunner
from cluster.session.speculate import SpeculativeDecoder
from drafts.draft_model import DraftModelProposer, quantized_copy
from drafts.ngram import NGramProposer

# A near-tie: the target's top-2 logits differ by at most this much (bf16 spacing is 0.125 for
# logits in [16, 32), so this is four units in the last place).
BF16_NEAR_TIE = 0.5

PROMPTS = [
    ("def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n", False),
    ("import json\n\ndef load_config(path):\n", False),
    ("Give me a simple recipe for pancakes.", True),
    ("Why do we have seasons on Earth?", True),
]


@pytest.fixture(scope="module")
def target_bf16(model_dir):
    return models.load_causal_lm(model_dir, "bfloat16", "cpu")


PARAMS = SamplingParams(max_tokens=48)


@pytest.fixture(scope="module")
def target_only(target_bf16, tokenizer) -> list[list[int]]:
    """Each prompt's target-only (plain) bf16 output, once for both kinds."""
    plain = SpeculativeDecoder(TorchModelRunner(target_bf16), None, tokenizer, 0)
    return [plain.generate(encode_prompt(tokenizer, text, chat), PARAMS).token_ids for text, chat in PROMPTS]


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_bf16_divergence_only_at_near_ties(kind, target_bf16, tokenizer, target_only):
    target = TorchModelRunner(target_bf16)
    proposer = DraftModelProposer(TorchModelRunner(quantized_copy(target_bf16))) if kind == "draft" else NGramProposer()
    speculative = SpeculativeDecoder(target, proposer, tokenizer, 4)
    compared = 0
    for (text, chat), a in zip(PROMPTS, target_only):
        ids = encode_prompt(tokenizer, text, chat)
        b = speculative.generate(ids, PARAMS).token_ids
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if n is None:
            assert a == b
            continue
        # replay target-only decoding's own computation (one token per forward) up to position n
        session = target.add_session()
        target.extend(session, ids[:-1], num_logits=0)
        for token in [ids[-1], *a[:n]]:
            logits = target.extend(session, [token], num_logits=1)[0]  # [vocab_size]
        target.release(session)
        assert int(logits.argmax()) == a[n], "the replay must reproduce target-only decoding"
        gap = float(logits.max() - logits[b[n]])
        assert gap <= BF16_NEAR_TIE, f"diverged at position {n} to a token {gap:.3f} below the target's best"
        compared += 1
    assert compared <= len(PROMPTS)
