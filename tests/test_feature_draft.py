"""`distill_feature` end to end on a tiny budget: the loss goes down, the learning curve is written, an
interrupted run resumes from its checkpoint without recomputing features, and the export round-trips."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.model import models
from drafts.feature_model import load_feature_draft
from drafts.training import feature_draft
from drafts.training.distill import stdlib_texts
from drafts.training.feature_draft import FeatureDistillConfig, distill_feature


@pytest.fixture(scope="module")
def target(model_dir):
    return models.load_causal_lm(model_dir, "bfloat16", "cpu")  # as `tandem drafts distill` loads it


# the exported draft against the trained one: ~60 positions, so that one near-tie flipped by bf16 rounding moves the
# agreement by under 2% (12 positions of one function moved it 8%)
CHECK_TEXT = ("def add(a, b):\n    return a + b\n\n\ndef scale(values, factor):\n    \"\"\"Multiply each value by"
              " factor.\"\"\"\n    return [v * factor for v in values]\n\n\nclass Counter:\n    def __init__(self):\n"
              "        self.count = 0\n")


def test_tiny_run_resumes_and_exports(target, tokenizer, tmp_path, monkeypatch):
    code, prose = stdlib_texts(max_files=40)
    # precision pinned: "auto" times bf16 against fp32 at each start and takes the faster, which under a loaded suite
    # changed between runs (and between the run and its resume), so the trained weights, and their near-ties, did too
    config = FeatureDistillConfig(epochs=4, max_tokens=4096, vocab_size=512, eval_every=8, threads=1, chat_samples=2, unroll=2,
                                  chat_new_tokens=4, batch_size=4, eval_humaneval=1, eval_chat=1, eval_new_tokens=8,
                                  cache_dir=str(tmp_path / "cache"), precision="fp32")
    out = tmp_path / "draft"
    evaluate, calls = feature_draft.evaluate, []

    def interrupted(*a, **kw):  # the run dies at its third evaluation (step 16), after the checkpoint at step 8
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return evaluate(*a, **kw)

    monkeypatch.setattr(feature_draft, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill_feature(target, tokenizer, out, config, texts=(code[:1], prose[:2]))
    monkeypatch.setattr(feature_draft, "evaluate", evaluate)
    cached = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    assert any(p.name.startswith("feats-") for p in cached) and any(p.name.startswith("chat-") for p in cached)
    assert [e["step"] for e in map(json.loads, (out / "learning_curve.jsonl").read_text().splitlines())] == [0, 8]

    meta = distill_feature(target, tokenizer, out, config, texts=(code[:1], prose[:2]))
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*") if p.is_file()} == cached
    curve = [json.loads(line) for line in (out / "learning_curve.jsonl").read_text().splitlines()]
    assert [e["step"] for e in curve] == list(range(0, meta["total_steps"] + 1, 8))
    assert meta["steps"] == meta["total_steps"] == 4 * (32 // 4)  # 32 windows of 128 tokens, batches of 4
    assert curve[-1]["loss"] < curve[1]["loss"]
    assert curve[-1]["tokens_seen"] == meta["steps"] * 4 * 128
    assert {"alpha_pos1", "mean_accepted_of_3"} <= set(curve[-1]["humaneval"]) == set(meta["final_eval"]["humaneval"])
    assert meta["kind"] == "feature" and meta["vocab_size"] == 512 and 0 < meta["cost"]["c"] < 1
    assert sum(meta["data"]["tokens_by_source"].values()) == meta["data"]["tokens"] == 4096

    weights = out / "draft.safetensors"
    assert weights.stat().st_size <= 20 * 2**20
    state = torch.load(out / "checkpoint.pt", weights_only=False)["draft"]
    trained = feature_draft.FeatureDraft(target, state["vocab"])
    trained.load_state_dict(state)
    loaded = load_feature_draft(target, out, torch.float32)
    ids = torch.tensor([tokenizer(CHECK_TEXT)["input_ids"]])  # [1, L]
    with torch.no_grad():
        f = target.model(input_ids=ids).last_hidden_state.float()  # [1, L, H]
        expected = trained.logits(trained(f[:, :-1], ids[:, 1:])[0])  # [1, L-1, K]
        got = loaded.logits(loaded(f[:, :-1], ids[:, 1:])[0])
    assert torch.equal(loaded.vocab, trained.vocab)
    torch.testing.assert_close(got, expected, atol=0.25, rtol=0.02)  # weights rounded to bf16
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
