"""`n` choices share the prompt's prefill on the torch verifier (`TorchModelRunner.share_prefix`,
`VerifierEngine._prefix_donor`): the shared keys and values are bit for bit a prefill's own, and every
choice decodes as it would alone."""

from __future__ import annotations

import torch

from cluster.core.sampling import SamplingParams
from cluster.model.runner import TorchModelRunner
from cluster.model.verifier import Round, VerifierEngine
from tests.helpers import tiny_llama

PROMPT = [5, 9, 2, 7, 7, 3, 1, 4]  # tiny_llama's vocabulary is 10 tokens


def test_a_shared_prefix_is_a_prefill_bit_for_bit():
    runner = TorchModelRunner(tiny_llama(seed=3))
    for s in ("own", "donor", "shared"):
        runner.add_session(s)
    runner.extend("own", PROMPT, num_logits=0)
    runner.extend("donor", PROMPT + [1, 2, 3], num_logits=0)  # the donor has gone on past the prompt
    runner.share_prefix("donor", "shared", len(PROMPT))
    for own, shared in zip(runner._get("own").cache.layers, runner._get("shared").cache.layers):
        assert own.length == shared.length == len(PROMPT)
        assert torch.equal(own.keys[:, :, : own.length], shared.keys[:, :, : shared.length])
        assert torch.equal(own.values[:, :, : own.length], shared.values[:, :, : shared.length])
    assert torch.equal(runner.extend("own", [6, 8]), runner.extend("shared", [6, 8]))


def _decode(engine: VerifierEngine, sessions: list[str], steps: int) -> dict[str, list[int]]:
    """Plain decoding (bonus-only rounds) of every session, `steps` tokens each."""
    out: dict[str, list[int]] = {s: [] for s in sessions}
    for step in range(steps):
        for s in sessions:
            engine.submit(Round(s, step, 0, [], None, True), lambda r, s=s: out[s].extend(r.output_token_ids))
        engine.step()
    return out


def test_choices_opened_on_one_prompt_prefill_it_once_and_decode_as_alone():
    model = tiny_llama(seed=4)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    shared = VerifierEngine(TorchModelRunner(model))
    for i, p in enumerate(params):
        shared.open(f"choice-{i}", PROMPT, p)
    assert shared.shared_prefills == 2
    outs = _decode(shared, [f"choice-{i}" for i in range(3)], 6)
    for i, p in enumerate(params):  # each alone, on an engine of its own
        alone = VerifierEngine(TorchModelRunner(model))
        alone.open("solo", PROMPT, p)
        assert alone.shared_prefills == 0
        assert _decode(alone, ["solo"], 6)["solo"] == outs[f"choice-{i}"]
    other = VerifierEngine(TorchModelRunner(model))
    other.open("a", PROMPT, params[0])
    other.open("b", PROMPT[:-1] + [1], params[0])  # another prompt: prefilled itself
    other.open("c", PROMPT, params[0], features=False)
    assert other.shared_prefills == 1


def test_a_prefill_is_shared_only_between_sessions_of_one_cache_salt():
    """vLLM's `cache_salt`: an open session's prompt KV goes only to a session of the same salt (an unsalted one's
    only to unsalted ones); each session decodes (greedy) as an unsalted one alone does."""
    model = tiny_llama(seed=4)
    alone = VerifierEngine(TorchModelRunner(model))
    alone.open("solo", PROMPT, SamplingParams())
    reference = _decode(alone, ["solo"], 6)["solo"]
    engine = VerifierEngine(TorchModelRunner(model))
    donors = {}
    for sid, salt, shared in [("plain", None, 0), ("a", "tenant-a", 0), ("b", "tenant-b", 0), ("a2", "tenant-a", 1),
                              ("plain2", None, 2)]:
        donors[sid] = engine._prefix_donor(tuple(PROMPT), salt)
        engine.open(sid, PROMPT, SamplingParams(cache_salt=salt))
        assert engine.shared_prefills == shared
    assert donors == {"plain": None, "a": None, "b": None, "a2": "a", "plain2": "plain"}
    assert all(out == reference for out in _decode(engine, list(donors), 6).values())
